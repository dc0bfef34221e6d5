"""The Serve config and the application builder refuse what Serve would silently drop or what
cannot work (no Ray cluster needed)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from pdserve import serve_config
from pdserve.ray_app import parse_args

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def config():
    return copy.deepcopy(serve_config.load())


def test_the_shipped_config_validates(config):
    schema = serve_config.validate(config)
    app = schema.applications[0]
    assert app.import_path == "pdserve.ray_app:build_app"
    names = {d.name for d in app.deployments}
    assert names == {"Router", "Prefill", "Decode"}
    policies = {
        d["name"]: d["autoscaling_config"]["policy"]["policy_function"]
        for d in config["applications"][0]["deployments"]
        if "autoscaling_config" in d
    }
    assert policies == {"Prefill": "pdserve.autoscaling:PrefillPolicy", "Decode": "pdserve.autoscaling:DecodePolicy"}
    # Each node resolves auto for its own machine (bf16 with native support or on CUDA, else fp32).
    args = config["applications"][0]["args"]
    assert args["prefill"]["engine"]["dtype"] == args["decode"]["engine"]["dtype"] == "auto"


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda c: c.__setitem__("proxy_locaton", "EveryNode"), "proxy_locaton"),
        (lambda c: c["grpc_options"].__setitem__("prot", 1), "grpc_options.prot"),
        (lambda c: c["applications"][0].__setitem__("import_pth", "x"), "applications[0].import_pth"),
        (
            lambda c: c["applications"][0]["deployments"][0].__setitem__("num_replica", 2),
            "applications[0].deployments[0].num_replica",
        ),
        (
            lambda c: c["applications"][0]["deployments"][1]["autoscaling_config"].__setitem__("max_replicsa", 3),
            "applications[0].deployments[1].autoscaling_config.max_replicsa",
        ),
        (
            lambda c: c["applications"][0]["deployments"][1]["autoscaling_config"]["policy"].__setitem__("kwargs", {}),
            "autoscaling_config.policy.kwargs",
        ),
        (
            lambda c: c["applications"][0]["deployments"][0]["ray_actor_options"].__setitem__("num_cpu", 1),
            "ray_actor_options.num_cpu",
        ),
    ],
)
def test_unknown_keys_are_refused(config, mutate, key):
    mutate(config)
    with pytest.raises(ValueError, match="unknown keys") as err:
        serve_config.validate(config)
    assert key in str(err.value)


def args(**overrides):
    base = {
        "model": "smollm2-135m",
        "prefill": {"engine": {"dtype": "bfloat16"}},
        "decode": {"engine": {"dtype": "bfloat16"}},
    }
    base.update(overrides)
    return base


@pytest.mark.parametrize(
    "bad, message",
    [
        (args(model=""), "args.model is required"),
        (args(kv_transport="rdma"), "kv_transport must be one of"),
        (args(routr={}), r"args: unknown key\(s\) \['routr'\]"),
        (args(prefill={"engine": {"dtyp": "bfloat16"}}), r"args.prefill.engine: unknown key\(s\) \['dtyp'\]"),
        (args(decode={"engine": {"model": "other"}}), "both pools must serve the same model"),
        (args(decode={"engine": {"dtype": "float32"}}), "the KV cannot move between them"),
        (
            args(decode={"engine": {"dtype": "bfloat16", "deterministic": True}}),
            "prefill deterministic False != decode deterministic True",
        ),
        (args(decode={"engine": {"max_num_seqs": 0}}), "max_num_seqs must be >= 1"),
        (args(kv_transport="shm", prefill={"shm": False, "engine": {"dtype": "bfloat16"}}), "prefill.shm is false"),
        (args(router={"direct_prt": 1}), "args.router"),
        (
            args(decode={"engine": {"dtype": "bfloat16", "speculative": {"method": "ngram", "k": 4}}}),
            r"speculative: unknown setting\(s\) \['k'\]",
        ),
    ],
)
def test_builder_arguments_are_validated(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_args(bad)


def test_speculative_decoding_is_an_engine_setting(config):
    a = copy.deepcopy(config["applications"][0]["args"])
    a["decode"]["engine"]["speculative"] = {"method": "ngram", "num_speculative_tokens": 4}
    parsed = parse_args(a)
    assert parsed.decode.engine.speculative["num_speculative_tokens"] == 4


def test_builder_fills_in_the_model(config):
    a = parse_args(config["applications"][0]["args"])
    assert a.prefill.engine.model == a.decode.engine.model == "smollm2-135m"


def test_the_planner_policy_is_checked_before_deploying(config, tmp_path):
    """An application-level PlannerPolicy is built by the check: a missing profile or a bad
    argument is named here, not left for Serve's controller to swallow."""
    app = config["applications"][0]
    app["autoscaling_policy"] = {
        "policy_function": "pdserve.autoscaling:PlannerPolicy",
        "policy_kwargs": {"profile": str(tmp_path / "missing.json"), "slo_ttft_s": 8.0, "slo_tpot_s": 0.15},
    }
    with pytest.raises(ValueError, match="missing.json"):
        serve_config.validate(config)
    app["autoscaling_policy"]["policy_kwargs"]["profile"] = str(ROOT / "docs/bench/plan_profile.json")
    serve_config.validate(config)
    app["autoscaling_policy"]["policy_kwargs"]["slo_tpot"] = 0.1
    with pytest.raises(ValueError, match="slo_tpot"):
        serve_config.validate(config)
