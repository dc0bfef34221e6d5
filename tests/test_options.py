"""Every option is declared once (a field of its component's config dataclass) and reaches its
component from every entry point that takes it: `python -m prefill_node | decode_node | router`,
`pdserve up` (in its own process and forwarded to its node processes) and the Serve config. Each
walk sets every option to a value that is not its default, at once, and reads the configs the
entry point builds."""

from __future__ import annotations

import pytest

from decode_node.config import DecodeConfig
from engine import EngineConfig
from kvtransfer import transports
from kvtransfer.security import SecurityConfig
from prefill_node.config import PrefillConfig
from router.config import RouterConfig
from serving.options import Option, options, to_argv
from serving.process import ProcessConfig, node_configs

SPECIAL = {
    "block_size": 8,
    "device": "cpu",
    "speculative": {"method": "ngram", "num_speculative_tokens": 3},
    "kv_cache_bytes": 3 << 30,
    "cpus": "0",
}


def other_value(opt: Option):
    """A valid value that is not the option's default."""
    if opt.name in SPECIAL:
        return SPECIAL[opt.name]
    if opt.kind is bool:
        return not opt.default
    if opt.choices:
        return next(c for c in opt.choices if c != opt.default)
    if opt.kind is int:
        return (opt.default or 0) + 7
    if opt.kind is float:
        return (opt.default or 0.0) + 2.5
    return f"{opt.name}-value"


def values(*classes, where: str, skip=()) -> dict:
    return {o.name: other_value(o) for cls in classes for o in options(cls, where) if o.name not in skip}


def argv(given: dict, *classes) -> list[str]:
    """The flags that set `given` (each option's own flag, unit and JSON as the parser takes them)."""
    flags = []
    for cls in classes:
        for o in options(cls, "cli"):
            if o.name in given:
                value = given.pop(o.name)
                flags += [o.flag] if o.kind is bool else [o.flag, _text(o.to_cli(value))]
    return flags


def _text(value) -> str:
    import json

    return json.dumps(value) if isinstance(value, dict) else str(value)


def assert_fields(config, given: dict, where: str = "cli") -> None:
    """Each of config's options at this entry point holds the value given for it."""
    for o in options(type(config), where):
        if o.name in given:
            assert getattr(config, o.name) == given[o.name], f"{type(config).__name__}.{o.name}"


NODES = {"prefill": (PrefillConfig, transports.sender_options()), "decode": (DecodeConfig, transports.reader_options())}


def entry(role: str):
    import importlib

    return importlib.import_module(f"{role}_node.__main__").ENTRY


