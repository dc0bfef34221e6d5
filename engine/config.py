"""Engine configuration: one frozen dataclass, validated once at construction.

Each field is an option of every process that runs an engine: its metadata holds the help text
(and a flag, choices or unit where the command line differs from the field), from which the
command lines and the Serve config's `engine:` sections are derived (serving/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.speculative import SpeculativeConfig

DTYPES = ("auto", "bfloat16", "float16", "float32")
SCHEDULING = ("continuous", "static")
LINEAR_KERNELS = ("auto", "ordered", "onednn", "onednn_chunks")
QUANTIZATIONS = ("none", "int8", "int4")
GIB = 1 << 30
# A decode node's prompt tokens per step beside its decodes (prefill_tokens_with_decodes): measured on the
# anchor workload, docs/benchmarks.md at 0f5299a, "Local prefills a chunk at a time"
DECODE_NODE_PREFILL_TOKENS = 32


def option(default, help: str, **more):
    """A field that is an option (see serving/options.py for the metadata's keys)."""
    return field(default=default, metadata={"help": help, **more})


def _check(ok: bool, field: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = option("smollm2-135m", "short name (smollm2-135m), a Hugging Face directory, or a .gguf file")
    dtype: str = option(
        "auto",
        "auto: bfloat16 on CUDA and on CPUs with native bf16 (AMX or AVX512_BF16), float32 on other CPUs",
        choices=DTYPES,
    )
    device: str = option("auto", "auto, cpu, cuda or cuda:N (auto: cuda when available, else cpu)")
    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_bytes: int = option(GIB, "memory for the KV cache", flag="--kv-cache-gb", unit=GIB)
    num_kv_blocks: int | None = option(None, "KV cache blocks, overriding --kv-cache-gb (tests use tiny pools)")
    max_num_seqs: int = option(256, "sequences in one decode batch at most")
    max_num_batched_tokens: int = option(4096, "tokens in one forward at most (prefill chunks + decodes)")
    prefill_tokens_with_decodes: int | None = option(
        None,
        "a step that decodes computes at most this many prompt tokens beside its decodes, so a long prompt stalls "
        "the decoding sequences a chunk at a time (with chunked prefill; 0: as many as the token budget allows) "
        f"(default: {DECODE_NODE_PREFILL_TOKENS} on a decode node, whose local prefills it bounds; 0 elsewhere)",
    )
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's context length)")
    scheduling: str = option(
        "continuous", "static: a new batch only once the whole batch is done (for comparison)", choices=SCHEDULING
    )
    enable_chunked_prefill: bool = option(
        True,
        "compute a long prompt in one step (by default it is split over steps within the token budget)",
        flag="--no-chunked-prefill",
    )
    enable_prefix_caching: bool = option(
        True,
        "compute every prompt in full (by default the KV of full blocks of a prompt prefix seen before is reused)",
        flag="--no-prefix-caching",
    )
    cpu_kernels: bool = option(
        True,
        "plain torch ops on the CPU (by default C++ attention, fused ops and, where linear_kernel picks it, the "
        "ordered linear, where they build)",
        flag="--no-cpu-kernels",
    )
    cuda_kernels: bool = option(
        True,
        "CUDA decodes attend through SDPA over gathered KV (by default the Triton paged kernel reads the KV in "
        "place, where Triton is installed, as it is with torch's CUDA wheels)",
        flag="--no-cuda-kernels",
    )
    deterministic: bool = option(
        False,
        "batch-invariant numerics: each token's logits and KV the same whatever else is in the batch, how its "
        "prompt was chunked, what was cached, on whichever node (CPU with the C++ kernels; costs speed)",
    )
    linear_kernel: str = option(
        "auto",
        "a CPU's linears: ordered (engine/csrc/ordered_linear.cpp, each output summed in k order), onednn (its "
        "prepacked weights, F.linear where it has none), onednn_chunks (oneDNN called on 32 rows at a time, the last "
        "chunk padded: one shape, so batch-invariant), or auto: ordered where it measured faster (bf16 on "
        "AVX512_BF16, AVX2-only CPUs), onednn elsewhere; with deterministic, onednn_chunks on AMX, ordered elsewhere "
        "(engine/hardware.py)",
        choices=LINEAR_KERNELS,
    )
    quantization: str = option(
        "none",
        "weight-only quantization of the decoder layers' linears (attention, MLPs, experts), at load, from any "
        "checkpoint: int8 or int4 codes, asymmetric in groups of 32 along k (a GGUF block's size; a fp32 scale and "
        "zero a group), through engine/csrc/ordered_linear.cpp's quantized kernel (CPU with the C++ kernels); the "
        "KV cache, the embeddings, the LM head and the norms stay in the model dtype",
        choices=QUANTIZATIONS,
    )
    num_threads: int | None = option(None, "torch threads on CPU (default: torch's choice)")
    step_log: str | None = option(
        None,
        "append one JSON line per engine step to this file (owner-only): its prefill chunks, its decodes' "
        "contexts, its seconds (engine/step_log.py)",
    )
    seed: int = option(0, "seeds the sampler for requests without their own seed", where=("serve",))
    speculative: dict | None = option(
        None,
        'speculative decoding on decode steps, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
        "settings in engine/speculative.py (default: off)",
        flag="--speculative-config",
    )

    def __post_init__(self):
        _check(isinstance(self.model, str) and self.model != "", "model", "a model name or path", self.model)
        _check(self.dtype in DTYPES, "dtype", f"one of {DTYPES}", self.dtype)
        _check(
            isinstance(self.device, str) and self.device.split(":")[0] in ("auto", "cpu", "cuda"),
            "device",
            "'auto', 'cpu' or 'cuda[:N]'",
            self.device,
        )
        _check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
            "block_size",
            "a power of two in [1, 256]",
            self.block_size,
        )
        _check(self.kv_cache_bytes > 0, "kv_cache_bytes", "> 0", self.kv_cache_bytes)
        _check(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", ">= 1 or None", self.num_kv_blocks
        )
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1", self.max_num_batched_tokens)
        _check(
            self.prefill_tokens_with_decodes is None or self.prefill_tokens_with_decodes >= 0,
            "prefill_tokens_with_decodes",
            ">= 0 or None",
            self.prefill_tokens_with_decodes,
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 2, "max_model_len", ">= 2 or None", self.max_model_len
        )
        _check(self.linear_kernel in LINEAR_KERNELS, "linear_kernel", f"one of {LINEAR_KERNELS}", self.linear_kernel)
        _check(self.quantization in QUANTIZATIONS, "quantization", f"one of {QUANTIZATIONS}", self.quantization)
        _check(
            not (self.deterministic and self.linear_kernel == "onednn"),
            "linear_kernel",
            "'ordered', 'onednn_chunks' or 'auto' with deterministic (oneDNN on the batch as it comes sums in an "
            "order that moves with the batch)",
            self.linear_kernel,
        )
        _check(self.scheduling in SCHEDULING, "scheduling", f"one of {SCHEDULING}", self.scheduling)
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads", ">= 1 or None", self.num_threads)
        if self.speculative is not None:
            spec = SpeculativeConfig.from_dict(self.speculative)  # raises naming the setting
            # the draft model's attention is not the mode's single queries, so its proposals (and what a
            # seeded sample accepts) could move with the batch; n-gram proposals depend on the tokens alone
            _check(
                not (self.deterministic and spec.method == "draft_model"),
                "speculative.method",
                "'ngram' with deterministic (a draft model's proposals are not batch-invariant)",
                spec.method,
            )

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return None if self.speculative is None else SpeculativeConfig.from_dict(self.speculative)
