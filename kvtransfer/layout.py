"""What both sides of a transfer must agree on, and the layer-ordered byte stream of a sequence.

The stream of a sequence's KV is [layers, K/V, tokens, kv_heads, head_dim]: for each layer and
K/V, its tokens in order. Within the engine's cache that is a run of contiguous pieces (one per
run of consecutive blocks), so the stream is read and written piece by piece, without gathers.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from engine.kv_cache import KVCache
from pdserve_api import nodes_pb2


class KVLayoutMismatch(ValueError):
    """The two sides' KV caches are not interchangeable; nothing was copied."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16", "float16", "float32"
    block_size: int
    model_fingerprint: str
    numerics: str = (
        "default"  # or "deterministic (the kernels)": the engine's deterministic mode; "; int8 weights" after either
    )
    attention: str = "full"  # which layers slide which window (ModelConfig.attention)

    @classmethod
    def of(
        cls, kv_cache: KVCache, model_fingerprint: str, numerics: str = "default", attention: str = "full"
    ) -> KVLayout:
        layers, _, _, block_size, kv_heads, head_dim = kv_cache.kv.shape
        dtype = str(kv_cache.kv.dtype).removeprefix("torch.")
        return cls(layers, kv_heads, head_dim, dtype, block_size, model_fingerprint, numerics, attention)

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    def num_bytes(self, num_tokens: int) -> int:
        return 2 * self.num_layers * num_tokens * self.num_kv_heads * self.head_dim * self.itemsize

    def check(
        self, other: KVLayout, same_block_size: bool = False, sides: tuple[str, str] = ("decode", "prefill")
    ) -> None:
        """Raises KVLayoutMismatch naming every field that differs (self is sides[0]). Deterministic
        KV holds only for the block size it was computed with (attention sums a block at a time)."""
        fields = ["model_fingerprint", "num_layers", "num_kv_heads", "head_dim", "dtype", "numerics"]
        if self.attention and other.attention:
            fields.insert(4, "attention")
        if same_block_size or all(n.startswith("deterministic") for n in (self.numerics, other.numerics)):
            fields.append("block_size")
        diffs = [
            f"{f}: {sides[0]} {getattr(self, f)!r}, {sides[1]} {getattr(other, f)!r}"
            for f in fields
            if getattr(self, f) != getattr(other, f)
        ]
        if diffs:
            raise KVLayoutMismatch("KV layout mismatch between prefill and decode, nothing copied: " + "; ".join(diffs))

    def to_proto(self) -> nodes_pb2.KVLayout:
        return nodes_pb2.KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_size=self.block_size,
            model_fingerprint=self.model_fingerprint,
            numerics=self.numerics,
            attention=self.attention,
        )

    @classmethod
    def from_proto(cls, m: nodes_pb2.KVLayout) -> KVLayout:
        return cls(
            m.num_layers,
            m.num_kv_heads,
            m.head_dim,
            m.dtype,
            m.block_size,
            m.model_fingerprint,
            m.numerics or "default",
            m.attention,  # "" from an older node: not compared
        )


