"""python -m decode_node --port PORT --model NAME: one decode node process."""

import argparse
import asyncio

from kvtransfer.receiver import TRANSPORTS
from kvtransfer.tcp import DEFAULT_CONNECTIONS
from pdserve.cli import HelpFormatter, add_engine_args, add_security_args, engine_config, internal_security
from pdserve.process import pin_cpus, run_until_signalled, setup_logging


def main() -> None:
    ap = argparse.ArgumentParser(prog="decode_node", formatter_class=HelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="the interface to listen on")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (printed in the READY line)")
    ap.add_argument("--kv-transport", default="auto", choices=TRANSPORTS,
                    help="auto: shared memory when the prefill node is on this host, else the raw TCP data plane")
    ap.add_argument("--kv-tcp-connections", type=int, default=DEFAULT_CONNECTIONS,
                    help="parallel connections per KV read on the tcp transport (each reads a range of layers)")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any port) (default: no metrics server)")
    add_engine_args(ap)
    add_security_args(ap)
    args = ap.parse_args()
    setup_logging()
    pin_cpus(args.cpus)
    from decode_node.server import DecodeNode

    asyncio.run(run_until_signalled(lambda: DecodeNode(engine_config(args), args.host, args.port, args.kv_transport,
                                                       security=internal_security(args),
                                                       kv_tcp_connections=args.kv_tcp_connections),
                                    metrics_port=args.metrics_port))


if __name__ == "__main__":
    main()
