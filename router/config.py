"""The router's options (serving/options.py derives its flags and its Serve config section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from engine.config import option
from kvtransfer.security import Security
from router.placement import MAX_LOCAL_TOKENS, MODES, Placement
from router.pool import AFFINITY_TOKENS
from serving.tool_calls import TOOL_CALL_PARSERS

KV_LAYERWISE = ("auto", "on", "off")


@dataclass(frozen=True)
class RouterConfig:
    cli_title: ClassVar[str] = "router"

    port: int = option(
        50051,
        "the router's gRPC port (0: any); under Serve, the replica's own port beside Serve's proxies",
        serve_key="direct_port",
    )
    http_port: int | None = option(
        None,
        "also serve the OpenAI-compatible HTTP API on this port (0: any) (default: "
        "gRPC only; under Serve, Serve's HTTP proxy serves it)",
        where=("cli",),
    )
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's context length)")
    kv_layerwise: str = option(
        "auto",
        "stream the KV layer by layer while the prompt computes; auto: where the "
        "decode node's transport for that prefill node streams layers (across hosts, or "
        "--kv-transport tcp)",
        choices=KV_LAYERWISE,
    )
    cache_affinity_tokens: int = option(
        AFFINITY_TOKENS,
        "cache-aware routing: cached prompt tokens on a node worth "
        "one more request in flight there; 0 ignores the nodes' prefix caches",
    )
    local_prefill: str = option(
        "auto",
        "conditional disaggregation: auto prefills a request on its decode node when "
        "that is measured to be sooner than the prefill pool (a chat follow-up whose history "
        "the decode node caches); off: always the prefill pool; always: always the decode "
        "node",
        choices=MODES,
    )
    max_local_prefill_tokens: int = option(
        MAX_LOCAL_TOKENS, "auto: the most uncached tokens a decode node may prefill itself"
    )
    max_local_prefill_tpot: float | None = option(
        None,
        "auto: no local prefill starts while the sequences decoding on that node get their tokens "
        "further apart than this many seconds (their recent time per output token); set under a "
        "TPOT SLO, it keeps local prefills to the decode node's spare steps (default: no bound)",
    )
    late_binding: bool = option(
        True,
        "auto: a request whose place is a decode node already computing a local prefill is sent there on "
        "arrival and queues (by default the router holds it and places it again when a prefill ends, so a "
        "prefill node that frees first takes it)",
    )
    chat_template: str | None = option(
        None, "a Jinja chat template file to render chat requests with instead of the model's own"
    )
    tool_call_parser: str = option(
        "auto",
        "the format tool calls are parsed in under tool_choice auto; auto: the one the chat template's "
        "markers name (hermes for <tool_call>, mistral for [TOOL_CALLS], llama3_json for <|python_tag|>)",
        choices=TOOL_CALL_PARSERS,
    )
    max_outstanding: int = option(1024, "requests in flight at the router before RESOURCE_EXHAUSTED")
    rate_limit: float | None = option(None, "requests/s per client at the router (default: no limit)")
    api_key_file: str | None = option(
        None,
        "API keys, one per line: clients of the public gRPC and HTTP APIs must "
        "send one as authorization: Bearer <key> (default: none, the APIs are open)",
    )
    public_tls_cert: str | None = option(None, "PEM certificate of the public (router) port")
    public_tls_key: str | None = option(None, "PEM private key of the public port")
    host: str = option("0.0.0.0", "the interface the router replica's own port listens on", where=("serve",))
    discovery_interval_s: float = option(0.5, "how often the router replica reads the node registry", where=("serve",))

    def __post_init__(self):
        if self.kv_layerwise not in KV_LAYERWISE:
            raise ValueError(f"kv_layerwise must be one of {KV_LAYERWISE}, got {self.kv_layerwise!r}")
        Placement(  # raises naming the setting
            self.local_prefill, self.max_local_prefill_tokens, max_local_tpot_s=self.max_local_prefill_tpot
        )
        if self.cache_affinity_tokens < 0:
            raise ValueError(f"cache_affinity_tokens must be >= 0, got {self.cache_affinity_tokens}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1, got {self.max_outstanding}")
        if self.rate_limit is not None and self.rate_limit <= 0:
            raise ValueError(f"rate_limit must be > 0 requests/s, got {self.rate_limit}")
        if bool(self.public_tls_cert) != bool(self.public_tls_key):
            raise ValueError("public_tls_cert and public_tls_key go together")

    def public_security(self) -> Security:
        """The public port's TLS and API keys."""
        return Security.from_files(self.public_tls_cert, self.public_tls_key, api_key_file=self.api_key_file)
