"""`pdserve plan memory`: its counts are the real model's (parameters as transformers counts them,
KV bytes per token as the engine allocates them), the shipped example configs give the public
sizes, and bad input is one line naming what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_engine
from tiny_models import make_tiny_model

from engine.model_config import ModelConfig
from pdserve.plan.memory import GB, memory

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "deploy" / "model_configs"


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "plan", "memory", *args], capture_output=True, text=True, cwd=ROOT
    )


@pytest.mark.parametrize("arch, tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_counts_are_the_checkpoints_and_the_engines(tmp_path, arch, tie):
    from transformers import AutoModelForCausalLM

    model = make_tiny_model(tmp_path, arch, tie=tie)
    cfg = ModelConfig.from_dir(model)
    p = memory(cfg, "float32")
    assert p["num_params"] == AutoModelForCausalLM.from_pretrained(model).num_parameters()
    engine = make_engine(model, dtype="float32")
    assert p["kv_bytes_per_token"] == engine.kv_cache.bytes_per_block // engine.config.block_size
    assert memory(cfg, "bfloat16")["weight_bytes"] * 2 == p["weight_bytes"]


def test_the_example_configs_have_the_public_sizes():
    sizes = {"llama-3.2-1b": 1.24e9, "llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.55e9}
    for name, params in sizes.items():
        p = memory(ModelConfig.from_dir(EXAMPLES / name), "bfloat16")
        assert abs(p["num_params"] - params) / params < 0.005, (name, p["num_params"])
    # 8B: 2 x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB of KV per token in bf16
    r = plan("--config", str(EXAMPLES / "llama-3.1-8b" / "config.json"), "--dtype", "bfloat16",
             "--memory-gb", "80", "--seq-len", "4096", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kv_bytes_per_token"] == 131072
    assert out["max_tokens"] == (80 * GB - out["weight_bytes"]) // 131072
    assert out["max_sequences"] == out["max_tokens"] // 4096


@pytest.mark.parametrize(
    "args, says",
    [
        (["--dtype", "bfloat16", "--memory-gb", "80"], "do not fit"),  # 70B in 80 GiB
        (["--dtype", "auto"], "invalid choice"),
        (["--dtype", "bfloat16", "--memory-gb", "-1"], "--memory-gb must be > 0"),
    ],
)
def test_bad_input_is_one_line_naming_it(args, says):
    r = plan("--config", str(EXAMPLES / "llama-3.1-70b"), *args)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = plan("--config", "/nonexistent/config.json", "--dtype", "bfloat16")
    assert r.returncode == 2 and "no config.json" in r.stderr, r.stderr


def test_the_default_model_holds_23_kb_of_kv_per_token_in_bf16():
    from engine.model_source import resolve_model

    p = memory(ModelConfig.from_dir(resolve_model("smollm2-135m")), "bfloat16")
    assert p["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23040
    assert abs(p["num_params"] - 134.5e6) / 134.5e6 < 0.01, p["num_params"]
