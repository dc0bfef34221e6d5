"""Paged decode attention for CUDA: the GPU's counterpart of the C++ CPU kernel
(csrc/paged_attention.cpp), with the same arguments and numerics (fp32 inside, rounded only at the
output), launching the Triton kernel of paged_decode_triton.py.

Triton ships with torch's CUDA wheels; without it (CPU installs) `available()` is False and CUDA
decodes attend through SDPA over gathered KV (engine/attention.py), as they do with `cuda_kernels`
off (`--no-cuda-kernels`). With TRITON_INTERPRET=1 set before the kernel's module is
imported, it runs on CPU tensors in Triton's interpreter (the tests check its indexing so).
"""

from __future__ import annotations

import contextlib
import importlib.util
from functools import cache

import torch


@cache
def available() -> bool:
    """Whether CUDA decodes can run the Triton kernel (Triton installed; CPU installs carry none)."""
    return importlib.util.find_spec("triton") is not None


def why_not(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> str | None:
    """Why decodes on this device cannot run the kernel at this shape, or None when they can:
    Triton installed, an NVIDIA GPU of compute capability 8.0 or later (what Triton supports), and
    one launch that builds (Triton compiles its launcher with the host's C compiler) and agrees
    with attention written out in torch. An engine asks once as it starts, so a GPU or an image the
    kernel cannot serve decodes through SDPA from the start, not failing at a request's first step."""
    if not available():
        return "Triton is not installed"
    if device.type == "cuda":
        if torch.version.hip is not None:
            return "a ROCm GPU (the kernel has run on NVIDIA GPUs only)"
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            return f"compute capability {capability[0]}.{capability[1]} (Triton needs 8.0 or later)"
    g = torch.Generator().manual_seed(0)
    lens = [2 * block_size + 3, 5]  # a context ending mid-block, a short one
    widths = [-(-n // block_size) for n in lens]
    num_blocks = sum(widths) + 1
    blocks = iter(torch.randperm(num_blocks, generator=g).tolist())  # scattered, not in order
    block_tables = torch.tensor([[next(blocks) for _ in range(w)] + [0] * (max(widths) - w) for w in widths])
    k_cache, v_cache = (
        torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=g).to(dtype) for _ in "kv"
    )
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.long)
    expected = reference_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, 0)
    args = [t.to(device) for t in (q, k_cache, v_cache, block_tables, context_lens)]
    out = torch.empty_like(args[0])
    try:
        paged_decode_attention(out, *args, block_size, head_dim**-0.5, 0)
        got = out.float().cpu()
    except Exception as e:  # noqa: BLE001 - whatever stops the build or the launch, SDPA serves instead
        return f"its launch failed: {type(e).__name__}: {e}"
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not torch.allclose(got, expected, atol=tol, rtol=tol):
        return f"its output differs from torch's attention by up to {(got - expected).abs().max().item():.3g}"
    return None


def reference_attention(
    q, k_cache, v_cache, block_tables, context_lens, block_size: int, window: int, softcap: float = 0.0
) -> torch.Tensor:
    """What the kernels compute, written out in torch in fp32 (their check, and the tests'): q: [B,
    Hq, D]; caches [slots, Hkv, D] -> [B, Hq, D]; softcap (the C++ kernel's only): cap * tanh(s / cap)."""
    out = []
    for b in range(q.shape[0]):
        ctx = int(context_lens[b])
        pos = torch.arange(ctx)
        slots = block_tables[b][pos // block_size] * block_size + pos % block_size
        if window:
            slots = slots[max(0, ctx - window) :]
        k = k_cache[slots].float().transpose(0, 1)  # [Hkv, Lk, D]
        v = v_cache[slots].float().transpose(0, 1)
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q[b].float()[:, None, :] @ k.transpose(1, 2)) * q.shape[-1] ** -0.5  # [Hq, 1, Lk]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        out.append((scores.softmax(-1) @ v)[:, 0])
    return torch.stack(out)


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int,
) -> None:
    """out, q: [B, Hq, D] (q's rows may be strided, its head_dim dense); k_cache, v_cache:
    [num_slots, Hkv, D]; block_tables: [B, max_blocks]; context_lens: [B] (KV positions to attend,
    the new token's included); window: a sliding window's width, 0 for none. Writes out."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"paged_decode_attention: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
        )
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1:
        raise ValueError("paged_decode_attention: head_dim must be dense in q, out and the caches, both caches alike")
    if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64:
        raise ValueError(
            "paged_decode_attention: block_tables and context_lens must be int64 (slot offsets exceed 2^31)"
        )
    if len({t.device for t in (out, q, k_cache, v_cache, block_tables, context_lens)}) != 1:
        raise ValueError("paged_decode_attention: all tensors must be on one device")
    if batch == 0:
        return
    import triton  # on first use: a CPU engine never pays for Triton's import

    from engine.paged_decode_triton import NUM_WARPS, TILE, paged_decode_kernel

    group = num_heads // num_kv_heads
    # Triton launches on the thread's current device, not the tensors' (an engine on cuda:1
    # steps in a thread whose current device is cuda:0); the interpreter runs on CPU tensors.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        paged_decode_kernel[(batch, num_kv_heads)](
            out,
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            block_tables.stride(0),
            scale,
            window if window > 0 else 2**31 - 1,
            block_size,
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot's rows: at least 16
            HEAD_DIM=head_dim,
            DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            TILE=TILE,
            num_warps=NUM_WARPS,
        )
