"""The draft-model proposer: a smaller model with the target's vocabulary drafts k tokens.

Its KV lives in a tensor of its own, laid out in the target's blocks: a sequence's block_table
addresses both, so the draft costs no bookkeeping beyond the blocks the target allocates anyway
(here, before drafting, for the positions the drafts will take). A sequence's draft KV is
computed up to `draft_state.draft_computed`; each step the draft model first catches up on the
tokens past that (the whole prompt the first time; then the accepted drafts' last token and the
target's own), batched over the sequences, then drafts one token at a time, k - 1 more forwards
of single tokens. After a verification the draft KV stays valid up to the last accepted draft it
took as input; preemption resets it (the blocks are gone).

Drafts are the draft model's argmax: a point-mass proposal, for which keeping a draft while the
target's own sample equals it is exactly the rejection-sampling rule (engine/speculative.py), so
outputs stay those of decoding without speculation, greedy or seeded.
"""

from __future__ import annotations

import torch

from engine.attention import build_metadata
from engine.block_manager import BlockManager
from engine.cpu_kernels import decode_attention_fits
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.model_config import ModelConfig
from engine.model_source import resolve_model
from engine.ops import Ops
from engine.sequence import DraftState, Sequence
from engine.speculative import SpeculativeConfig, draft_length, observe
from engine.weights import load_weights


class DraftModelProposer:
    def __init__(
        self,
        config: SpeculativeConfig,
        target: ModelConfig,
        block_manager: BlockManager,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        reserve: int,
        fused_ops: bool,
        linear_kernel: str,
    ):
        model_dir = resolve_model(config.draft_model)
        cfg = ModelConfig.from_dir(model_dir).for_context(max_model_len)
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative.draft_model: its vocabulary ({cfg.vocab_size} tokens) must be the "
                f"target's ({target.vocab_size})"
            )
        self.config, self.cfg, self.device = config, cfg, device
        self.block_manager, self.reserve, self.max_model_len = block_manager, reserve, max_model_len
        self.model = LlamaModel(
            cfg, load_weights(model_dir, cfg, dtype, device, linear_kernel), max_model_len, Ops(fused=fused_ops)
        )
        self.decode_kernel = fused_ops and decode_attention_fits(cfg.head_dim)
        self.prefill_matmul = fused_ops and dtype == torch.bfloat16
        # Elsewhere on a CPU, one SDPA call a prefill sequence (up to attention.ALONE_MAX_SEQS of them).
        self.prefill_alone = device.type == "cpu"
        bm = block_manager
        self.kv_cache = KVCache(
            cfg.num_layers, bm.num_blocks, bm.block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device
        )

    def propose(self, seqs: list[Sequence]) -> None:
        bm = self.block_manager
        active: list[tuple[Sequence, int]] = []
        for seq in seqs:
            seq.draft_token_ids = []
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.keep_kv:
                continue
            state = seq.draft_state or _new_state(seq)
            # Drafts the scheduler dropped (they did not fit the step's tokens or blocks) were never
            # verified: the draft KV holds only the positions before the last token.
            state.draft_computed = min(state.draft_computed, seq.num_tokens - 1)
            k = draft_length(self.config, state, seq, self.max_model_len)
            # the drafts' positions: blocks now (the draft model writes there first), if spare
            if k < 1 or not bm.can_allocate(seq, seq.num_tokens + k - 1, reserve=self.reserve):
                continue
            bm.allocate(seq, seq.num_tokens + k - 1)
            active.append((seq, k))
        if not active:
            return
        # 1. catch up: every token past the draft KV, the last one giving the first draft
        drafts = self._forward([(seq, seq.draft_state.draft_computed, seq.num_tokens) for seq, _ in active])
        for (seq, _), token in zip(active, drafts):
            seq.draft_token_ids = [token]
            seq.draft_state.draft_computed = seq.num_tokens
        # 2. one token at a time
        for j in range(1, max(k for _, k in active)):
            going = [seq for seq, k in active if k > j]
            tokens = self._forward([(seq, seq.num_tokens + j - 1, seq.num_tokens + j) for seq in going])
            for seq, token in zip(going, tokens):
                seq.draft_token_ids.append(token)
                seq.draft_state.draft_computed = seq.num_tokens + j

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The draft KV holds the accepted drafts it took as input (all but the last draft)."""
        state = seq.draft_state
        state.draft_computed = min(state.draft_computed, seq.num_tokens + min(num_accepted, num_drafted - 1))
        observe(self.config, state, num_drafted, num_accepted)

    @torch.inference_mode()
    def _forward(self, spans: list[tuple[Sequence, int, int]]) -> list[int]:
        """Runs the draft model over tokens [start, end) of each sequence (drafts included);
        returns each one's argmax next token."""
        order = sorted(range(len(spans)), key=lambda i: spans[i][2] - spans[i][1] != 1)  # single tokens first
        ids, starts, lens, tables = [], [], [], []
        for i in order:
            seq, start, end = spans[i]
            ids.extend(seq.token_ids(start, end))
            starts.append(start)
            lens.append(end - start)
            tables.append(seq.block_table)
        num_single = sum(n == 1 for n in lens)
        meta = build_metadata(
            starts,
            lens,
            tables,
            num_single,
            self.block_manager.block_size,
            self.cfg.sliding_window,
            self.device,
            self.decode_kernel,
            self.prefill_matmul,
            self.prefill_alone,
            self.cfg.local_window,
        )
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long).to(self.device), meta.positions, meta, self.kv_cache
        )
        last = torch.tensor(lens).cumsum(0) - 1
        tokens = self.model.compute_logits(hidden[last.to(self.device)]).argmax(dim=-1).tolist()
        out = [0] * len(spans)
        for j, i in enumerate(order):
            out[i] = tokens[j]
        return out


def _new_state(seq: Sequence) -> DraftState:
    seq.draft_state = DraftState(tokens=None)
    return seq.draft_state
