"""The `pdserve` command."""

from __future__ import annotations

import argparse
import sys
import time

from engine import EngineConfig
from router.config import RouterConfig
from serving.options import HelpFormatter, add_options, from_args
from serving.process import ProcessConfig, pin_cpus


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 disables it")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens whose probability reaches p; 1 disables it",
    )
    p.add_argument("--seed", type=int, default=None, help="per-request seed: the same seed gives the same tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]: subtracted once a token is out")
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="in [-2, 2]: subtracted per time a token is out"
    )
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="(0, 10]: divides the logit of a prompt or output token"
    )
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than min-p x the most likely")
    p.add_argument("--min-tokens", type=int, default=0, help="EOS and stop strings wait until this many tokens are out")
    p.add_argument(
        "--bad-word", action="append", default=[], dest="bad_words", help="a word never written (repeatable)"
    )
    held = p.add_mutually_exclusive_group()
    held.add_argument("--json-schema", metavar="FILE", help="hold the output to the JSON schema in FILE")
    held.add_argument("--regex", help="hold the output to this regular expression")
    held.add_argument("--choice", action="append", help="hold the output to one of these strings (repeatable)")


NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0}


def sampling_fields(args) -> dict:
    """The sampling flags as the wire's SamplingParams fields (those at their neutral value left out)."""
    fields = {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_k", "top_p", "stop")}
    fields |= {name: getattr(args, name) for name, neutral in NEUTRAL.items() if getattr(args, name) != neutral}
    if args.seed is not None:
        fields["seed"] = args.seed
    if args.bad_words:
        fields["bad_words"] = args.bad_words
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                fields["structured_output"] = {"kind": "json_schema", "spec": f.read()}
        except OSError as e:
            raise SystemExit(f"pdserve: error: --json-schema: cannot read {args.json_schema}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise SystemExit(f"pdserve: error: --json-schema: {args.json_schema} is not UTF-8 text") from None
    elif args.regex is not None:
        fields["structured_output"] = {"kind": "regex", "spec": args.regex}
    elif args.choice:
        import json

        fields["structured_output"] = {"kind": "choice", "spec": json.dumps(args.choice)}
    return fields


def sampling_params(fields: dict, tokenizer=None):
    """The engine's SamplingParams of sampling_fields; raises ValueError naming a bad value. Bad
    words are tokenized (as a router would) when a tokenizer is given: without one, the flags are
    checked before a model loads."""
    from engine import SamplingParams
    from engine.structured_output import StructuredOutput
    from engine.tokenizer import bad_words_token_ids

    fields = dict(fields)
    bad_words = fields.pop("bad_words", None)
    if bad_words and tokenizer is not None:
        fields["bad_words_token_ids"] = bad_words_token_ids(tokenizer, bad_words)
    if "structured_output" in fields:
        fields["structured_output"] = StructuredOutput(**fields["structured_output"])
        fields["structured_output"].grammar()  # a malformed spec is named here, not after the load
    return SamplingParams(**fields)


def rpc_error(e) -> str:
    """A gRPC error as one line: 'STATUS: details'."""
    return f"{e.code().name}: {' '.join((e.details() or '').split())}"


def cmd_generate_offline(args) -> int:
    from engine import LLM
    from engine.tokenizer import apply_chat_template

    pin_cpus(args.cpus)
    fields = sampling_fields(args)
    try:
        sampling_params(fields)
    except ValueError as e:  # a bad flag value, named before the model loads
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    llm = LLM(**vars(from_args(EngineConfig, args)))
    loaded = time.perf_counter()
    prompt = args.prompt
    if not args.raw and llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None):
        prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": prompt}])
    try:
        out = llm.generate(prompt, sampling_params(fields, llm.tokenizer))[0]
    except ValueError as e:  # a bad flag value, named
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 1
    done = time.perf_counter()
    print(out.text)
    n = len(out.token_ids)
    print(
        f"[{llm.engine.model_dir.name} on {llm.engine.device} {str(llm.engine.dtype).replace('torch.', '')}: "
        f"load {loaded - started:.1f} s, {len(out.prompt_token_ids)} prompt + {n} generated tokens "
        f"in {done - loaded:.2f} s ({n / (done - loaded):.1f} tokens/s), finish: {out.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def cmd_up(args) -> int:
    import asyncio

    import grpc

    from pdserve.up import NodeFailed, up
    from serving.process import setup_logging

    setup_logging("WARNING")
    pin_cpus(args.cpus)  # the router here, and every node process (they inherit it)
    try:
        return asyncio.run(up(args))
    except (NodeFailed, OSError) as e:  # one line, not a traceback (a node's is in its log)
        print(f"pdserve up: error: {e}", file=sys.stderr)
    except grpc.RpcError as e:  # --ask
        print(f"pdserve up: error: {rpc_error(e)}", file=sys.stderr)
    return 1


def cmd_generate(args) -> int:
    import grpc

    from pdserve.generate import stream_answer

    sampling = sampling_fields(args)
    try:
        from kvtransfer.security import Security, read_api_keys

        metadata = [("application", args.application)] if args.application else None
        security = Security(ca=args.tls_ca, token=read_api_keys(args.api_key_file)[0] if args.api_key_file else None)
        stream_answer(
            args.addr,
            args.prompt,
            chat=not args.raw,
            as_json=args.json,
            timeout=args.timeout,
            metadata=metadata,
            security=security,
            **sampling,
        )
    except grpc.RpcError as e:  # stream_answer ended any streamed text with a newline
        print(f"pdserve: error: {rpc_error(e)}", file=sys.stderr)
        return 1
    return 0


def cmd_colocated(args) -> int:
    from pdserve.colocated import run

    return run(args)


def cmd_serve(args) -> int:
    from pdserve.ray_serve import serve

    return serve(args.config, args.address, args.timeout)


def cmd_plan(args) -> int:
    from pdserve.plan import cli as plan

    return plan.main(args)


def cmd_bench(args) -> int:
    from pdserve import bench

    return bench.main(args)


def parser() -> argparse.ArgumentParser:
    """Every command and its options."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--version", action="version", version=f"pdserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, description: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=f"{help[0].upper()}{help[1:]}. {description}".strip(),
            formatter_class=HelpFormatter,
        )

    p = command(
        "up",
        "start a router + prefill and decode node processes on this host",
        "Stops everything, exiting 1, when a node process exits; node logs go to --log-dir.",
    )
    from pdserve.up import add_args as add_up_args

    add_up_args(p)
    p.set_defaults(func=cmd_up)

    p = command(
        "colocated",
        "serve one engine doing both phases (no disaggregation) behind the same API",
        "The baseline disaggregation is compared with: as one vLLM instance, prefill chunks mixed into "
        "the decode batch. Prints READY <address> once it serves.",
    )
    add_options(p, ProcessConfig)
    add_options(
        p,
        RouterConfig,
        only=("port",),
        helps={"port": "the gRPC port, as the router's (0: any; printed in the READY line)"},
    )
    add_options(p, EngineConfig)
    p.set_defaults(func=cmd_colocated)

    p = command("serve", "deploy pdserve on a Ray cluster (Ray Serve), from a Serve config file")
    p.add_argument("--config", default=None, help="Serve config (default: deploy/serve_config.yaml)")
    p.add_argument(
        "--address",
        default=None,
        help="an existing Ray cluster (e.g. auto or HOST:6379) (default: a local one, started here "
        "and stopped with Ctrl-C)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the application to run")
    p.set_defaults(func=cmd_serve)

    p = command(
        "plan",
        "size a deployment before running it: `plan memory` (weights, KV per token, tokens a node holds), "
        "`plan profile` (measure this machine), `plan simulate` (predict a deployment), `plan best` "
        "(the deployment for a workload, SLOs and cores)",
    )
    from pdserve.plan.cli import add_args as add_plan_args

    add_plan_args(p)
    p.set_defaults(func=cmd_plan)

    p = command("bench", "load-test a pdserve address: TTFT, TPOT, latency, TPS, QPS, goodput")
    from pdserve.bench import add_args as add_bench_args

    add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = command(
        "generate",
        "ask a running pdserve router; streams the answer",
        "Decoding is greedy (temperature 0) unless --temperature is given.",
    )
    p.add_argument("prompt", help="the question (sent as a user message unless --raw)")
    p.add_argument("--addr", default=f"127.0.0.1:{RouterConfig.port}", help="the router's HOST:PORT")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, usage) at the end")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument(
        "--application", default=None, help="through Ray Serve's gRPC proxy: the application name (sent as metadata)"
    )
    p.add_argument("--tls-ca", help="trust this CA for a TLS router (default: plaintext)")
    p.add_argument("--api-key-file", help="the router's API key (its first line), sent as authorization: Bearer")
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = command(
        "generate-offline",
        "run the engine in this process on one prompt",
        "Decoding is greedy (temperature 0) unless --temperature is given.",
    )
    p.add_argument("prompt", help="the question (chat template applied unless --raw)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_options(p, ProcessConfig, only=("cpus",))
    add_options(p, EngineConfig)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate_offline)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import grpc

    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:  # a server that refused, or none at the address: one line, no traceback
        print(f"pdserve: error: {rpc_error(e)}", file=sys.stderr)
        return 1
    except OSError as e:  # a file that cannot be read, a port that cannot be bound
        print(f"pdserve: error: {f'{e.filename}: {e.strerror}' if e.filename else e}", file=sys.stderr)
        return 1


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pdserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


if __name__ == "__main__":
    sys.exit(main())
