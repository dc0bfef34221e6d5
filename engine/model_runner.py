"""Executes a ScheduledBatch: packs its tokens, runs one forward, samples. Knows nothing of
queues or requests beyond what the batch says."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from engine import cpu_kernels
from engine.attention import build_metadata
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.model import LlamaModel
from engine.model_config import ModelConfig
from engine.ops import Ops
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledBatch
from engine.weights import load_weights


class ModelRunner:
    def __init__(self, cfg: ModelConfig, model_dir: Path, config: EngineConfig, dtype: torch.dtype,
                 device: torch.device, max_model_len: int,
                 kv_allocator: Callable[[int], torch.Tensor] | None = None):
        self.cfg = cfg
        self.device = device
        self.block_size = config.block_size
        # The C++ kernels (decode attention, fused elementwise ops) on CPUs where they build.
        self.use_cpu_kernels = config.cpu_kernels and device.type == "cpu" and cpu_kernels.load()
        self.model = LlamaModel(cfg, load_weights(model_dir, cfg, dtype, device), max_model_len,
                                Ops(fused=self.use_cpu_kernels))
        bytes_per_block = cfg.kv_bytes_per_token(dtype.itemsize) * config.block_size
        num_blocks = config.num_kv_blocks or config.kv_cache_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes must hold at least one block of {bytes_per_block} bytes, "
                             f"got {config.kv_cache_bytes}")
        # kv: [layers, 2, blocks, block_size, kv_heads, head_dim]
        buffer = kv_allocator(num_blocks * bytes_per_block) if kv_allocator else None
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads,
                                cfg.head_dim, dtype, device, buffer)
        self.sampler = Sampler(config.seed, device)

    def forward(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
        """One forward over the batch's tokens. Returns the batch indices of the sequences whose KV
        catches up with their tokens this step (prefill chunks before the end do not), and their
        next-token logits [N, V] in fp32."""
        order = sorted(range(len(batch)), key=lambda i: batch.num_scheduled_tokens[i] != 1)  # decodes first
        seqs = [batch.seqs[i] for i in order]
        lens = [batch.num_scheduled_tokens[i] for i in order]
        starts = [seq.num_computed_tokens for seq in seqs]
        input_ids: list[int] = []
        for seq, start, n in zip(seqs, starts, lens):
            input_ids.extend(seq.token_ids(start, start + n))
        meta = build_metadata(starts, lens, [seq.block_table for seq in seqs], lens.count(1),
                              self.block_size, self.cfg.sliding_window, self.device, self.use_cpu_kernels)
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device)
        # Layer-wise streaming: prompts whose last chunk runs now publish each layer once written.
        streamed = [seq.kv_progress for seq, start, n in zip(seqs, starts, lens)
                    if seq.kv_progress is not None and start + n == seq.num_tokens]
        hidden = self.model.forward(ids, meta.positions, meta, self.kv_cache,
                                    self._publisher(streamed) if streamed else None)  # [T, H]

        rows, last_index, pos = [], [], 0
        for j, (seq, start, n) in enumerate(zip(seqs, starts, lens)):
            pos += n
            if start + n == seq.num_tokens:
                rows.append(order[j])
                last_index.append(pos - 1)
        if not rows:
            return [], hidden.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        return rows, self.model.compute_logits(hidden[torch.tensor(last_index, device=self.device)])

    def _publisher(self, streamed: list) -> Callable[[int], None]:
        cuda = self.device.type == "cuda"

        def layer_done(layer: int) -> None:
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            for progress in streamed:
                progress.layer_done(layer, event)
        return layer_done

    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """forward + sample. Per sequence in batch order: the sampled token id (None for a prefill
        chunk short of the end) and its logprobs when asked."""
        rows, logits = self.forward(batch)
        result = SamplerOutput([None] * len(batch), [None] * len(batch))
        if not rows:
            return result
        sampling = [batch.seqs[i] for i in rows]
        out = self.sampler(logits, [s.params for s in sampling], [len(s.output_token_ids) for s in sampling])
        for i, token_id, logprobs in zip(rows, out.token_ids, out.logprobs):
            result.token_ids[i] = token_id
            result.logprobs[i] = logprobs
        return result
