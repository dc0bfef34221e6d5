"""Engine configuration: one frozen dataclass, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from engine.speculative import SpeculativeConfig

DTYPES = ("auto", "bfloat16", "float16", "float32")
SCHEDULING = ("continuous", "static")


def _check(ok: bool, field: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"  # "auto": bf16 on CUDA and CPUs with native bf16, else fp32 (engine/hardware.py)
    device: str = "auto"  # "auto": cuda when available, else cpu
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 1 << 30  # memory budget for the one KV tensor
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes (tests use tiny pools)
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 4096  # tokens in one step (prefill chunks + decodes)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    scheduling: str = "continuous"  # "static": a new batch only once the whole batch is done
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of a prompt prefix seen before
    cpu_kernels: bool = True  # C++ attention/fused ops on CPUs where they build; False: plain torch
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's choice
    seed: int = 0  # seeds the sampler for requests without their own seed
    # Speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4} (engine/speculative.py)
    speculative: dict | None = None

    def __post_init__(self):
        _check(isinstance(self.model, str) and self.model != "", "model", "a model name or path", self.model)
        _check(self.dtype in DTYPES, "dtype", f"one of {DTYPES}", self.dtype)
        _check(isinstance(self.device, str) and self.device.split(":")[0] in ("auto", "cpu", "cuda"),
               "device", "'auto', 'cpu' or 'cuda[:N]'", self.device)
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
               "a power of two in [1, 256]", self.block_size)
        _check(self.kv_cache_bytes > 0, "kv_cache_bytes", "> 0", self.kv_cache_bytes)
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", ">= 1 or None",
               self.num_kv_blocks)
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1", self.max_num_batched_tokens)
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", ">= 2 or None",
               self.max_model_len)
        _check(self.scheduling in SCHEDULING, "scheduling", f"one of {SCHEDULING}", self.scheduling)
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads", ">= 1 or None", self.num_threads)
        if self.speculative is not None:
            SpeculativeConfig.from_dict(self.speculative)  # raises naming the setting

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return None if self.speculative is None else SpeculativeConfig.from_dict(self.speculative)
