"""The facts about a Llama-family checkpoint that the engine needs, read from its config.json.

The families share the Llama block (RMSNorm, RoPE, GQA, SwiGLU): Qwen2 adds a qkv bias, Qwen3 a
per-head RMSNorm on q and k (and a head_dim of its own), Phi-3 stores q/k/v and gate/up fused,
Mistral and Phi-3 may slide a window over every layer. Gemma 2 and 3 change more of the block:
RMSNorm scales by (1 + w), the embedding by sqrt(hidden), each sublayer's output is normalized
again before the residual add ("sandwich" norms), the MLP is GeGLU, the attention scale is
query_pre_attn_scalar's, sliding and full layers alternate (Gemma 3's sliding ones with their own
RoPE base), and Gemma 2 soft-caps the attention scores and the logits (cap * tanh(x / cap)).
Mixtral, Qwen2-MoE and Qwen3-MoE replace the MLP with a mixture of experts (engine/moe.py) on every
layer, or on those Qwen's decoder_sparse_step and mlp_only_layers leave sparse; Qwen2-MoE adds a
shared expert that every token takes, its output gated by a sigmoid."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Multimodal checkpoints whose language model the engine serves alone (text in, text out; the
# vision tower's weights are not loaded): Gemma 3 4B, 12B and 27B ship so.
MULTIMODAL_TEXT = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


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
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    rope: dict = field(hash=False)  # rope_parameters: rope_type, rope_theta and the variant's knobs
    sliding_window: int | None  # the window every layer slides
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str
    # Where only some layers slide a window (Gemma 2 and 3, Qwen's max_window_layers): its width, the
    # layers, and the RoPE those layers use when it is not `rope` (Gemma 3's local base).
    local_window: int | None = None
    local_layers: tuple[int, ...] = ()
    local_rope: dict | None = field(default=None, hash=False)
    hidden_act: str = "silu"  # the gated MLP's activation: SwiGLU's silu, GeGLU's tanh-approximated gelu
    gemma_norms: bool = False  # RMSNorm scales by (1 + w); sandwich norms around attention and the MLP
    embed_scale: float = 1.0  # the embedding's output times this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # the scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores capped to cap * tanh(s / cap) before the mask
    final_softcap: float | None = None  # Gemma 2: the logits capped so
    # Mixture of experts: the layers whose MLP is sparse, its experts, how many each token takes,
    # each expert's intermediate size, and whether the top-k weights are renormalized to sum to 1.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: the shared expert's width (0: none)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        if (cfg.get("architectures") or ["?"])[0] in MULTIMODAL_TEXT:
            cfg = _text_config(cfg)
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            supported = SUPPORTED_ARCHITECTURES + tuple(MULTIMODAL_TEXT)
            raise ValueError(f"model: architecture {arch!r} is not supported; supported: {supported}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if arch == "Gemma3ForCausalLM":
            rope, local_rope = _gemma3_ropes(cfg)
        else:
            rope, local_rope = _rope(cfg.get("rope_parameters") or cfg.get("rope_scaling"), cfg, 10000.0), None
        windows = _layer_windows(cfg)
        sliding = windows[0] if len(set(windows)) == 1 else None
        local = () if sliding or not any(windows) else tuple(i for i, w in enumerate(windows) if w)
        gemma = arch in GEMMA
        if gemma and cfg.get("use_bidirectional_attention"):
            raise ValueError("model: use_bidirectional_attention (an encoder's) is not supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"model: activation {act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")
        moe = _moe(arch, cfg)
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
            tie_word_embeddings=cfg.get("tie_word_embeddings", gemma),  # Gemma's class default: tied
            qkv_bias=arch == "Qwen2ForCausalLM"
            or bool(cfg.get("attention_bias", False))
            or (arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            rope=rope,
            sliding_window=sliding,
            eos_token_ids=eos,
            checkpoint_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            local_window=windows[local[0]] if local else None,
            local_layers=local,
            local_rope=local_rope,
            hidden_act=act,
            gemma_norms=gemma,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5 if gemma else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            **moe,
        )

    @property
    def attention(self) -> str:
        """What each layer attends ("full", "window W", "window W on layers i,j"): engines whose KV
        is exchanged must agree (a layer's KV past a window is still kept, but read differently)."""
        attention = "full"
        if self.sliding_window:
            attention = f"window {self.sliding_window}"
        elif self.local_layers:
            attention = f"window {self.local_window} on layers {','.join(map(str, self.local_layers))}"
        if self.rope["rope_type"] == "longrope":  # the keys' rotation differs with the factors
            attention += f"; LongRoPE {'long' if self.rope.get('long_factors') else 'short'} factors"
        return attention

    def for_context(self, max_model_len: int) -> ModelConfig:
        """The config an engine of this context length runs. LongRoPE's long factors where that
        length exceeds the pretraining one, short ones otherwise: chosen once per engine, as vLLM
        does, so that no sequence's KV mixes keys rotated both ways (transformers switches when a
        sequence grows past the length, leaving its earlier keys rotated by the short factors)."""
        if self.rope["rope_type"] != "longrope":
            return self
        long = max_model_len > self.rope["original_max_position_embeddings"]
        return replace(self, rope={**self.rope, "long_factors": long})

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _text_config(cfg: dict) -> dict:
    """The language model's config of a multimodal checkpoint: its text_config with the defaults
    of transformers' text config class filled in (hub configs write only what differs from them),
    and the top level's end-of-sequence ids and tying."""
    from transformers import Gemma3TextConfig

    text = Gemma3TextConfig(**cfg.get("text_config", {})).to_dict()
    text["architectures"] = [MULTIMODAL_TEXT[cfg["architectures"][0]]]
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    if cfg.get("eos_token_id") is not None:
        text["eos_token_id"] = cfg["eos_token_id"]
    return text


def _moe(arch: str, cfg: dict) -> dict:
    """The mixture-of-experts fields: every layer sparse in Mixtral; in Qwen's those not in
    mlp_only_layers whose index + 1 is a multiple of decoder_sparse_step."""
    if arch not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    top_k = cfg["num_experts_per_tok"]
    if not 0 < top_k <= experts:
        raise ValueError(f"model: num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
    layers = range(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return dict(
            moe_layers=tuple(layers),
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=cfg["intermediate_size"],
            moe_renormalize=True,
        )
    dense, step = set(cfg.get("mlp_only_layers") or []), cfg.get("decoder_sparse_step", 1)
    return dict(
        moe_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=cfg["moe_intermediate_size"],
        moe_renormalize=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0)
        if arch == "Qwen2MoeForCausalLM"
        else 0,
    )


def _layer_windows(cfg: dict) -> list[int | None]:
    """Each layer's sliding window, or None where it attends in full. A config's layer_types, where
    it has them, say which layers slide (transformers reads them before sliding_window); Gemma
    configs from before layer_types alternate by a pattern (Gemma 2: every other layer from the
    first; Gemma 3: five of every six)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") is not False else None  # Phi-3 writes None
    num_layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if kinds is None and cfg.get("architectures", [None])[0] in GEMMA:
        pattern = 2 if cfg["architectures"][0] == "Gemma2ForCausalLM" else cfg.get("sliding_window_pattern", 6)
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if kinds is None:
        return [window] * num_layers
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"model: layer_types {sorted(unknown)} are not supported")
    return [window if kind == "sliding_attention" else None for kind in kinds]


def _rope(params: dict | None, cfg: dict, default_theta: float) -> dict:
    rope = dict(params or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    if rope["rope_type"] == "su":  # Phi-3's first name for LongRoPE
        rope["rope_type"] = "longrope"
    if rope["rope_type"] not in SUPPORTED_ROPE:
        raise ValueError(f"model: rope_type {rope['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE}")
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("model: partial_rotary_factor other than 1.0 is not supported")
    if rope["rope_type"] == "longrope":
        _longrope(rope, cfg)
    return rope


def _longrope(rope: dict, cfg: dict) -> None:
    """LongRoPE (Phi-3 128k, Phi-3.5): per-frequency factors, short ones for contexts up to the
    pretraining length, long ones beyond, and cos/sin scaled by an attention factor. Fills in the
    pretraining length and the factor from config.json as transformers does."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for name in ("short_factor", "long_factor"):
        factors = rope.get(name)
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise ValueError(f"model: rope_scaling.{name} must list head_dim / 2 = {head_dim // 2} numbers")
    original = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    rope["original_max_position_embeddings"] = original = original or cfg.get("max_position_embeddings", 2048)
    if rope.get("factor") is None:
        rope["factor"] = cfg.get("max_position_embeddings", original) / original


def _gemma3_ropes(cfg: dict) -> tuple[dict, dict]:
    """Gemma 3's two RoPEs, (full layers', sliding layers'): rope_parameters keyed by layer type, or
    in older configs rope_theta with rope_scaling for the full layers and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    full = _rope(params.get("full_attention") or cfg.get("rope_scaling"), cfg, 1_000_000.0)
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return full, _rope(local, {}, 10_000.0)


def _as_tuple(ids) -> tuple[int, ...]:
    return () if ids is None else tuple(ids) if isinstance(ids, list) else (ids,)
