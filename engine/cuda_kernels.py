"""Paged decode attention for CUDA, in Triton: the GPU's counterpart of the C++ CPU kernel
(csrc/paged_attention.cpp), with the same arguments and the same numerics.

One program per (sequence, KV head): the query heads that share the KV head (GQA) are the rows of
one tile, each key and value row is read once, in place, through the block table (no gather copy
into a padded tensor), and an online softmax runs over the context in tiles of 32 positions. All
arithmetic is fp32 (IEEE, not TF32): scores, softmax and the weighted sum of values are rounded to
the cache's dtype only at the output, so a sequence's result does not depend on what else is in
its batch.

Triton ships with torch's CUDA wheels; without it (CPU installs) `available()` is False and CUDA
decodes attend through SDPA over gathered KV (engine/attention.py). With TRITON_INTERPRET=1 set
before this module is imported, the kernel runs on CPU tensors (the tests check its indexing so).
"""

from __future__ import annotations

from functools import cache

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs carry no Triton
    triton = None

# Context positions a program reads per iteration, and its warps: the tile's fp32 K and V stay in
# registers at head sizes 64 and 128, bf16 or fp32 (ptxas for sm_90: head_dim 128 in bf16 takes
# 112 registers a thread; at 64 positions and 4 warps, 255 and 1,344 bytes spilled;
# tests/test_decode_kernel.py builds it so). Not tuned on a GPU yet.
TILE, NUM_WARPS = 32, 8


@cache
def available() -> bool:
    """Whether CUDA decodes can run the Triton kernel (Triton importable)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        out_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        block_table_ptr,
        context_lens_ptr,
        stride_q_tok,
        stride_q_head,
        stride_o_tok,
        stride_o_head,
        stride_kv_slot,
        stride_kv_head,
        stride_bt,
        scale,
        window,
        block_size,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        TILE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx = tl.load(context_lens_ptr + seq)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM_PAD)
        row_ok = rows < GROUP
        dim_ok = dims < HEAD_DIM
        heads = kv_head * GROUP + rows
        q = tl.load(
            q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        q = q * scale
        # The first key position attended (a sliding window's; window is huge without one), and
        # the tile that holds it.
        first = tl.maximum(ctx - window, 0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for tile_start in range((first // TILE) * TILE, ctx, TILE):
            pos = tile_start + tl.arange(0, TILE)
            valid = (pos < ctx) & (pos >= first)
            block = tl.load(block_table_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0)
            slot = block * block_size + pos % block_size
            offs = slot[:, None] * stride_kv_slot + kv_head * stride_kv_head + dims[None, :]
            kv_mask = valid[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [GROUP_PAD, TILE]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        o = acc / total[:, None]
        tl.store(
            out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


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
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(batch, num_kv_heads)](
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
