"""python -m router --prefill ADDR[,ADDR] --decode ADDR[,ADDR]: the router as its own process."""

import argparse
import asyncio

from pdserve.cli import HelpFormatter, add_security_args, internal_security, public_security
from pdserve.process import run_until_signalled, setup_logging
from router.placement import add_placement_args, placement_kwargs


def main() -> None:
    ap = argparse.ArgumentParser(prog="router", formatter_class=HelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="the interface to listen on")
    ap.add_argument("--port", type=int, default=50051, help="the gRPC port (0: any)")
    ap.add_argument("--model", default="smollm2-135m", help="the model the nodes serve (its tokenizer and limits)")
    ap.add_argument("--prefill", required=True, help="comma-separated prefill node addresses")
    ap.add_argument("--decode", required=True, help="comma-separated decode node addresses")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="longest prompt + output in tokens (default: the model's context length)")
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="serve Prometheus /metrics here (0: any port) (default: no metrics server)")
    ap.add_argument("--http-port", type=int, default=None,
                    help="also serve the OpenAI-compatible HTTP API here (default: gRPC only)")
    ap.add_argument("--kv-layerwise", default="auto", choices=["auto", "on", "off"],
                    help="stream the KV layer by layer while the prompt computes (tcp only); auto: where the decode node reads over tcp (across hosts, or --kv-transport tcp)")
    add_placement_args(ap)
    add_security_args(ap, public=True)
    args = ap.parse_args()
    setup_logging()
    from router.server import Router

    asyncio.run(run_until_signalled(lambda: Router(args.model, args.prefill.split(","), args.decode.split(","),
                                                   args.host, args.port, args.max_model_len,
                                                   public_security=public_security(args),
                                                   internal_security=internal_security(args),
                                                   http_port=args.http_port, kv_layerwise=args.kv_layerwise,
                                                   **placement_kwargs(args)),
                                    metrics_port=args.metrics_port))


if __name__ == "__main__":
    main()
