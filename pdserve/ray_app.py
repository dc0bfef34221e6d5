"""The Ray Serve application: one builder composes and validates the graph.

    router (ingress) ──bind──> prefill pool, decode pool

Serve config (`deploy/serve_config.yaml`) names `pdserve.ray_app:build_app` as the import path and
passes `args`, whose sections are the components' own options (serving/options.py; the same
options as their command lines, minus what Serve decides, plus what only a replica has):

    model: smollm2-135m     # one model: both pools and the router's tokenizer
                            # (the env var PDSERVE_MODEL, where set, overrides it)
    app_name: pdserve       # the registry the replicas announce themselves in
    router:   RouterConfig  # e.g. {direct_port: 50051, kv_layerwise: auto, api_key_file: /keys}
    prefill:  {engine: EngineConfig, PrefillConfig and the KV transports' sender options}
    decode:   {engine: EngineConfig, DecodeConfig and the KV transports' reader options}
    security: SecurityConfig  # the internal ports' TLS and token, on every replica
    kv_transport: auto      # an alias of decode.kv_transport (older configs)

Every key is checked: a misspelled one is an error naming it, not silently dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from decode_node.config import DecodeConfig
from engine import EngineConfig
from kvtransfer import transports
from kvtransfer.security import SecurityConfig
from prefill_node.config import PrefillConfig
from router.config import RouterConfig
from serving.options import check_keys, from_mapping, serve_keys

# Resources a local cluster declares so the deployments' `resources` can be placed (on
# Kubernetes each worker group declares its own).
LOCAL_RESOURCES = {"pdserve_router": 4, "pdserve_prefill": 16, "pdserve_decode": 16}
TOP_KEYS = {"model", "app_name", "kv_transport", "router", "prefill", "decode", "security"}
POOLS = {"prefill": (PrefillConfig, transports.sender_options), "decode": (DecodeConfig, transports.reader_options)}


@dataclass(frozen=True)
class Pool:
    """A pool's settings: its engine, its node options, its KV transports' options."""

    engine: EngineConfig
    node: PrefillConfig | DecodeConfig
    kv_options: tuple


@dataclass(frozen=True)
class AppArgs:
    model: str
    app_name: str
    router: RouterConfig
    prefill: Pool
    decode: Pool
    security: SecurityConfig


def parse_args(args: dict) -> AppArgs:
    """Validates the application's args; raises ValueError naming the key at fault."""
    check_keys("args", args, TOP_KEYS)
    if not args.get("model"):
        raise ValueError("args.model is required (one model for both pools)")
    # PDSERVE_MODEL on the cluster's pods overrides it (how a Kubernetes overlay picks the model).
    model = os.environ.get("PDSERVE_MODEL") or args["model"]
    sections = {name: args.get(name, {}) for name in ("router", "prefill", "decode", "security")}
    for name, section in sections.items():
        check_keys(f"args.{name}", section, _section_keys(name))
    if "kv_transport" in args:  # the older place of decode.kv_transport
        sections["decode"] = {"kv_transport": args["kv_transport"], **sections["decode"]}
        if sections["decode"]["kv_transport"] != args["kv_transport"]:
            raise ValueError("args.kv_transport and args.decode.kv_transport differ: give one")
    pools = {name: _pool(name, sections[name], model) for name in POOLS}
    for field in ("dtype", "deterministic"):  # (the block size too, in deterministic mode: KVLayout.check)
        prefill, decode = getattr(pools["prefill"].engine, field), getattr(pools["decode"].engine, field)
        if prefill != decode:
            raise ValueError(
                f"prefill {field} {prefill!r} != decode {field} {decode!r}: the KV cannot move between them"
            )
    _check_transport(pools["decode"].node.kv_transport, pools["prefill"].kv_options)
    return AppArgs(
        model,
        args.get("app_name", "pdserve"),
        from_mapping(RouterConfig, "args.router", sections["router"]),
        pools["prefill"],
        pools["decode"],
        from_mapping(SecurityConfig, "args.security", sections["security"]),
    )


def _section_keys(name: str) -> set[str]:
    if name in POOLS:
        node_cls, transport_options = POOLS[name]
        return {"engine"} | serve_keys(node_cls, *transport_options())
    return serve_keys({"router": RouterConfig, "security": SecurityConfig}[name])


def _pool(name: str, section: dict, model: str) -> Pool:
    node_cls, transport_options = POOLS[name]
    where = f"args.{name}"
    engine = dict(section.get("engine", {}))
    check_keys(f"{where}.engine", engine, serve_keys(EngineConfig))
    if engine.setdefault("model", model) != model:
        raise ValueError(
            f"{where}.engine.model {engine['model']!r} differs from args.model {model!r}: "
            "both pools must serve the same model"
        )
    return Pool(
        from_mapping(EngineConfig, f"{where}.engine", engine),
        from_mapping(node_cls, where, section),
        tuple(from_mapping(cls, where, section) for cls in transport_options()),
    )


def _check_transport(name: str, sender_options: tuple) -> None:
    """A transport the decode pool is told to use must be one the prefill pool serves."""
    for transport in transports.named(name) if name != "auto" else ():
        off = transport.sender_switch
        if off and not any(getattr(o, off, True) for o in sender_options if isinstance(o, transport.sender_options)):
            raise ValueError(f"args.decode.kv_transport is {name!r} but args.prefill.{off} is false")


def build_app(args: dict):
    """Serve's application builder (import path `pdserve.ray_app:build_app`)."""
    from decode_node.deployment import DecodeDeployment
    from prefill_node.deployment import PrefillDeployment
    from router.deployment import RouterDeployment

    a = parse_args(args)
    prefill = PrefillDeployment.bind(a.app_name, a.prefill.engine, a.prefill.node, a.prefill.kv_options, a.security)
    decode = DecodeDeployment.bind(a.app_name, a.decode.engine, a.decode.node, a.decode.kv_options, a.security)
    # Binding the pools into the router's arguments makes them part of the application; the
    # router reaches their replicas through the registry, one gRPC address per replica.
    return RouterDeployment.bind(a.app_name, a.model, a.router, a.security, pools=(prefill, decode))
