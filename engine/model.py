"""The Llama-family forward pass over packed tokens and the paged KV cache.

Per layer: RMSNorm -> fused QKV (+ bias for Qwen2; a per-head q/k RMSNorm for Qwen3) -> RoPE ->
paged GQA attention -> O -> residual add + RMSNorm -> SwiGLU MLP -> residual add; then the final
norm and the LM head (tied to the embedding when the config says so). Gemma adds a norm on each
sublayer's output before its residual add, a GeGLU MLP, a scaled embedding, its own attention
scale, layers that slide a window beside full ones, and soft caps (engine/model_config.py);
Mixtral and Qwen3-MoE a mixture of experts in place of the MLP (engine/moe.py). The
residual stream is kept in its own tensor and each "add, then normalize" is one fused step, as in
vLLM. Numerics follow transformers' modules, so fp32 logits agree with it to 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, attention_backends, paged_attention
from engine.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.moe import moe_mlp
from engine.ops import Ops, rms_norm
from engine.rope import cos_sin_table
from engine.weights import ModelWeights


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_positions: int, ops: Ops):
        self.cfg = cfg
        self.w = weights
        self.ops = ops
        dtype, device = weights.embed.dtype, weights.embed.device
        self.cos_sin = cos_sin_table(cfg.rope, cfg.head_dim, max_positions, dtype, device)  # [P, 2, D]
        # Layers that slide a window when others do not (meta.local), with their own RoPE in Gemma 3.
        self.local_layers = frozenset(cfg.local_layers)
        self.local_cos_sin = self.cos_sin
        if cfg.local_rope is not None:
            self.local_cos_sin = cos_sin_table(cfg.local_rope, cfg.head_dim, max_positions, dtype, device)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, H] after the final norm.
        layer_done(i), when given, is called once layer i's KV is in the cache."""
        with attention_backends(input_ids.device):
            return self._forward(input_ids, positions, meta, kv_cache, layer_done)

    def _forward(self, input_ids, positions, meta, kv_cache, layer_done) -> torch.Tensor:
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        num_tokens = input_ids.shape[0]
        residual = torch.nn.functional.embedding(input_ids, self.w.embed)  # [T, H], the residual stream
        if cfg.embed_scale != 1.0:  # (rounded to the model's dtype first, as transformers does)
            residual *= torch.tensor(cfg.embed_scale, dtype=residual.dtype)
        if ops.fused:  # every norm through one kernel (a row's sum never split by the batch's shape)
            h = torch.zeros_like(residual)
            ops.add_rms_norm_(h, residual, self.w.layers[0].input_norm, eps)
        else:
            h = rms_norm(residual, self.w.layers[0].input_norm, eps)
        for i, layer in enumerate(self.w.layers):
            if i > 0:
                ops.add_rms_norm_(h, residual, layer.input_norm, eps)  # h was the previous MLP's output
            qkv = layer.qkv(h)  # [T, (Hq + 2 Hkv) * D]
            if layer.q_norm is not None:
                self._norm_heads_(qkv, layer, num_tokens)
            local = i in self.local_layers
            cos_sin = self.local_cos_sin if local else self.cos_sin
            ops.rope_(qkv, positions, cos_sin, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            attn = paged_attention(
                q.view(num_tokens, cfg.num_heads, cfg.head_dim),
                k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim),
                v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim),
                *kv_cache.layer(i),
                meta.local if local else meta,
                cfg.attn_scale,
                cfg.attn_softcap,
            )  # [T, Hq, D]
            if layer_done is not None:
                layer_done(i)
            h = layer.o(attn.view(num_tokens, self.q_size))
            if layer.attn_out_norm is not None:
                ops.rms_norm_(h, layer.attn_out_norm, eps)
            ops.add_rms_norm_(h, residual, layer.post_norm, eps)
            if layer.moe is not None:
                h = moe_mlp(h, layer.moe, lambda x: ops.act_mul(x, cfg.hidden_act))
            else:
                h = layer.down(ops.act_mul(layer.gate_up(h), cfg.hidden_act))  # [T, 2 I] -> [T, I] -> [T, H]
            if layer.mlp_out_norm is not None:
                ops.rms_norm_(h, layer.mlp_out_norm, eps)
        ops.add_rms_norm_(h, residual, self.w.final_norm, eps)
        return h

    def _norm_heads_(self, qkv: torch.Tensor, layer, num_tokens: int) -> None:
        """Qwen3, Gemma 3: each q and k head RMSNormed over head_dim, in place (a row's sum is the head's
        alone, whatever the batch)."""
        cfg = self.cfg
        q = qkv[:, : self.q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        q.copy_(rms_norm(q, layer.q_norm, cfg.rms_norm_eps))
        k.copy_(rms_norm(k, layer.k_norm, cfg.rms_norm_eps))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in fp32 (soft-capped in fp32 where the model caps them)."""
        logits = self.w.lm_head(hidden).float()
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
