"""The `pdserve` command."""

from __future__ import annotations

import argparse
import sys
import time

from pdserve.process import pin_cpus
from router.placement import add_placement_args

DTYPE_HELP = "auto: bfloat16 on CUDA and on CPUs with native bf16 (AMX or AVX512_BF16), float32 on other CPUs"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every option's default: a help text that names its default in words
    ("default: torch's choice") keeps it; unset means "none", a flag's default is "off"; a
    required option says so."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required:
            return f"{text} (required)".lstrip()
        if "default:" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:  # store_true / store_false: the flag is not given
            shown = "off"
        elif action.default is None or action.default == []:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})".lstrip()


def add_engine_args(p: argparse.ArgumentParser, num_threads_default: str = "torch's choice") -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="short name (smollm2-135m), a Hugging Face directory, or a .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help=DTYPE_HELP)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory for the KV cache")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one decode batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="tokens in one forward at most")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full (by default the KV of full blocks of a prompt prefix seen "
                        "before is reused)")
    p.add_argument("--speculative-config", type=speculative_json, default=None, metavar="JSON",
                   help='speculative decoding on decode steps, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                        "settings in engine/speculative.py (default: off)")
    p.add_argument("--num-threads", type=int, default=None, help=f"torch threads (default: {num_threads_default})")
    p.add_argument("--cpus", default=None,
                   help="pin the process, and the processes it starts, to these cores, e.g. 0 or 0-1 (default: not pinned)")


def speculative_json(text: str) -> dict:
    import json

    from engine.speculative import SpeculativeConfig

    try:
        settings = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    try:
        SpeculativeConfig.from_dict(settings)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return settings


def add_security_args(p: argparse.ArgumentParser, public: bool = False) -> None:
    g = p.add_argument_group("security (internal ports: mutual TLS when a CA is given, and/or a token)")
    g.add_argument("--tls-cert", help="PEM certificate of this process (server, and client for mTLS)")
    g.add_argument("--tls-key", help="PEM private key")
    g.add_argument("--tls-ca", help="PEM CA that signs the cluster's certificates (enables mutual TLS)")
    g.add_argument("--token-file", help="file holding the shared internal bearer token")
    if public:
        g.add_argument("--public-tls-cert", help="PEM certificate of the public (router) port")
        g.add_argument("--public-tls-key", help="PEM private key of the public port")
        g.add_argument("--api-key-file", default=None,
                       help="API keys, one per line: clients of the public gRPC and HTTP APIs must send one as "
                            "authorization: Bearer <key> (default: none, the APIs are open)")


def internal_security(args):
    from pdserve.security import Security

    return Security.from_files(args.tls_cert, args.tls_key, args.tls_ca, args.token_file,
                               require_client_cert=bool(args.tls_ca))


def public_security(args):
    from pdserve.security import Security

    return Security.from_files(args.public_tls_cert, args.public_tls_key, api_key_file=args.api_key_file)


def security_args(args) -> list[str]:
    """The internal security flags, to pass on to node processes."""
    return [x for flag in ("tls_cert", "tls_key", "tls_ca", "token_file") if getattr(args, flag)
            for x in (f"--{flag.replace('_', '-')}", getattr(args, flag))]


def engine_config(args):
    from engine import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)), max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        block_size=args.block_size, num_threads=args.num_threads,
                        enable_prefix_caching=not args.no_prefix_caching, speculative=args.speculative_config)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 disables it")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                   "whose probability reaches p; 1 disables it")
    p.add_argument("--seed", type=int, default=None, help="per-request seed: the same seed gives the same tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args):
    from engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=args.stop)


def rpc_error(e) -> str:
    """A gRPC error as one line: 'STATUS: details'."""
    return f"{e.code().name}: {' '.join((e.details() or '').split())}"


def cmd_generate_offline(args) -> int:
    from engine import LLM
    from engine.tokenizer import apply_chat_template

    pin_cpus(args.cpus)
    started = time.perf_counter()
    llm = LLM(**vars(engine_config(args)))
    loaded = time.perf_counter()
    prompt = args.prompt
    if not args.raw and llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None):
        prompt = apply_chat_template(llm.tokenizer, [{"role": "user", "content": prompt}])
    out = llm.generate(prompt, sampling_params(args))[0]
    done = time.perf_counter()
    print(out.text)
    n = len(out.token_ids)
    print(f"[{llm.engine.model_dir.name} on {llm.engine.device} {str(llm.engine.dtype).replace('torch.', '')}: "
          f"load {loaded - started:.1f} s, {len(out.prompt_token_ids)} prompt + {n} generated tokens "
          f"in {done - loaded:.2f} s ({n / (done - loaded):.1f} tokens/s), finish: {out.finish_reason}]",
          file=sys.stderr)
    return 0


