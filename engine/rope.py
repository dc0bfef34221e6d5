"""Rotary position embeddings: inverse frequencies for each rope_type, and a cos/sin table.

The formulas follow the papers as transformers implements them (default, linear position
interpolation, Llama 3.1's smoothed band scaling, YaRN, Phi-3's LongRoPE), so that logits match it exactly.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(rope: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim // 2] fp32, attention_scaling applied to cos and sin)."""
    base = float(rope["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = rope["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(base, head_dim, rope)
    if kind == "longrope":
        return _longrope(base, head_dim, rope)
    raise ValueError(f"rope_type {kind!r} is not supported")


def _llama3(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    factor = rope["factor"]
    original_len = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # 1 where the dimension keeps its original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(base: float, dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """Each frequency divided by its own factor (the long list or the short one: ModelConfig.for_context
    picks), cos and sin scaled by sqrt(1 + ln(factor) / ln(pretraining length)) unless the config names it."""
    factor, original = rope["factor"], rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(rope["long_factor" if rope.get("long_factors") else "short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


def cos_sin_table(
    rope: dict, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """cos_sin: [max_positions, 2, head_dim] in the model dtype (cos and sin rounded as HF does)."""
    inv_freq, scaling = inv_frequencies(rope, head_dim)
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    table = torch.stack((emb.cos() * scaling, emb.sin() * scaling), dim=1)
    return table.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D]. Rotates the two halves (rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
