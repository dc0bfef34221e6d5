from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# Without a GPU, Triton's kernels (engine/cuda_kernels.py, where Triton is installed) run in its
# interpreter on CPU tensors, so their tests check the same indexing and numerics here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import make_tiny_model  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


def pytest_report_header(config) -> str:
    from engine.hardware import cpu_features

    cpu = cpu_features()
    return f"pdserve CPU class: {cpu.isa} ({cpu.reason}); native bf16: {cpu.native_bf16}"


def make_engine(model: Path, **kwargs) -> LLMEngine:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("block_size", 4)
    return LLMEngine(EngineConfig(model=str(model), **kwargs))


def engine_alone(model, prompts, **params) -> list[list[int]]:
    """Each prompt's tokens from one engine (fp32, the reference of every cluster test)."""
    engine = make_engine(model)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(**params))
    outs = run_to_completion(engine)
    return [outs[str(i)].token_ids for i in range(len(prompts))]


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Steps until idle; returns request_id -> final RequestOutput."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine did not finish")


def assert_no_blocks_used(engine: LLMEngine) -> None:
    assert engine.block_manager.num_used_blocks == 0, engine.block_manager.ref_counts


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
