"""Paged attention in plain torch: write new K/V into their slots, read each sequence's context
back through its block table, and attend with scaled_dot_product_attention.

A step's tokens are laid out decode-first: the first `num_decode_tokens` are single-token
queries (one per sequence), the rest are prefill chunks of any length. Each group is one
batched SDPA call over [B, heads, q_len, context] with a boolean mask, so mixed batches never
pad a decode query up to a prefill's length. Decodes run in a kernel that reads the KV in place
instead where one runs: the C++ kernel on a CPU, the Triton kernel on CUDA (cuda_kernels.py). On a
CPU the prefills run one sequence at a time instead (`PrefillSeqs`): as chunked matmuls in bf16
with the C++ kernels (`_attend_matmul`), else, up to ALONE_MAX_SEQS of them, one SDPA call each,
a whole prompt causal without a mask, so that its attention beside others has the bits it has alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine import cuda_kernels

# On CUDA, not cuDNN's attention: it builds a plan per shape (1.7 ms of CPU each on an H200), and
# a decode step's key length is new every step (bf16 decode steps ran 3x slower with it).
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# A CPU step's prefill sequences, at most, that make one SDPA call each: beyond, the per-call cost
# outweighs the padding and the mask saved (one thread, a layer's attention against the batched
# call's, scratch timings: 5 x 610 tokens 0.65x, 16 x 64 0.58x, 64 x 16 0.70x, 256 x 16 1.33x,
# 128 x 4 4.7x). A prefill node's step of 610-token prompts holds at most 7.
ALONE_MAX_SEQS = 16


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """Where a forward's SDPA calls may run: CUDA_BACKENDS on a GPU (entered once per forward,
    not per call: the host bounds a small model's step there), torch's choice elsewhere."""
    return sdpa_kernel(CUDA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class AttendGroup:
    slots: torch.Tensor  # [B, Lk] slot of each context position (padding reads slot 0, masked)
    mask: torch.Tensor | None  # [B, 1, Lq, Lk] True where the query may attend the key; None: causal
    q_index: torch.Tensor | None  # [Tg] packed query -> row in [B * Lq]; None when Lq == 1
    q_len: int


@dataclass
class DecodeGroup:
    """For the decode kernels (C++ on a CPU, Triton on CUDA), which read K/V in place through the
    block table."""

    block_table: torch.Tensor  # [B, max_blocks] int64
    context_lens: torch.Tensor  # [B] int64, the new token included


@dataclass
class PrefillSeqs:
    """On a CPU: each prefill sequence attended alone, no padding (in `_attend_matmul`, or SDPA:
    a whole prompt batched with others under one mask took 1.25x the attention of the prompts
    alone, causal, in fp32 on AVX2, five of 600 tokens: docs/benchmarks.md at 0f5299a, "2b")."""

    slots: list[torch.Tensor]  # per sequence, [start + len] slots of its context
    starts: list[int]
    lens: list[int]
    masks: list[torch.Tensor | None]  # SDPA's: [1, 1, len, start + len], None where causal (or matmul)
    matmul: bool


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decode_tokens: int
    decode: AttendGroup | DecodeGroup | None
    prefill: AttendGroup | PrefillSeqs | None
    block_size: int
    sliding_window: int | None
    local: AttentionMetadata | None = None  # the same step's for the layers that slide a window of their own


def build_metadata(
    starts: list[int],
    lens: list[int],
    block_tables: list[list[int]],
    num_decode: int,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    decode_kernel: bool = False,
    prefill_matmul: bool = False,
    prefill_alone: bool = False,
    local_window: int | None = None,
) -> AttentionMetadata:
    """starts[i]: KV positions sequence i already has; lens[i]: positions computed this step.
    The first `num_decode` sequences have lens == 1. With decode_kernel, their attention runs in
    a decode kernel (cpu_kernels.py, cuda_kernels.py); with prefill_matmul, the prefills' runs in
    `_attend_matmul`; with prefill_alone (a CPU's), one SDPA call a sequence where they are at
    most ALONE_MAX_SEQS. Entries may share one block
    table (the queries of one sequence: the same list object), which is then copied to a tensor
    once. With local_window (a model whose layers slide a window only in part), `local` holds the
    metadata for the layers that slide it."""
    if local_window is not None:
        args = (starts, lens, block_tables, num_decode, block_size)
        kernels = (device, decode_kernel, prefill_matmul, prefill_alone)
        meta = build_metadata(*args, sliding_window, *kernels)
        meta.local = build_metadata(*args, local_window, *kernels)
        return meta
    num_seqs = len(starts)
    width = max(len(bt) for bt in block_tables)
    row_of: dict[int, int] = {}  # id(table) -> its row in unique
    unique: list[list[int]] = []
    for bt in block_tables:
        if id(bt) not in row_of:
            row_of[id(bt)] = len(unique)
            unique.append(bt)
    rows = torch.tensor([row_of[id(bt)] for bt in block_tables], dtype=torch.long)
    block_table = torch.tensor([bt + [0] * (width - len(bt)) for bt in unique], dtype=torch.long)[rows]
    start = torch.tensor(starts, dtype=torch.long)
    length = torch.tensor(lens, dtype=torch.long)

    def all_slots(sl: slice, ctx: int) -> torch.Tensor:
        """[B, ctx]: the slot of each of the first ctx positions of the sequences in sl."""
        return (block_table[sl, :, None] * block_size + torch.arange(block_size)).view(sl.stop - sl.start, -1)[:, :ctx]

    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), length)
    first_token = torch.cumsum(length, 0) - length
    pos = start[seq_of_token] + torch.arange(int(length.sum())) - first_token[seq_of_token]
    slot_mapping = block_table[seq_of_token, pos // block_size] * block_size + pos % block_size

    def group(sl: slice) -> AttendGroup | None:
        if sl.start == sl.stop:
            return None
        g_start, g_len = start[sl], length[sl]
        q_len = int(g_len.max())
        ctx = int((g_start + g_len).max())
        # Query i of a sequence sits at position start + i; padded rows repeat the last one.
        i = torch.arange(q_len)
        q_pos = g_start[:, None] + torch.minimum(i[None, :], g_len[:, None] - 1)  # [B, Lq]
        # One whole prompt from position 0 (the common prefill on a GPU): plain causal attention,
        # which SDPA computes without reading a mask and skips the blocks above the diagonal
        # (docs/benchmarks.md at 0f5299a, "2b": 1.09-1.11x at 610 tokens, 1.48x at 2,000 on a CPU).
        mask = None
        if not (sl.stop - sl.start == 1 and _whole(int(g_start[0]), sliding_window)):
            mask = _mask(q_pos, ctx, sliding_window).to(device)
        q_index = None
        if q_len > 1:
            first = int(first_token[sl.start])
            tok = torch.arange(first, first + int(g_len.sum()))
            seq = seq_of_token[tok]
            q_index = ((seq - sl.start) * q_len + tok - first_token[seq]).to(device)
        return AttendGroup(all_slots(sl, ctx).contiguous().to(device), mask, q_index, q_len)

    if decode_kernel and num_decode:
        decode = DecodeGroup(block_table[:num_decode].to(device), (start + length)[:num_decode].to(device))
    else:
        decode = group(slice(0, num_decode))
    alone = prefill_alone and num_seqs - num_decode <= ALONE_MAX_SEQS
    if (prefill_matmul or alone) and num_decode < num_seqs:
        seqs = range(num_decode, num_seqs)
        prefill = PrefillSeqs(
            [all_slots(slice(i, i + 1), starts[i] + lens[i])[0].to(device) for i in seqs],
            starts[num_decode:],
            lens[num_decode:],
            [
                None
                if prefill_matmul or _whole(starts[i], sliding_window)
                else _mask(torch.arange(starts[i], starts[i] + lens[i])[None], starts[i] + lens[i], sliding_window).to(
                    device
                )
                for i in seqs
            ],
            prefill_matmul,
        )
    else:
        prefill = group(slice(num_decode, num_seqs))
    return AttentionMetadata(
        pos.to(device), slot_mapping.to(device), num_decode, decode, prefill, block_size, sliding_window
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [num_slots, Hkv, D]. Returns [T, Hq, D].
    scale: the scores' (default head_dim ** -0.5); softcap: scores capped to cap * tanh(s / cap)
    before the mask (Gemma 2)."""
    kernel_scale = q.shape[-1] ** -0.5 if scale is None else scale  # (SDPA's default, passed as None)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    nd = meta.num_decode_tokens
    out = q.new_empty(q.shape)  # q may be a strided view into the fused qkv output
    if isinstance(meta.decode, DecodeGroup):
        args = (out[:nd], q[:nd], k_cache, v_cache, meta.decode.block_table, meta.decode.context_lens)
        if q.is_cuda:  # (the engine runs it only without a softcap)
            cuda_kernels.paged_decode_attention(*args, meta.block_size, kernel_scale, meta.sliding_window or 0)
        else:
            torch.ops.pdserve.paged_decode_attention(
                *args, meta.block_size, kernel_scale, meta.sliding_window or 0, softcap or 0.0
            )
    elif meta.decode is not None:
        out[:nd] = _attend(q[:nd].unsqueeze(1), k_cache, v_cache, meta.decode, scale, softcap).squeeze(1)
    if meta.prefill is None:
        return out
    g = meta.prefill
    if isinstance(g, PrefillSeqs):
        first = nd
        for slots, start, n, mask in zip(g.slots, g.starts, g.lens, g.masks):
            if g.matmul:
                window = meta.sliding_window
                o, qs = out[first : first + n], q[first : first + n]
                _attend_matmul(o, qs, k_cache, v_cache, slots, start, window, kernel_scale, softcap)
            else:  # (q contiguous as a lone prompt's: the same call, the same bits)
                alone = AttendGroup(slots[None], mask, None, n)
                q_seq = q[first : first + n].contiguous()[None]
                out[first : first + n] = _attend(q_seq, k_cache, v_cache, alone, scale, softcap)[0]
            first += n
        return out
    batch = g.slots.shape[0]
    q_pad = q.new_zeros(batch * g.q_len, *q.shape[1:]).index_copy_(0, g.q_index, q[nd:])
    o = _attend(q_pad.view(batch, g.q_len, *q.shape[1:]), k_cache, v_cache, g, scale, softcap)
    out[nd:] = o.reshape(batch * g.q_len, *q.shape[1:]).index_select(0, g.q_index)
    return out


def _whole(start: int, sliding_window: int | None) -> bool:
    """A whole prompt from position 0 without a window: SDPA's is_causal, no mask."""
    return start == 0 and sliding_window is None


def _mask(q_pos: torch.Tensor, ctx: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, Lq, ctx]: True where the query at q_pos [B, Lq] may attend the key."""
    k_pos = torch.arange(ctx)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    return mask[:, None]


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: AttendGroup,
    scale: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [B, Lq, Hq, D] -> [B, Lq, Hq, D], attending over the group's context slots; scale None:
    head_dim ** -0.5."""
    batch, ctx = g.slots.shape
    flat = g.slots.view(-1)
    k = k_cache.index_select(0, flat).view(batch, ctx, *k_cache.shape[1:]).transpose(1, 2)  # [B, Hkv, Lk, D]
    v = v_cache.index_select(0, flat).view(batch, ctx, *v_cache.shape[1:]).transpose(1, 2)
    if softcap:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return _attend_capped(q.transpose(1, 2), k, v, g.mask, scale, softcap).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k,
        v,
        attn_mask=g.mask,
        is_causal=g.mask is None,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[1],
    )
    return o.transpose(1, 2)


