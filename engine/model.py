"""The Llama-family forward pass over packed tokens and the paged KV cache.

RMSNorm -> fused QKV (+ bias for Qwen2) -> RoPE -> paged GQA attention -> O -> residual ->
RMSNorm -> SwiGLU MLP -> residual; final norm; LM head (tied to the embedding when the config
says so). Numerics follow transformers' Llama modules so that fp32 logits agree to 1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention
from engine.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.rope import apply_rope, cos_sin_table
from engine.weights import ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32, round back, then scale (transformers' LlamaRMSNorm order).
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_positions: int):
        self.cfg = cfg
        self.w = weights
        self.cos_sin = cos_sin_table(cfg.rope, cfg.head_dim, max_positions, weights.embed.dtype,
                                     weights.embed.device)  # [P, 2, D]
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, H] after the final norm."""
        cfg = self.cfg
        num_tokens = input_ids.shape[0]
        cos_sin = self.cos_sin[positions]  # [T, 2, D]
        cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]  # [T, 1, D]
        x = F.embedding(input_ids, self.w.embed)  # [T, H]
        for i, layer in enumerate(self.w.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [T, (Hq + 2 Hkv) * D]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.view(num_tokens, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rope(k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attn = paged_attention(q, k, v, *kv_cache.layer(i), meta)  # [T, Hq, D]
            x = x + F.linear(attn.reshape(num_tokens, self.q_size), layer.o)
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)  # [T, I] each
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return rms_norm(x, self.w.final_norm, cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in fp32."""
        return F.linear(hidden, self.w.lm_head).float()
