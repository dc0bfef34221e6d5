"""Executes a ScheduledBatch: packs its tokens, runs one forward, samples. Knows nothing of
queues or requests beyond what the batch says."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.attention import build_metadata
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.model_config import ModelConfig
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledBatch
from engine.weights import load_weights


class ModelRunner:
    def __init__(self, cfg: ModelConfig, model_dir: Path, config: EngineConfig, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, kv_buffer: torch.Tensor | None = None):
        self.cfg = cfg
        self.device = device
        self.block_size = config.block_size
        self.model = LlamaModel(cfg, load_weights(model_dir, cfg, dtype, device), max_model_len)
        bytes_per_block = cfg.kv_bytes_per_token(dtype.itemsize) * config.block_size
        num_blocks = config.num_kv_blocks or config.kv_cache_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes must hold at least one block of {bytes_per_block} bytes, "
                             f"got {config.kv_cache_bytes}")
        # kv: [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads,
                                cfg.head_dim, dtype, device, kv_buffer)
        self.sampler = Sampler(config.seed, device)

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Runs one step. Returns, per sequence in batch order, the sampled token id (None for a
        prefill chunk that does not reach the end of its sequence yet) and logprobs if asked."""
        order = sorted(range(len(batch)), key=lambda i: batch.num_scheduled_tokens[i] != 1)  # decodes first
        seqs = [batch.seqs[i] for i in order]
        lens = [batch.num_scheduled_tokens[i] for i in order]
        starts = [seq.num_computed_tokens for seq in seqs]
        input_ids: list[int] = []
        for seq, start, n in zip(seqs, starts, lens):
            input_ids.extend(seq.token_ids(start, start + n))
        meta = build_metadata(starts, lens, [seq.block_table for seq in seqs], lens.count(1),
                              self.block_size, self.cfg.sliding_window, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device)
        hidden = self.model.forward(ids, meta.positions, meta, self.kv_cache)  # [T, H]

        # Only sequences whose KV catches up with their tokens produce a next token.
        ends, last_index, pos = [], [], 0
        for j, (seq, start, n) in enumerate(zip(seqs, starts, lens)):
            pos += n
            if start + n == seq.num_tokens:
                ends.append(j)
                last_index.append(pos - 1)
        result = SamplerOutput([None] * len(batch), [None] * len(batch))
        if not ends:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(last_index, device=self.device)])
        sampling = [seqs[j] for j in ends]
        out = self.sampler(logits, [s.params for s in sampling], [len(s.output_token_ids) for s in sampling])
        for j, token_id, logprobs in zip(ends, out.token_ids, out.logprobs):
            result.token_ids[order[j]] = token_id
            result.logprobs[order[j]] = logprobs
        return result
