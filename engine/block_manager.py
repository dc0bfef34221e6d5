"""Hands out KV blocks: reference counts, and automatic prefix caching.

A sequence holds one reference to each block in its block_table; a kv_lease (the prefill side of a
transfer) holds another, so a sequence can finish while its KV is still being read.

Prefix caching (as vLLM's automatic prefix caching): every full block a sequence has computed is
named by a hash of (the hash of the block before it, its token ids), so a hash names the whole
prefix up to that block. A prompt's first block chains from its request's cache_salt: requests
with different salts (tenants: a router salts each API key's requests) never share a block, so
one cannot learn another's prompts from how fast its own are answered.

When its last reference goes, a named block stays in the cache, free but
evictable, least recently freed first; a new sequence whose prompt starts with the same tokens
takes those blocks (one more reference each) instead of computing them. Only full blocks are
shared and a sequence always computes at least its last token, so nothing ever writes into a
shared block. A block that runs out of free, unnamed company is evicted: its name is forgotten.

A name is 64 bits, so two prefixes can share one (by chance, or crafted: CVE-2025-25183). A hit
is therefore checked, never trusted: each named block keeps its key, (the block it follows and
that block's generation, its own tokens), and a lookup takes a block only if its key is exactly
the prefix being matched. A collision costs a miss, never another prefix's KV. (Generations
count a block's reuses, so a key never points at a parent block that was since recycled.)
"""

from __future__ import annotations

import struct
from collections import OrderedDict, deque
from collections.abc import Callable

import xxhash

from engine.sequence import Sequence

ROOT = "root"  # with the request's cache_salt, the parent of a prompt's first block
CACHE_EVENTS = 1 << 16  # name changes kept for routers that poll; one further behind gets a snapshot


def chain_hash(parent: int, token_ids: list[int]) -> int:
    """The name of a full block: xxh3 over its parent's name and its tokens (stable across
    processes, so that nodes can report what they hold)."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<Q{len(token_ids)}q", parent, *token_ids))


def salt_root(cache_salt: str) -> int:
    """The name a prompt's first block chains from: 0, or one per cache_salt (tenants apart)."""
    return xxhash.xxh3_64_intdigest(b"cache_salt\0" + cache_salt.encode()) if cache_salt else 0