def cmd_up(args) -> int:
    import asyncio

    import grpc

    from pdserve.process import setup_logging
    from pdserve.up import NodeFailed, up

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

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
                "top_p": args.top_p, "stop": args.stop}
    if args.seed is not None:
        sampling["seed"] = args.seed
    try:
        from pdserve.security import Security, read_api_keys

        metadata = [("application", args.application)] if args.application else None
        security = Security(ca=args.tls_ca, token=read_api_keys(args.api_key_file)[0] if args.api_key_file else None)
        stream_answer(args.addr, args.prompt, chat=not args.raw, as_json=args.json, timeout=args.timeout,
                      metadata=metadata, security=security, **sampling)
    except grpc.RpcError as e:  # stream_answer ended any streamed text with a newline
        print(f"pdserve: error: {rpc_error(e)}", file=sys.stderr)
        return 1
    return 0


def cmd_serve(args) -> int:
    from pdserve.ray_serve import serve

    return serve(args.config, args.address, args.timeout)


def cmd_bench(args) -> int:
    from pdserve import bench

    return bench.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--version", action="version", version=f"pdserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, description: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=f"{help[0].upper()}{help[1:]}. {description}".strip(),
                              formatter_class=HelpFormatter)

    p = command("up", "start a router + prefill and decode node processes on this host",
                "Stops everything, exiting 1, when a node process exits; node logs go to --log-dir.")
    p.add_argument("--prefill", type=int, default=1, help="prefill node processes")
    p.add_argument("--decode", type=int, default=1, help="decode node processes")
    p.add_argument("--host", default="127.0.0.1", help="the interface every process listens on")
    p.add_argument("--port", type=int, default=50051, help="the router's gRPC port")
    p.add_argument("--kv-transport", default="auto", choices=["auto", "shm", "tcp", "grpc"],
                   help="auto: shared memory when prefill and decode nodes share a host, else the raw TCP data plane")
    add_placement_args(p)
    p.add_argument("--kv-layerwise", default="auto", choices=["auto", "on", "off"],
                   help="stream the KV layer by layer while the prompt computes (tcp only); auto: where the decode node reads over tcp (across hosts, or --kv-transport tcp)")
    p.add_argument("--ask", help="ask this question once the cluster is up, stream the answer, then stop "
                   "(default: serve until Ctrl-C)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics: the router on this port, the nodes on the next ones")
    p.add_argument("--node-restarts", type=int, default=5,
                   help="a node that exits while serving is restarted, at most this many times in 5 minutes; one "
                        "more exit stops everything (0: the first exit does)")
    p.add_argument("--pin-cpus", action="store_true", help="give each node process its own core (round robin over --cpus, or all cores)")
    p.add_argument("--max-tokens", type=int, default=256, help="with --ask")
    p.add_argument("--rate-limit", type=float, default=None, help="requests/s per client at the router")
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port (0: any)")
    p.add_argument("--max-outstanding", type=int, default=1024,
                   help="requests in flight at the router before RESOURCE_EXHAUSTED")
    p.add_argument("--log-dir", default=None,
                   help="each node's log (its stderr) goes to <role>-<index>.log here (default: a new temporary "
                        "directory, printed at start)")
    add_engine_args(p, num_threads_default="the cores divided among the node processes")
    add_security_args(p, public=True)
    p.set_defaults(func=cmd_up)

    p = command("serve", "deploy pdserve on a Ray cluster (Ray Serve), from a Serve config file")
    p.add_argument("--config", default=None, help="Serve config (default: deploy/serve_config.yaml)")
    p.add_argument("--address", default=None,
                   help="an existing Ray cluster (e.g. auto or HOST:6379) (default: a local one, started here "
                        "and stopped with Ctrl-C)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the application to run")
    p.set_defaults(func=cmd_serve)

    p = command("bench", "load-test a pdserve address: TTFT, TPOT, latency, TPS, QPS, goodput")
    from pdserve.bench import add_args as add_bench_args

    add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = command("generate", "ask a running pdserve router; streams the answer",
                "Decoding is greedy (temperature 0) unless --temperature is given.")
    p.add_argument("prompt", help="the question (sent as a user message unless --raw)")
    p.add_argument("--addr", default="127.0.0.1:50051", help="the router's HOST:PORT")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, usage) at the end")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--application", default=None,
                   help="through Ray Serve's gRPC proxy: the application name (sent as metadata)")
    p.add_argument("--tls-ca", help="trust this CA for a TLS router (default: plaintext)")
    p.add_argument("--api-key-file", help="the router's API key (its first line), sent as authorization: Bearer")
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = command("generate-offline", "run the engine in this process on one prompt",
                "Decoding is greedy (temperature 0) unless --temperature is given.")
    p.add_argument("prompt", help="the question (chat template applied unless --raw)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate_offline)
    args = parser.parse_args(argv)
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
