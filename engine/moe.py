"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's
top-k experts, each expert is a gated MLP, and a token's output is the sum of its experts' outputs
weighted by the router's probabilities (plus, in Qwen2-MoE, a shared expert's output gated by
sigmoid(shared_expert_gate(h))).

Routing as transformers computes it: softmax over the router logits in fp32, top-k, the k weights
renormalized to sum to 1 (always in Mixtral; Qwen3-MoE where norm_topk_prob says so). Tokens are
grouped by expert (a stable sort of the routed pairs), each expert runs once over its tokens, and
the weighted outputs are added into the tokens' rows expert by expert in ascending order, so a
token's sum runs in one order whatever else is in the batch (each expert's linears are
row-independent), as deterministic mode needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.linear import Linear


@dataclass
class MoEWeights:
    router: Linear  # [E, H]
    gate_up: list[Linear]  # per expert [2 I, H]
    down: list[Linear]  # per expert [H, I]
    top_k: int
    renormalize: bool
    shared_gate_up: Linear | None = None  # [2 Is, H], the shared expert
    shared_down: Linear | None = None  # [H, Is]
    shared_gate: Linear | None = None  # [1, H]


def moe_mlp(h: torch.Tensor, w: MoEWeights, act_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """h: [T, H] -> [T, H]; act_mul: [N, 2 I] (gate, up) -> [N, I]."""
    probs = torch.softmax(w.router(h).float(), dim=-1)  # [T, E]
    weights, experts = probs.topk(w.top_k, dim=-1)  # [T, k]
    if w.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = experts.view(-1)
    order = torch.argsort(flat, stable=True)  # routed pairs grouped by expert, tokens ascending within
    tokens = order // w.top_k
    counts = torch.bincount(flat, minlength=len(w.down)).tolist()
    x = h.index_select(0, tokens)  # [P, H]: each pair's token, expert by expert
    y = torch.empty_like(x)
    first = 0
    for e, n in enumerate(counts):
        if n:
            y[first : first + n] = w.down[e](act_mul(w.gate_up[e](x[first : first + n])))
            first += n
    # One add of every pair, in the pairs' order: each token's experts summed in ascending order.
    out = torch.zeros_like(h).index_add_(0, tokens, (y * weights.view(-1)[order, None]).to(h.dtype))
    if w.shared_gate_up is not None:
        shared = w.shared_down(act_mul(w.shared_gate_up(h)))
        out = out + torch.sigmoid(w.shared_gate(h)) * shared
    return out