def block_hashes(token_ids: list[int], block_size: int, cache_salt: str = "") -> list[int]:
    """The names of the full blocks of a token sequence, in order."""
    hashes, parent = [], salt_root(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.empty: deque[int] = deque(range(num_blocks))  # free, holding nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free, named: least recently freed first
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # name -> block id
        self.generation = [0] * num_blocks  # bumped each time a block is taken for new contents
        # Called with a block's id as it is taken for new contents, before anything writes it (a
        # transport whose readers copy blocks in place moves its own counter: kvtransfer/shm.py).
        self.on_reuse: Callable[[int], None] | None = None
        # A named block's key: ((parent block, its generation) or (ROOT, salt), its tokens), checked on a hit.
        self.block_key: list[tuple | None] = [None] * num_blocks
        self.num_collisions = 0  # names found whose block held other tokens (misses, never used)
        # What routers follow (cache_changes): a version bumped by every name added or evicted.
        self.cache_version = 0
        self.cache_events: deque[tuple[int, int, bool]] = deque(maxlen=CACHE_EVENTS)  # (version, name, added)
        # counters (metrics): tokens of admitted sequences looked up, and found; blocks evicted
        self.num_query_tokens = self.num_hit_tokens = self.num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty) + len(self.evictable)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts an admitted prefix lookup: its tokens, and those the cache held."""
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still lacks to hold KV for its first `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(seq, num_tokens) + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.num_new_blocks(seq, num_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {n}, {self.num_free_blocks} free")
        seq.block_table.extend(self._take() for _ in range(n))

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Blocks not tied to a sequence yet (a transfer's destination); caller frees them."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {num_blocks}, {self.num_free_blocks} free")
        return [self._take() for _ in range(num_blocks)]

    def _take(self) -> int:
        if self.empty:
            block_id = self.empty.popleft()
        else:  # evict the least recently freed named block
            block_id, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash[block_id]]
            self._event(self.block_hash[block_id], added=False)
            self.block_hash[block_id] = self.block_key[block_id] = None
            self.num_evicted_blocks += 1
        self.ref_counts[block_id] = 1
        self.generation[block_id] += 1
        if self.on_reuse is not None:
            self.on_reuse(block_id)
        return block_id

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
                if self.block_hash[block_id] is None:
                    self.empty.append(block_id)
                else:
                    self.evictable[block_id] = None

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the blocks past those num_tokens tokens need (speculative decoding's rollback:
        they held only rejected drafts, never named)."""
        keep = self.blocks_for(num_tokens)
        if len(seq.block_table) > keep:
            self.decref(seq.block_table[keep:][::-1])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        # Last blocks first: they go first when blocks run short (a prefix's head is shared most).
        self.decref(seq.block_table[::-1])
        seq.block_table = []
        seq.num_named_blocks = 0
        seq.cache_chain = []

    # ---- prefix caching ----------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The names of seq's first num_blocks full blocks (kept on seq: tokens of a full block never change)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else salt_root(seq.params.cache_salt)
            hashes.append(chain_hash(parent, seq.token_ids(i * bs, (i + 1) * bs)))
        return hashes[:num_blocks]

    def _key(self, seq: Sequence, i: int) -> tuple:
        """What block i of seq must hold to stand for it: its parent as seq's chain found it, and
        its tokens (a first block's parent is its salt)."""
        bs = self.block_size
        parent = seq.cache_chain[i - 1] if i else (ROOT, seq.params.cache_salt)
        return (parent, tuple(seq.token_ids(i * bs, (i + 1) * bs)))

    def acquire_prefix(self, seq: Sequence) -> int:
        """For a sequence with no KV yet: takes the cached blocks of the longest cached prefix of its
        tokens, leaving at least its last token to compute; returns the number of tokens they hold."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        seq.cache_chain = []
        if not self.enable_prefix_caching:
            return 0
        for i, name in enumerate(self._hashes(seq, (seq.num_tokens - 1) // self.block_size)):
            block_id = self.cached.get(name)
            if block_id is None:
                break
            if self.block_key[block_id] != self._key(seq, i):
                self.num_collisions += 1
                break
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
            seq.cache_chain.append((block_id, self.generation[block_id]))
        seq.num_named_blocks = len(seq.block_table)
        return len(seq.block_table) * self.block_size

    def names_to_compute(self, seq: Sequence) -> list[int]:
        """The names its computing will give seq's full blocks past those it holds named."""
        return self._names_past_named(seq, seq.num_tokens // self.block_size)

    def shareable_names(self, seq: Sequence) -> list[int]:
        """The names of seq's blocks past those it holds that a cache hit could give it (each full
        block before its last token's)."""
        return self._names_past_named(seq, (seq.num_tokens - 1) // self.block_size)

    def _names_past_named(self, seq: Sequence, full: int) -> list[int]:
        if not self.enable_prefix_caching or full <= seq.num_named_blocks:
            return []
        return self._hashes(seq, full)[seq.num_named_blocks :]

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Names seq's full blocks whose KV is computed, so that later sequences can share them.
        Each block joins seq's chain: itself, or the named block already holding the same prefix;
        past a block whose name another prefix holds (a collision), nothing more of seq is named."""
        if not self.enable_prefix_caching:
            return
        # KV computed past the last token (drafts accepted beyond a stop) names nothing.
        full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_table))
        if full <= seq.num_named_blocks:
            return
        names = self._hashes(seq, full)
        for i in range(seq.num_named_blocks, full):
            if len(seq.cache_chain) < i:
                break  # the chain broke at a collision
            block_id, name, key = seq.block_table[i], names[i], self._key(seq, i)
            if self.block_hash[block_id] is not None:  # already named (taken from the cache, forked)
                chained = block_id
            elif name not in self.cached:
                self.block_hash[block_id], self.block_key[block_id] = name, key
                self.cached[name] = chained = block_id
                self._event(name, added=True)
            elif self.block_key[self.cached[name]] == key:  # computed twice: the named one stands for it
                chained = self.cached[name]
            else:
                self.num_collisions += 1
                break
            seq.cache_chain.append((chained, self.generation[chained]))
        seq.num_named_blocks = full

    # ---- what the cache holds, for routers ------------------------------------------------
    def _event(self, name: int, added: bool) -> None:
        self.cache_version += 1
        self.cache_events.append((self.cache_version, name, added))

    def cache_changes(self, since: int) -> dict:
        """The names added and removed after version `since`, or (snapshot) every name held when
        `since` is 0, in the future (another engine's version) or older than the events kept.
        Safe to call from another thread than the engine's: each copy is one step under the GIL."""
        version, events = self.cache_version, list(self.cache_events)
        if since == version:
            return {"cache_version": version}
        if 0 < since < version and events and events[0][0] <= since + 1:
            added = [name for v, name, is_added in events if v > since and is_added]
            removed = [name for v, name, is_added in events if v > since and not is_added]
            return {"cache_version": version, "cached_added": added, "cached_removed": removed}
        return {"cache_version": version, "cached_added": list(self.cached), "cache_snapshot": True}
