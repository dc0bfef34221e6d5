"""The model's elementwise steps, each fused into one C++ pass on CPUs where the kernels build
(cpu_kernels.py), and plain torch elsewhere (CUDA, or no compiler). Both paths compute the same
thing; tests run both against transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Ops:
    def __init__(self, fused: bool):
        self.fused = fused

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place: residual += x; x = rms_norm(residual) * weight. x, residual: [T, H]."""
        if self.fused:
            torch.ops.pdserve.add_rms_norm(x, residual, weight, eps)
        else:
            residual.add_(x)
            x.copy_(rms_norm(residual, weight, eps))

    def rope_(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        """Rotates the q and k heads of qkv [T, (Hq + 2 Hkv) * D] in place; cos_sin: [P, 2, D]."""
        if self.fused:
            torch.ops.pdserve.rope(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim)
            return
        rotated = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(qkv.shape[0], -1, head_dim)
        cs = cos_sin[positions]  # [T, 2, D]
        cos, sin = cs[:, 0:1], cs[:, 1:2]  # [T, 1, D]
        half = head_dim // 2
        rotate_half = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
        rotated.copy_(rotated * cos + rotate_half * sin)

    def rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place: x = rms_norm(x) * weight (through the fused kernel, onto a zero residual)."""
        if self.fused:
            torch.ops.pdserve.add_rms_norm(x, torch.zeros_like(x), weight, eps)
        else:
            x.copy_(rms_norm(x, weight, eps))

    def act_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        """[T, 2 I] (gate, up) -> act(gate) * up [T, I]: SwiGLU (silu, fused) or GeGLU (gelu_pytorch_tanh)."""
        if act == "silu" and self.fused:
            out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            torch.ops.pdserve.silu_mul(out, gate_up)
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32, round back, then scale (transformers' LlamaRMSNorm order).
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
