"""The facts about a Llama-family checkpoint that the engine needs, read from its config.json.

The families share the Llama block (RMSNorm, RoPE, GQA, SwiGLU): Qwen2 adds a qkv bias, Qwen3 a
per-head RMSNorm on q and k (and a head_dim of its own), Phi-3 stores q/k/v and gate/up fused,
Mistral and Phi-3 may slide a window over every layer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each q and k head before RoPE
    rope: dict = field(hash=False)  # rope_parameters: rope_type, rope_theta and the variant's knobs
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model: architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        if rope["rope_type"] not in SUPPORTED_ROPE:
            raise ValueError(f"model: rope_type {rope['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("model: partial_rotary_factor other than 1.0 is not supported")
        sliding = _sliding_window(cfg)
        eos = _as_tuple(cfg.get("eos_token_id"))
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():  # instruct models often list extra end-of-turn ids here
            eos += tuple(t for t in _as_tuple(json.loads(gen_path.read_text()).get("eos_token_id")) if t not in eos)
        return cls(
            architecture=arch,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope=rope,
            sliding_window=sliding,
            eos_token_ids=eos,
            checkpoint_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _sliding_window(cfg: dict) -> int | None:
    """The window every layer slides, or None. A config's layer_types, where it has them, say which
    layers slide (transformers reads them before sliding_window); windows on some layers only are
    refused until the KV cache and kernels take a window per layer."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") is not False else None  # Phi-3 writes None
    kinds = set(cfg.get("layer_types") or [])
    if len(kinds) > 1:
        raise ValueError(
            f"model: layer_types mixes {sorted(kinds)}; a sliding window on some layers only is not supported yet"
        )
    if kinds == {"full_attention"}:
        return None
    return window


def _as_tuple(ids) -> tuple[int, ...]:
    return () if ids is None else tuple(ids) if isinstance(ids, list) else (ids,)