@pytest.fixture(autouse=True)
def token_file(tmp_path, monkeypatch):
    """The token file the walks name (nodes read it when they start)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "token_file-value").write_text("s3cret\n")


@pytest.mark.parametrize("role", NODES)
def test_every_node_option_reaches_the_node(role):
    config_cls, kv_classes = NODES[role]
    classes = (ProcessConfig, config_cls, *kv_classes, EngineConfig, SecurityConfig)
    given = values(*classes, where="cli")
    assert len(given) >= 25
    args = entry(role).parser().parse_args(argv(dict(given), *classes))
    built = node_configs(args, config_cls, kv_classes)
    for config in (built["engine_config"], built["config"], *built["kv_options"]):
        assert_fields(config, given)
    security = built["security"]
    assert (security.cert, security.key, security.ca, security.token) == (
        given["tls_cert"],
        given["tls_key"],
        given["tls_ca"],
        "s3cret",
    )
    assert (args.host, args.metrics_port, args.cpus) == (given["host"], given["metrics_port"], given["cpus"])


def test_every_router_option_reaches_the_router():
    import router.__main__ as main
    from serving.options import from_args

    given = values(ProcessConfig, RouterConfig, SecurityConfig, where="cli")
    given["public_tls_key"] = "key.pem"  # it goes with the certificate
    args = main.ENTRY.parser().parse_args(
        [
            "--prefill",
            "a:1",
            "--decode",
            "b:2",
            "--model",
            "m",
            *argv(dict(given), ProcessConfig, RouterConfig, SecurityConfig),
        ]
    )
    assert_fields(from_args(RouterConfig, args), given)
    assert_fields(from_args(SecurityConfig, args), given)
    assert args.model == "m" and args.host == given["host"]


def test_every_option_of_pdserve_up_reaches_the_router_and_each_node_process():
    """`pdserve up`'s own router takes its router options; each node process gets, on its
    command line, every engine, security and node-kind option up was given (but the port, its
    threads and the TCP plane's port, which up sets per node)."""
    import argparse

    from pdserve.up import NODE_OPTIONS, Spawner, UpConfig, add_args
    from serving.options import from_args

    classes = (
        UpConfig,
        ProcessConfig,
        RouterConfig,
        *NODE_OPTIONS["prefill"],
        *NODE_OPTIONS["decode"],
        EngineConfig,
        SecurityConfig,
    )
    given = values(*classes, where="cli", skip=("kv_tcp_port", "pin_cpus"))
    given["public_tls_key"] = "key.pem"
    up_parser = argparse.ArgumentParser()
    add_args(up_parser)
    up_args = up_parser.parse_args(argv(dict(given), *classes))
    assert_fields(from_args(RouterConfig, up_args), given)
    assert_fields(from_args(UpConfig, up_args), given)
    spawner = Spawner(up_args, log_dir=None)
    for role, (config_cls, kv_classes) in NODES.items():
        args = entry(role).parser().parse_args(spawner.argv(role, 0)[2:])  # after "-m <role>_node"
        built = node_configs(args, config_cls, kv_classes)
        forwarded = {k: v for k, v in given.items() if k not in ("port", "num_threads")}  # up sets these
        for config in (built["engine_config"], built["config"], *built["kv_options"]):
            assert_fields(config, forwarded)
        assert built["config"].port == 0 and built["engine_config"].num_threads == given["num_threads"]
        assert args.host == given["host"] and args.metrics_port > given["metrics_port"]


def test_every_serve_option_reaches_its_deployment():
    """The Serve config's sections are the same options (minus what Serve decides, plus what only a
    replica has): every one set in its section arrives in the application's arguments."""
    from pdserve.ray_app import parse_args

    def section(*classes) -> tuple[dict, dict]:
        given = values(*classes, where="serve")
        keys = {o.name: o.key for cls in classes for o in options(cls, "serve")}
        return given, {keys[k]: v for k, v in given.items()}

    router, router_section = section(RouterConfig)
    router_section["public_tls_key"] = router["public_tls_key"] = "key.pem"
    engine, engine_section = section(EngineConfig)
    engine_section["model"] = engine["model"] = "m"
    prefill, prefill_section = section(PrefillConfig, *transports.sender_options())
    decode, decode_section = section(DecodeConfig, *transports.reader_options())
    decode_section["kv_transport"] = decode["kv_transport"] = "tcp"  # one the prefill pool serves
    security, security_section = section(SecurityConfig)
    a = parse_args(
        {
            "model": "m",
            "router": router_section,
            "security": security_section,
            "prefill": {"engine": engine_section, **prefill_section},
            "decode": {"engine": engine_section, **decode_section},
        }
    )
    assert_fields(a.router, router, "serve")
    assert_fields(a.security, security, "serve")
    for pool, given in ((a.prefill, prefill), (a.decode, decode)):
        assert_fields(pool.engine, engine, "serve")
        for config in (pool.node, *pool.kv_options):
            assert_fields(config, given, "serve")
    assert router_section["direct_port"] == a.router.port  # its key under Serve


def test_an_option_is_declared_once():
    """No two config classes that `pdserve up` composes into one command line declare the same
    option, except where it is one setting of both (the router's and the engines' context length;
    the port is the router's, the nodes take any), so that one flag means one thing."""
    from pdserve.up import NODE_OPTIONS, UpConfig

    shared = {"max_model_len", "port"}
    classes = (
        UpConfig,
        ProcessConfig,
        RouterConfig,
        *NODE_OPTIONS["prefill"],
        *NODE_OPTIONS["decode"],
        EngineConfig,
        SecurityConfig,
    )
    seen: dict[str, type] = {}
    for cls in classes:
        for o in options(cls, "cli"):
            assert o.name not in seen or o.name in shared, (o.name, seen.get(o.name), cls)
            seen.setdefault(o.name, cls)


def test_up_forwards_only_what_differs_from_the_defaults():
    import argparse

    from pdserve.up import add_args

    ap = argparse.ArgumentParser()
    add_args(ap)
    assert to_argv(ap.parse_args([]), EngineConfig, SecurityConfig) == []
    flags = to_argv(ap.parse_args(["--kv-cache-gb", "0.5", "--no-prefix-caching"]), EngineConfig)
    assert flags == ["--kv-cache-gb", "0.5", "--no-prefix-caching"]
