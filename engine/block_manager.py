"""Hands out KV blocks: a free list and a reference count per block.

A block returns to the free list when its last reference is dropped. A sequence holds one
reference to each block in its block_table; a kv_lease (the prefill side of a transfer) holds
another, so a sequence can finish while its KV is still being read.
"""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks to hold KV for its first `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(seq, num_tokens) + reserve <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.num_new_blocks(seq, num_tokens)
        if n > len(self.free_block_ids):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self.free_block_ids)} free")
        for _ in range(n):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Blocks not tied to a sequence yet (a transfer's destination); caller frees them."""
        if num_blocks > len(self.free_block_ids):
            raise RuntimeError(f"out of KV blocks: need {num_blocks}, {len(self.free_block_ids)} free")
        block_ids = [self.free_block_ids.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"incref of free block {block_id}")
            self.ref_counts[block_id] += 1

    def decref(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)

    def free(self, seq: Sequence) -> None:
        self.decref(seq.block_table)
        seq.block_table = []
