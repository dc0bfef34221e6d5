"""The one preallocated KV tensor, and reading/writing a sequence's KV in and out of its blocks.

Layout: kv[layer, k_or_v, block, offset, kv_head, head_dim]. A token's slot is
block * block_size + offset; layers see [num_slots, kv_heads, head_dim] views of it.
Export/import move a sequence's KV in a layer-ordered layout [layers, 2, tokens, kv_heads,
head_dim], so the next engine's blocks can sit anywhere in its own tensor.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        buffer: torch.Tensor | None = None,
    ):
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if buffer is None:
            # zeros, not empty: every page is touched now rather than on a first, timed use.
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        else:  # e.g. a shared-memory region another process reads blocks from
            self.kv = buffer.view(dtype).view(shape)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Per layer: [num_slots, kv_heads, head_dim] views for K and V.
        self.slots = self.kv.view(num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.kv[0, 0, 0].numel() * self.kv.element_size() * 2 * self.kv.shape[0]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slots[i, 0], self.slots[i, 1]

    def token_slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        blocks = torch.tensor(block_table, dtype=torch.long)
        offsets = torch.arange(self.block_size)
        slots = (blocks[:, None] * self.block_size + offsets[None, :]).view(-1)[:num_tokens]
        return slots.to(self.kv.device)

    def export_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """A sequence's KV, layer-ordered: [layers, 2, num_tokens, kv_heads, head_dim] (a copy)."""
        return self.slots[:, :, self.token_slots(block_table, num_tokens)]

    def import_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        """Writes layer-ordered KV [layers, 2, T, kv_heads, head_dim] into the given blocks."""
        expected = (self.slots.shape[0], 2, kv.shape[2]) + tuple(self.slots.shape[3:])
        if tuple(kv.shape) != expected or kv.dtype != self.kv.dtype:
            raise ValueError(f"kv: expected shape {expected} dtype {self.kv.dtype}, got {tuple(kv.shape)} {kv.dtype}")
        if -(-kv.shape[2] // self.block_size) > len(block_table):
            raise ValueError(f"kv: {kv.shape[2]} tokens do not fit in {len(block_table)} blocks")
        self.slots[:, :, self.token_slots(block_table, kv.shape[2])] = kv.to(self.kv.device)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block dst gets block src's KV in every layer."""
        self.kv[:, :, dst] = self.kv[:, :, src]
