"""Prefill attention as chunked matmuls (engine/attention.py `_attend_matmul`, the CPU bf16 path)
against attention written out in fp32, and against the SDPA path it replaces: several prompts in
one step, prompts extending a cached prefix, decodes in the same step, GQA and MHA, sliding
windows, prompts longer than a chunk and ending mid-chunk."""

from __future__ import annotations

import pytest
import torch

from engine.attention import PrefillSeqs, build_metadata, paged_attention


def dense(q, k, v, starts, lens, window):
    """q: [T, Hq, D]; k, v: per sequence [start + len, Hkv, D] -> [T, Hq, D] in fp32."""
    out = []
    first = 0
    for seq, (start, n) in enumerate(zip(starts, lens)):
        group = q.shape[1] // k[seq].shape[1]
        ks = k[seq].float().transpose(0, 1).repeat_interleave(group, 0)  # [Hq, ctx, D]
        vs = v[seq].float().transpose(0, 1).repeat_interleave(group, 0)
        qs = q[first : first + n].float().transpose(0, 1)  # [Hq, n, D]
        scores = qs @ ks.transpose(1, 2) * q.shape[-1] ** -0.5
        q_pos = torch.arange(start, start + n)[:, None]
        k_pos = torch.arange(start + n)[None, :]
        hidden = k_pos > q_pos
        if window:
            hidden |= k_pos <= q_pos - window
        out.append((scores.masked_fill(hidden, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
        first += n
    return torch.cat(out)


CASES = [  # heads, kv_heads, head_dim, block_size, (start, len) per sequence (len 1 first: decodes), window
    (9, 3, 64, 16, [(0, 610)], 0),
    (9, 3, 64, 16, [(40, 1), (0, 130), (0, 7), (200, 65)], 0),
    (4, 4, 32, 8, [(3, 1), (0, 64), (64, 64)], 0),
    (8, 2, 64, 16, [(0, 300), (100, 90)], 48),
    (6, 1, 16, 1, [(17, 1), (0, 65)], 0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seqs,window", CASES)
def test_prefill_matmul_matches_dense_and_sdpa(heads, kv_heads, head_dim, block_size, seqs, window, dtype):
    g = torch.Generator().manual_seed(heads * 100 + len(seqs))
    starts, lens = [s for s, _ in seqs], [n for _, n in seqs]
    num_decode = sum(1 for n in lens if n == 1)
    widths = [(s + n + block_size - 1) // block_size for s, n in seqs]
    perm = torch.randperm(sum(widths) + 2, generator=g).tolist()  # scattered blocks
    tables, used = [], 0
    for w in widths:
        tables.append(perm[used : used + w])
        used += w
    num_slots = (sum(widths) + 2) * block_size
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).mul(2).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)
    total = sum(lens)
    q = torch.randn(total, heads, head_dim, generator=g).mul(2).to(dtype)
    k_new = torch.randn(total, kv_heads, head_dim, generator=g).mul(2).to(dtype)
    v_new = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)

    outs = {}
    for matmul in (False, True):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = build_metadata(
            starts, lens, tables, num_decode, block_size, window or None, torch.device("cpu"), prefill_matmul=matmul
        )
        assert isinstance(meta.prefill, PrefillSeqs) == matmul
        outs[matmul] = paged_attention(q, k_new, v_new, kc, vc, meta)
    # The dense reference reads the caches as written by the step.
    pos_slots = [
        [t[p // block_size] * block_size + p % block_size for p in range(s + n)] for t, (s, n) in zip(tables, seqs)
    ]
    ks = [kc[torch.tensor(p)] for p in pos_slots]
    vs = [vc[torch.tensor(p)] for p in pos_slots]
    want = dense(q, ks, vs, starts, lens, window)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    err_matmul = (outs[True].float() - want).abs().max().item()
    err_sdpa = (outs[False].float() - want).abs().max().item()
    assert err_matmul < tol, (err_matmul, err_sdpa)
    assert err_sdpa < tol
