"""python -m prefill_node --port PORT --model NAME: one prefill node process."""

import argparse
import asyncio

from pdserve.cli import HelpFormatter, add_engine_args, add_security_args, engine_config, internal_security
from pdserve.process import pin_cpus, run_until_signalled, setup_logging


def main() -> None:
    ap = argparse.ArgumentParser(prog="prefill_node", formatter_class=HelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="the interface to listen on")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (printed in the READY line)")
    ap.add_argument("--lease-ttl-s", type=float, default=30.0, help="free a prefill's KV if unread this long")
    ap.add_argument("--kv-tcp-port", type=int, default=0, help="the raw TCP KV data plane's port (0: any free port)")
    ap.add_argument("--no-shm", action="store_true", help="keep the KV out of shared memory (gRPC transfers only)")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any port) (default: no metrics server)")
    add_engine_args(ap)
    add_security_args(ap)
    args = ap.parse_args()
    setup_logging()
    pin_cpus(args.cpus)
    from prefill_node.server import PrefillNode

    asyncio.run(run_until_signalled(
        lambda: PrefillNode(engine_config(args), args.host, args.port, args.lease_ttl_s, shm=not args.no_shm,
                            security=internal_security(args), kv_tcp_port=args.kv_tcp_port),
        metrics_port=args.metrics_port))


if __name__ == "__main__":
    main()
