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