def model_fingerprint(model_dir: Path) -> str:
    """Same checkpoint on both sides, as far as a cheap check can tell, whatever dtype each side
    loads it in: config.json, and each weight file's size, safetensors header (tensor names,
    shapes, offsets) and first MiB of data."""
    model_dir = Path(model_dir)
    h = xxhash.xxh3_64((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(path.stat().st_size.to_bytes(8, "little"))
            h.update(f.read(header_len))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(first block, count) for each run of consecutive block ids."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def pieces(
    kv: torch.Tensor, block_ids: list[int], num_tokens: int, layers: range | None = None
) -> Iterator[torch.Tensor]:
    """The layer-ordered stream of a sequence as contiguous views into kv [L, 2, NB, bs, H, D]:
    for each layer (all, or those in `layers`) and K/V, one view per run of consecutive blocks."""
    num_layers, _, _, block_size, kv_heads, head_dim = kv.shape
    runs = block_runs(block_ids)
    for layer in layers if layers is not None else range(num_layers):
        for k_or_v in (0, 1):
            remaining = num_tokens
            for first, count in runs:
                if remaining <= 0:
                    break
                n = min(count * block_size, remaining)
                yield kv[layer, k_or_v, first : first + count].view(-1, kv_heads, head_dim)[:n]
                remaining -= n


def layer_views(kv: torch.Tensor, block_ids: list[int], num_tokens: int, layers: range) -> list[list[memoryview]]:
    """For each layer in `layers`, its part (K, then V) of the layer-ordered stream as byte views
    into a CPU kv, one per run of consecutive blocks: what sockets send from and receive into.
    Numpy slicing: microseconds per layer, where torch views cost several per piece."""
    rows = kv.view(torch.uint8).numpy()  # [L, 2, NB, bs, H, D * itemsize]
    token_bytes = rows.shape[4] * rows.shape[5]
    spans, remaining = [], num_tokens  # (first block, count, bytes) per run
    for first, count in block_runs(block_ids):
        if remaining <= 0:
            break
        n = min(count * rows.shape[3], remaining)
        spans.append((first, count, n * token_bytes))
        remaining -= n
    return [
        [
            memoryview(rows[layer, k_or_v, first : first + count].reshape(-1)[:nbytes])
            for k_or_v in (0, 1)
            for first, count, nbytes in spans
        ]
        for layer in layers
    ]


def digest_views(views: list[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def layer_digest(kv: torch.Tensor, block_ids: list[int], num_tokens: int, layer: int) -> int:
    """xxh3_64 of one layer's part (K, then V) of the layer-ordered stream."""
    if kv.device.type == "cpu":
        return digest_views(layer_views(kv, block_ids, num_tokens, range(layer, layer + 1))[0])
    h = xxhash.xxh3_64()
    for piece in pieces(kv, block_ids, num_tokens, range(layer, layer + 1)):
        h.update(as_bytes(piece.cpu()))
    return h.intdigest()


def combine_digests(layer_digests: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(layer_digests)}Q", *layer_digests))


def kv_digest(kv: torch.Tensor, block_ids: list[int], num_tokens: int) -> int:
    """The digest of a sequence's KV: xxh3_64 over the per-layer xxh3_64s of the layer-ordered
    stream. Equal on both sides whatever their block ids and block sizes; per layer, so that a
    reader can check each layer right after it lands, while it is still in cache."""
    layers = range(kv.shape[0])
    if kv.device.type == "cpu":
        return combine_digests([digest_views(v) for v in layer_views(kv, block_ids, num_tokens, layers)])
    return combine_digests([layer_digest(kv, block_ids, num_tokens, layer) for layer in layers])


def gather(kv: torch.Tensor, block_ids: list[int], num_tokens: int, out: torch.Tensor) -> torch.Tensor:
    """Copies the layer-ordered stream into `out` (uint8, at least that many bytes); returns the
    used prefix."""
    offset = 0
    for piece in pieces(kv, block_ids, num_tokens):
        flat = piece.reshape(-1).view(torch.uint8)
        out[offset : offset + flat.numel()].copy_(flat)
        offset += flat.numel()
    return out[:offset]


class StreamWriter:
    """Writes a layer-ordered stream, arriving in order in chunks of any size, straight into the
    given blocks of kv (no staging copy)."""

    def __init__(self, kv: torch.Tensor, block_ids: list[int], num_tokens: int):
        self.targets = [p.view(-1).view(torch.uint8) for p in pieces(kv, block_ids, num_tokens)]  # views
        self.index = 0  # current target
        self.filled = 0  # bytes of it written
        self.offset = 0  # bytes of the stream written

    def write(self, data: torch.Tensor) -> None:
        """data: uint8, the next bytes of the stream."""
        pos = 0
        while pos < data.numel():
            if self.index >= len(self.targets):
                raise ValueError(f"kv stream longer than the blocks ({self.offset} bytes)")
            target = self.targets[self.index]
            n = min(target.numel() - self.filled, data.numel() - pos)
            target[self.filled : self.filled + n].copy_(data[pos : pos + n])
            pos += n
            self.filled += n
            self.offset += n
            if self.filled == target.numel():
                self.index, self.filled = self.index + 1, 0


def aligned_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src first, dst first, count) for each run of blocks consecutive on both sides."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int], num_tokens: int, digest: bool = True
) -> int | None:
    """Block-for-block copy between two caches of one layout. Without digest: one strided copy
    (all layers, K and V) per run of blocks consecutive on both sides. With it, layer by layer:
    the copy, then that layer's digest of what landed in dst while it is still in cache; returns
    the digest (compare with the source's kv_digest)."""
    runs = aligned_runs(src_ids, dst_ids)
    if not digest:
        for s, d, n in runs:
            dst[:, :, d : d + n].copy_(src[:, :, s : s + n])
        return None
    digests = []
    for layer in range(dst.shape[0]):
        for s, d, n in runs:
            dst[layer, :, d : d + n].copy_(src[layer, :, s : s + n])
        digests.append(layer_digest(dst, dst_ids, num_tokens, layer))
    return combine_digests(digests)
