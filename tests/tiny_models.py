"""Tiny random checkpoints built from a config with a fixed seed, saved like real ones."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "Prefill is compute-bound; decode is memory-bound.",
    "Hello world! Disaggregated serving moves KV from prefill to decode nodes.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"-()",
]
EOS = "<|eos|>"


def save_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """A byte-level BPE trained on a few sentences; returns the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(path)
    return fast.convert_tokens_to_ids(EOS)


def make_tiny_model(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    rope_parameters: dict | None = None,
    vocab_size: int = 320,
    tie: bool = False,
    max_position_embeddings: int = 1024,
    sliding_window: int | None = None,
    **shape,
) -> Path:
    """arch: llama, qwen2, qwen3, mistral, phi3, gemma2, gemma3, gemma3_multimodal, mixtral,
    qwen2_moe or qwen3_moe; shape: config fields to override (hidden_size, num_attention_heads, head_dim, ...)."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    eos_id = save_tokenizer(path, vocab_size)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        initializer_range=0.1,  # peakier than the default so greedy has clear winners
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
    )
    common.update(shape)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # transformers zero-initializes biases; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(
            Qwen3Config(**common, **({"sliding_window": sliding_window} if sliding_window else {}))
        )
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=sliding_window))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**common, sliding_window=sliding_window, pad_token_id=eos_id))
    elif arch == "gemma2":  # transformers' defaults otherwise: caps 50 and 30, GeGLU, alternating windows
        common.setdefault("head_dim", 16)
        common.setdefault("query_pre_attn_scalar", 24)
        model = Gemma2ForCausalLM(Gemma2Config(**common, sliding_window=sliding_window or 4096, pad_token_id=eos_id))
    elif arch == "gemma3":  # five sliding layers to one full (a pattern of 6), a local RoPE base of its own
        common.setdefault("head_dim", 16)
        common.setdefault("query_pre_attn_scalar", 24)
        if rope_parameters is None:
            common["rope_parameters"] = {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            }
        cfg = Gemma3TextConfig(**common, sliding_window=sliding_window or 4096, pad_token_id=eos_id)
        model = Gemma3ForCausalLM(cfg)
    elif arch == "gemma3_multimodal":  # Gemma 3 4B-27B's checkpoint kind: a vision tower beside the language model
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        common.setdefault("head_dim", 16)
        common.setdefault("query_pre_attn_scalar", 24)
        tie = common.pop("tie_word_embeddings")
        text = dict(common, sliding_window=sliding_window or 4096, pad_token_id=eos_id)
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        cfg = Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=tie, eos_token_id=eos_id
        )
        model = Gemma3ForConditionalGeneration(cfg)
    elif arch == "mixtral":
        common.setdefault("num_local_experts", 4)
        common.setdefault("num_experts_per_tok", 2)
        model = MixtralForCausalLM(MixtralConfig(**common, sliding_window=sliding_window))
    elif arch == "qwen2_moe":  # a shared expert beside the routed ones; qkv bias
        common.setdefault("num_experts", 8)
        common.setdefault("num_experts_per_tok", 2)
        common.setdefault("moe_intermediate_size", 48)
        common.setdefault("shared_expert_intermediate_size", 80)
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**common))
        with torch.no_grad():  # (as for qwen2: biases that matter)
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif arch == "qwen3_moe":
        common.setdefault("num_experts", 8)
        common.setdefault("num_experts_per_tok", 2)
        common.setdefault("moe_intermediate_size", 48)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # non-trivial norm weights, so a missing norm would show
        for name, p in model.named_parameters():
            if "norm" in name:  # (Gemma's scale by 1 + w: the same spread around 1 there)
                p.uniform_(-0.5, 0.5) if arch.startswith("gemma") else p.uniform_(0.5, 1.5)
    model.to(torch.float32).save_pretrained(path)
    return path
