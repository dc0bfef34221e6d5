"""The Triton source of the CUDA paged decode attention (launched by cuda_kernels.py, which
imports this module only when a CUDA engine asks for it: Triton costs a CPU process 0.24 s to
import).

One program per (sequence, KV head): the query heads that share the KV head (GQA) are the rows of
one tile, each key and value row is read once, in place, through the block table (no gather copy
into a padded tensor), and an online softmax runs over the context in tiles of TILE positions. All
arithmetic is fp32 (IEEE, not TF32): scores, softmax and the weighted sum of values are rounded to
the cache's dtype only at the output, so a sequence's result does not depend on what else is in
its batch.
"""

import triton
import triton.language as tl

# Context positions a program reads per iteration, and its warps: the tile's fp32 K and V stay in
# registers at head sizes 64 and 128, bf16 or fp32, built as a launch specializes it (16-byte
# aligned pointers and strides: vectorized loads). ptxas for sm_90, registers a thread / bytes
# spilled, head size 128: bf16 170 / 0 and fp32 74 / 0 here; bf16 at 32 positions and 8 warps 255
# / 160, at 16 and 4 warps 255 / 192 (tests/test_decode_kernel.py builds it). Not tuned on a GPU.
TILE, NUM_WARPS = 16, 8


@triton.jit
def paged_decode_kernel(
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
    seq = tl.program_id(0).to(tl.int64)  # offsets in int64 throughout: a KV cache passes 2^31 elements
    kv_head = tl.program_id(1).to(tl.int64)
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