def _attend_capped(q, k, v, mask: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
    """Attention written out, for soft-capped scores (which SDPA cannot take), as transformers'
    eager Gemma 2 computes it: q [B, Hq, Lq, D]; k, v [B, Hkv, Lk, D]; mask [B, 1, Lq, Lk] or None
    (causal, queries the last Lq positions)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is None:
        lq, lk = s.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _attend_matmul(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    start: int,
    sliding_window: int | None,
    scale: float,
    softcap: float | None = None,
    chunk: int = 64,
) -> None:
    """One sequence's prefill queries q [L, Hq, D] (positions start..start+L-1) over its context
    slots, written into out [L, Hq, D]: per chunk of 64 queries, two batched fp32 matmuls with the
    KV head's query heads stacked as rows (GQA) and a softmax between them. On a CPU in bf16 this
    is faster than torch's flash-attention kernel (oneDNN's GEMMs against its inner loop; the
    prefill of a 610-token prompt 1.1-1.2x, three together 1.4x) and closer to exact: nothing is
    rounded to bf16 before the output, as in the decode kernel, so a prompt computed whole and
    one whose prefix KV came from earlier decode steps agree. Keys past a chunk's last query are
    never read."""
    seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    k = k_cache.index_select(0, slots).transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
    v = v_cache.index_select(0, slots).transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
    q = q.view(seq_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, L, D]
    out = out.view(seq_len, num_kv_heads, group, head_dim)
    c0 = 0
    while c0 < seq_len:
        # Chunks aligned to absolute positions: a query sees the same keys in the same sums
        # whether its prefix was cached or computed in this step (identical greedy tokens).
        n = min(chunk - (start + c0) % chunk, seq_len - c0)
        k_end = start + c0 + n  # one past the chunk's last query position
        k_begin = max(0, start + c0 - sliding_window + 1) if sliding_window else 0
        qc = q[:, :, c0 : c0 + n].reshape(num_kv_heads, group * n, head_dim).float() * scale
        s = torch.bmm(qc, k[:, k_begin:k_end].transpose(1, 2)).view(num_kv_heads, group, n, k_end - k_begin)
        if softcap:
            s.div_(softcap).tanh_().mul_(softcap)
        # Without a window, only the chunk's own n positions (the last n keys) hide any key.
        masked = s if sliding_window else s[..., -n:]
        q_pos = torch.arange(start + c0, k_end)[:, None]
        k_pos = torch.arange(k_end - masked.shape[-1], k_end)[None, :]
        hidden = k_pos > q_pos
        if sliding_window:
            hidden |= k_pos <= q_pos - sliding_window
        masked.masked_fill_(hidden.to(s.device), float("-inf"))
        p = torch.softmax(s, -1).view(num_kv_heads, group * n, k_end - k_begin)
        o = torch.bmm(p, v[:, k_begin:k_end])  # [Hkv, G * n, D]
        out[c0 : c0 + n] = o.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        c0 += n
