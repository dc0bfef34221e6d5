"""Reads a Hugging Face checkpoint's safetensors into the engine's fused layout.

q/k/v projections are concatenated into one matrix and gate/up into another, so each layer
runs four matmuls instead of seven (Phi-3 checkpoints store them so already). Gemma's norms,
which scale by (1 + w), are stored here as 1 + w (summed in fp32), so every norm is one kind.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine import gguf_blocks
from engine.linear import BITS, Linear
from engine.model_config import ModelConfig
from engine.moe import MoEWeights

log = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # [(Hq + 2 Hkv) * D, H] (+ bias for Qwen2)
    o: Linear  # [H, Hq * D]
    post_norm: torch.Tensor  # [H], before the MLP (Gemma's pre_feedforward_layernorm)
    q_norm: torch.Tensor | None  # [D], Qwen3's and Gemma 3's per-head norms
    k_norm: torch.Tensor | None  # [D]
    gate_up: Linear | None  # [2 I, H]; None where the layer's MLP is a mixture of experts
    down: Linear | None  # [H, I]
    attn_out_norm: torch.Tensor | None = None  # [H], Gemma's sandwich norms: on the attention's output
    mlp_out_norm: torch.Tensor | None = None  # [H], and on the MLP's, each before the residual add
    moe: MoEWeights | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: Linear  # [V, H]; packed from the embedding when tied (embed keeps its own layout)
    gguf_blocks: tuple[str, ...] = ()  # the GGUF block types some linears' codes are (engine/gguf_blocks.py)


# A multimodal checkpoint's language model, under the names of a text-only one: transformers 5
# saves model.language_model.*, older versions language_model.model.* and language_model.lm_head.*.
LANGUAGE_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.": ""}
OTHER_MODALITIES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir}")
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(OTHER_MODALITIES):
                    continue
                prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
                key = name if prefix is None else LANGUAGE_MODEL_PREFIXES[prefix] + name.removeprefix(prefix)
                tensors[key] = f.get_tensor(name)
    return tensors


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A tensor name's ending -> the shape its config.json makes it (the dense layers' linears,
    fused or not, the embeddings, the layer norms): a checkpoint of another shape is refused by
    name at load, not run with a layer silently cut or widened."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        ".self_attn.q_proj.weight": (q, h),
        ".self_attn.k_proj.weight": (kv, h),
        ".self_attn.v_proj.weight": (kv, h),
        ".self_attn.qkv_proj.weight": (q + 2 * kv, h),
        ".self_attn.o_proj.weight": (h, q),
        ".mlp.gate_proj.weight": (i, h),
        ".mlp.up_proj.weight": (i, h),
        ".mlp.gate_up_proj.weight": (2 * i, h),
        ".mlp.down_proj.weight": (h, i),
        ".input_layernorm.weight": (h,),
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }


def load_weights(
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kernel: str = "onednn",
    quantization: str = "none",
) -> ModelWeights:
    """kernel: the linears' (engine/linear.py: onednn, ordered or onednn_chunks); quantization: the
    decoder layers' linears quantized at load (the MoE routers keep the model dtype, and so does
    the LM head unless a GGUF file's own blocks hold it: llama.cpp's output reads those too)."""
    raw = _read_tensors(model_dir)

    def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return Linear(weight, bias, kernel, quantization)

    blocks = gguf_blocks.load(model_dir) if quantization != "none" else {}
    from_blocks: dict[str, str] = {}

    def decoder_linear(name: str, parts: list[str] | None = None, bias: torch.Tensor | None = None) -> Linear:
        """The checkpoint's tensor `name`, or `parts` fused along the outputs where it has no `name`:
        from a GGUF file's own blocks where it has them for every part, else quantized here."""
        names = [name] if parts is None or name in raw else parts
        if not all(n in blocks and gguf_blocks.CODE_BITS[blocks[n][3]] <= BITS[quantization] for n in names):
            return linear(torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0]), bias)
        for n in names:
            take(n)  # the dequantized copy, unused
            from_blocks[n] = blocks[n][3]
        codes, scales, zeros = (torch.cat([blocks[n][j] for n in names]) for j in range(3))
        return Linear.from_codes(codes, scales, zeros, quantization, dtype, bias)

    def chooser(weight: torch.Tensor) -> Linear:
        """A MoE router or shared-expert gate: a few outputs that choose, kept in the model dtype."""
        return Linear(weight, None, kernel, "none")

    shapes = expected_shapes(cfg)

    def pop(name: str) -> torch.Tensor:
        if name not in raw:
            raise ValueError(f"model: checkpoint in {model_dir} lacks tensor {name!r}")
        t = raw.pop(name)
        want = next((shape for end, shape in shapes.items() if name.endswith(end)), None)
        if want is not None and tuple(t.shape) != want:
            raise ValueError(
                f"model: tensor {name!r} in {model_dir} has shape {tuple(t.shape)}; its config.json makes it {want}"
            )
        return t

    def take(name: str) -> torch.Tensor:
        return pop(name).to(device=device, dtype=dtype)

    def norm(name: str) -> torch.Tensor:
        if not cfg.gemma_norms:
            return take(name)
        return (1.0 + pop(name).float()).to(device=device, dtype=dtype)

    def experts(p: str) -> MoEWeights:
        """Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2, or Qwen-MoE's mlp.experts.{e}.gate/up/down_proj."""
        mixtral = cfg.architecture == "MixtralForCausalLM"
        block = p + ("block_sparse_moe." if mixtral else "mlp.")
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        e_names = [f"{block}experts.{e}." for e in range(cfg.num_experts)]
        return MoEWeights(
            router=chooser(take(block + "gate.weight")),
            gate_up=[linear(torch.cat([take(e + f"{gate}.weight"), take(e + f"{up}.weight")])) for e in e_names],
            down=[linear(take(e + f"{down}.weight")) for e in e_names],
            top_k=cfg.num_experts_per_tok,
            renormalize=cfg.moe_renormalize,
            **(shared_expert(block) if cfg.shared_expert_intermediate_size else {}),
        )

    def shared_expert(block: str) -> dict:
        """Qwen2-MoE's mlp.shared_expert.gate/up/down_proj and mlp.shared_expert_gate."""
        e = block + "shared_expert."
        return dict(
            shared_gate_up=linear(torch.cat([take(e + "gate_proj.weight"), take(e + "up_proj.weight")])),
            shared_down=linear(take(e + "down_proj.weight")),
            shared_gate=chooser(take(block + "shared_expert_gate.weight")),
        )

    sparse = set(cfg.moe_layers)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        qkv_bias = None
        if cfg.qkv_bias:
            qkv_bias = torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"])
        sandwich = cfg.gemma_norms
        layers.append(
            LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=decoder_linear(attn + "qkv_proj.weight", [attn + f"{n}_proj.weight" for n in "qkv"], qkv_bias),
                o=decoder_linear(attn + "o_proj.weight"),
                post_norm=norm(
                    p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")
                ),
                q_norm=norm(attn + "q_norm.weight") if cfg.qk_norm else None,
                k_norm=norm(attn + "k_norm.weight") if cfg.qk_norm else None,
                gate_up=None
                if i in sparse
                else decoder_linear(
                    p + "mlp.gate_up_proj.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
                ),
                down=None if i in sparse else decoder_linear(p + "mlp.down_proj.weight"),
                attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
                moe=experts(p) if i in sparse else None,
            )
        )
    embed = take("model.embed_tokens.weight")
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    if head in blocks:  # at the blocks' own bits (a Q8_0 head in an int4 model: llama.cpp's too)
        codes, scales, zeros, from_blocks[head] = blocks[head]
        lm_head = Linear.from_codes(codes, scales, zeros, f"int{gguf_blocks.CODE_BITS[from_blocks[head]]}", dtype)
        if not cfg.tie_word_embeddings:
            take(head)  # the dequantized copy, unused
    else:
        lm_head = Linear(embed if cfg.tie_word_embeddings else take("lm_head.weight"), None, kernel)
    if from_blocks:
        kinds = ", ".join(sorted(set(from_blocks.values())))
        log.info("linears: %d tensors from the GGUF file's own %s blocks", len(from_blocks), kinds)
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=norm("model.norm.weight"),
        lm_head=lm_head,
        gguf_blocks=tuple(sorted(set(from_blocks.values()))),
    )
