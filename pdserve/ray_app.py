"""The Ray Serve application: one builder composes and validates the graph.

    router (ingress) ──bind──> prefill pool, decode pool

Serve config (`deploy/serve_config.yaml`) names `pdserve.ray_app:build_app` as the import path and
passes `args`:

    model: smollm2-135m            # one model: both pools and the router's tokenizer
                                   # (the env var PDSERVE_MODEL, where set, overrides it)
    app_name: pdserve              # the registry the replicas announce themselves in
    kv_transport: auto             # auto (shm on one Ray node, else tcp), shm, tcp, grpc
    router:  {direct_port: 50051, max_model_len: null, discovery_interval_s: 0.5,
              kv_layerwise: auto,  # auto, on, off: stream the KV layer by layer (tcp)
              cache_affinity_tokens: 512, local_prefill: auto, max_local_prefill_tokens: 1024}
    prefill: {engine: {...EngineConfig fields...}, lease_ttl_s: 30, shm: true, drain_timeout_s: 60, port: 0}
    decode:  {engine: {...EngineConfig fields...}, drain_timeout_s: 600, port: 0}

Every key is checked: a misspelled one is an error naming it, not silently dropped.
"""

from __future__ import annotations

import dataclasses
import os

from engine import EngineConfig
from router.placement import MAX_LOCAL_TOKENS, Placement

ROUTER_KEYS = {"direct_port", "max_model_len", "discovery_interval_s", "host", "kv_layerwise",
               "cache_affinity_tokens", "local_prefill", "max_local_prefill_tokens"}
PREFILL_KEYS = {"engine", "lease_ttl_s", "shm", "drain_timeout_s", "port"}
DECODE_KEYS = {"engine", "drain_timeout_s", "port"}
# Resources a local cluster declares so the deployments' `resources` can be placed (on
# Kubernetes each worker group declares its own).
LOCAL_RESOURCES = {"pdserve_router": 4, "pdserve_prefill": 16, "pdserve_decode": 16}
TOP_KEYS = {"model", "app_name", "kv_transport", "router", "prefill", "decode"}
ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)}
KV_TRANSPORTS = ("auto", "shm", "tcp", "grpc")


def _check_keys(section: str, given: dict, allowed: set[str]) -> None:
    if not isinstance(given, dict):
        raise ValueError(f"{section} must be a mapping, got {type(given).__name__}")
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def parse_args(args: dict) -> dict:
    """Validates the application's args; returns them complete, with EngineConfigs built."""
    _check_keys("args", args, TOP_KEYS)
    if not args.get("model"):
        raise ValueError("args.model is required (one model for both pools)")
    # PDSERVE_MODEL on the cluster's pods overrides it (how a Kubernetes overlay picks the model).
    model = os.environ.get("PDSERVE_MODEL") or args["model"]
    kv_transport = args.get("kv_transport", "auto")
    if kv_transport not in KV_TRANSPORTS:
        raise ValueError(f"args.kv_transport must be one of {KV_TRANSPORTS}, got {kv_transport!r}")
    router, prefill, decode = args.get("router", {}), args.get("prefill", {}), args.get("decode", {})
    _check_keys("args.router", router, ROUTER_KEYS)
    if router.get("kv_layerwise", "auto") not in ("auto", "on", "off"):
        raise ValueError(f"args.router.kv_layerwise must be one of auto, on, off, got {router['kv_layerwise']!r}")
    Placement(router.get("local_prefill", "auto"), router.get("max_local_prefill_tokens", MAX_LOCAL_TOKENS))
    if router.get("cache_affinity_tokens", 0) < 0:
        raise ValueError(f"args.router.cache_affinity_tokens must be >= 0, got {router['cache_affinity_tokens']}")
    _check_keys("args.prefill", prefill, PREFILL_KEYS)
    _check_keys("args.decode", decode, DECODE_KEYS)
    engines = {}
    for pool, section in (("prefill", prefill), ("decode", decode)):
        engine = dict(section.get("engine", {}))
        _check_keys(f"args.{pool}.engine", engine, ENGINE_KEYS)
        if engine.setdefault("model", model) != model:
            raise ValueError(f"args.{pool}.engine.model {engine['model']!r} differs from args.model {model!r}: "
                             "both pools must serve the same model")
        engines[pool] = EngineConfig(**engine)  # validates each value
    if engines["prefill"].dtype != engines["decode"].dtype:
        raise ValueError(f"prefill dtype {engines['prefill'].dtype!r} != decode dtype {engines['decode'].dtype!r}: "
                         "the KV cannot move between them")
    if kv_transport == "shm" and not prefill.get("shm", True):
        raise ValueError("args.kv_transport is 'shm' but args.prefill.shm is false")
    return {"model": model, "app_name": args.get("app_name", "pdserve"), "kv_transport": kv_transport,
            "router": router, "prefill": {**prefill, "engine": dataclasses.asdict(engines["prefill"])},
            "decode": {**decode, "engine": dataclasses.asdict(engines["decode"])}}


def build_app(args: dict):
    """Serve's application builder (import path `pdserve.ray_app:build_app`)."""
    from decode_node.deployment import DecodeDeployment
    from prefill_node.deployment import PrefillDeployment
    from router.deployment import RouterDeployment

    a = parse_args(args)
    prefill = PrefillDeployment.bind(a["app_name"], **a["prefill"])
    decode = DecodeDeployment.bind(a["app_name"], kv_transport=a["kv_transport"], **a["decode"])
    # Binding the pools into the router's arguments makes them part of the application; the
    # router reaches their replicas through the registry, one gRPC address per replica.
    return RouterDeployment.bind(a["app_name"], a["model"], pools=(prefill, decode), **a["router"])
