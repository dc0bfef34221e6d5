"""python -m router --prefill ADDR[,ADDR] --decode ADDR[,ADDR] [options]: the router as its own process."""

from engine import EngineConfig
from kvtransfer.security import SecurityConfig
from router.config import RouterConfig
from router.server import Router
from serving.options import add_options, from_args
from serving.process import Entry


def add_args(ap) -> None:
    ap.add_argument("--prefill", required=True, help="comma-separated prefill node addresses")
    ap.add_argument("--decode", required=True, help="comma-separated decode node addresses")
    add_options(ap, EngineConfig, only=("model",), helps={"model": "the model the nodes serve (its tokenizer)"})
    add_options(ap, RouterConfig, SecurityConfig)


def build(args) -> Router:
    return Router(
        args.model,
        args.prefill.split(","),
        args.decode.split(","),
        from_args(RouterConfig, args),
        host=args.host,
        internal_security=from_args(SecurityConfig, args).security(),
    )


ENTRY = Entry(
    "router",
    "The router: the public gRPC (and OpenAI HTTP) API in front of the prefill and decode pools.",
    add_args,
    build,
)

if __name__ == "__main__":
    ENTRY.main()
