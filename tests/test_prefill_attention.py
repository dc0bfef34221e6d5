"""Prefill attention as chunked matmuls (engine/attention.py `_attend_matmul`, the CPU bf16 path),
as one SDPA call a sequence (`prefill_alone`, the CPU's other path) and as one batched SDPA call
(a GPU's), each against attention written out in fp32: several prompts in one step, prompts
extending a cached prefix, decodes in the same step, GQA and MHA, sliding windows, prompts longer
than a chunk and ending mid-chunk. And a whole prompt beside others, one call a sequence (up to
ALONE_MAX_SEQS of them), gets the bits it gets alone."""

from __future__ import annotations

import pytest
import torch

from engine.attention import ALONE_MAX_SEQS, PrefillSeqs, build_metadata, paged_attention


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


PATHS = {  # build_metadata's flags for each way the prefills attend
    "batched": {},
    "alone": {"prefill_alone": True},
    "matmul": {"prefill_matmul": True},
}
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
    for path in PATHS:
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = build_metadata(
            starts, lens, tables, num_decode, block_size, window or None, torch.device("cpu"), **PATHS[path]
        )
        assert isinstance(meta.prefill, PrefillSeqs) == (path != "batched")
        outs[path] = paged_attention(q, k_new, v_new, kc, vc, meta)
    # The dense reference reads the caches as written by the step.
    pos_slots = [
        [t[p // block_size] * block_size + p % block_size for p in range(s + n)] for t, (s, n) in zip(tables, seqs)
    ]
    ks = [kc[torch.tensor(p)] for p in pos_slots]
    vs = [vc[torch.tensor(p)] for p in pos_slots]
    want = dense(q, ks, vs, starts, lens, window)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    errors = {path: (out.float() - want).abs().max().item() for path, out in outs.items()}
    assert all(err < tol for err in errors.values()), errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_whole_prompt_beside_others_attends_as_it_does_alone(dtype):
    """One SDPA call a sequence: the prompt of 130 tokens in a step with a decode, a 7-token
    prompt and a chunk after a cached prefix gets the bits it gets as the step's only sequence."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    seqs = [(40, 1), (0, 130), (0, 7), (200, 65)]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(len(seqs))]
    k_cache, v_cache = (
        torch.randn(len(seqs) * 20 * block_size, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv"
    )
    total = sum(n for _, n in seqs)
    q, k, v = (torch.randn(total, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))

    def attend(which: list[int], alone: bool = True) -> torch.Tensor:
        rows = [r for i in which for r in range(sum(n for _, n in seqs[:i]), sum(n for _, n in seqs[: i + 1]))]
        starts, lens = [seqs[i][0] for i in which], [seqs[i][1] for i in which]
        meta = build_metadata(
            starts, lens, [tables[i] for i in which], sum(n == 1 for n in lens), block_size, None,
            torch.device("cpu"), decode_kernel=False, prefill_alone=alone,
        )  # fmt: skip
        return paged_attention(q[rows], k[rows], v[rows], k_cache.clone(), v_cache.clone(), meta)

    beside = attend([0, 1, 2, 3])[1 : 1 + 130]
    assert torch.equal(beside, attend([1]))
    assert torch.equal(attend([1]), attend([1], alone=False))  # alone, the batched path's very call


def test_more_prefill_sequences_than_alone_max_seqs_make_one_batched_call():
    for n, alone in ((ALONE_MAX_SEQS, True), (ALONE_MAX_SEQS + 1, False)):
        meta = build_metadata(
            [0] * n, [4] * n, [[i] for i in range(n)], 0, 16, None, torch.device("cpu"), prefill_alone=True
        )
        assert isinstance(meta.prefill, PrefillSeqs) == alone
