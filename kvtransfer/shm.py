"""The `shm` transport: RDMA-style one-sided reads through shared memory, for a prefill and a decode
node on one host (partial reads where the generation counters check them; no layer-wise reads).

Verbs, as in RDMA/NIXL:
- register: the prefill node allocates its whole KV tensor in a /dev/shm region (pages touched
  once at start), so the KV it computes is already "registered memory";
- describe: a lease becomes a small descriptor (region, block ids, token count, digest);
- read: the decode node maps the region and copies the blocks itself, straight into its own KV
  blocks; the prefill side's CPU copies nothing;
- release: the decode node confirms over the KV plane (ReleaseKV) and the blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.config import option
from engine.kv_cache import KVCache
from kvtransfer.base import Capabilities, KVCorrupt, KVSender, KVTransferError, SenderContext, Transport, host_id
from kvtransfer.layout import KVLayout, copy_blocks
from kvtransfer.lease import Lease
from pdserve_api import nodes_pb2

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"
REGION_NAME = re.compile(r"pdserve-kv-\d+-[0-9a-f]{8}")  # nothing else under /dev/shm is ever opened
GEN_SUFFIX = "-gen"
# Generation checks rely on x86's ordering of stores (the prefill side bumps a generation before
# it reuses the block) and of loads (the reader copies, then reads the generation). Elsewhere the
# reader hashes what it copied instead.
GENERATION_CHECK = platform.machine().lower() in ("x86_64", "amd64")


class SharedKVRegion:
    """register: a named /dev/shm file holding a node's whole KV tensor."""

    def __init__(self, nbytes: int):
        sweep_stale_regions()
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = SHM_DIR / self.name
        _create_owner_only(self.path, nbytes)
        self.nbytes = nbytes
        self.tensor = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)
        self.tensor.zero_()  # touch every page now, not during a timed prefill
        self.generations: torch.Tensor | None = None

    def add_generations(self, num_blocks: int) -> None:
        """A shared int64 counter per block, bumped when the block is taken for new contents
        (before anything writes it): a reader that sees a block's generation unchanged before and
        after its copy read bytes that nobody overwrote, without hashing them. A lease's end moves
        nothing: its blocks may be shared (a cached prefix) and keep their bytes until reused."""
        self.gen_path = SHM_DIR / f"{self.name}{GEN_SUFFIX}"
        _create_owner_only(self.gen_path, num_blocks * 8)
        self.generations = torch.from_file(str(self.gen_path), shared=True, size=num_blocks, dtype=torch.int64)
        self._generations = self.generations.numpy()

    def reused(self, block_id: int) -> None:
        """Called (engine thread) as the block is taken for new contents, before they are written."""
        self._generations[block_id] += 1

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.generations is not None:
            self.gen_path.unlink(missing_ok=True)


def _create_owner_only(path: Path, nbytes: int) -> None:
    """A new file of nbytes that only this user can read: it holds every request's KV (0600
    from its creation, whatever the umask; never an existing file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def sweep_stale_regions() -> None:
    """Removes this user's regions whose owning process is gone (a node that crashed); another
    user's files are left alone."""
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            if path.stat().st_uid != os.getuid():
                continue
            pid = int(path.name[len(PREFIX) :].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        except (ValueError, OSError):  # not a pid, another user's process, a file gone meanwhile
            continue


@dataclass(frozen=True)
class ShmOptions:
    shm: bool = option(
        True,
        "keep the KV out of shared memory: decode nodes on this host read it as those on "
        "other hosts do (by default it lives in a /dev/shm region they read in place)",
        flag="--no-shm",
    )


class ShmSender(KVSender):
    """register: the prefill node's whole KV tensor lives in a /dev/shm region (a KV cache on a
    GPU does not: no region, nothing offered)."""

    def __init__(self, options: ShmOptions):
        self.enabled = options.shm
        self.region: SharedKVRegion | None = None

    def allocate_kv(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        if not self.enabled or device.type != "cpu":
            return None
        self.region = SharedKVRegion(nbytes)
        return self.region.tensor

    def attach(self, ctx: SenderContext) -> None:
        if self.region is not None:
            self.region.add_generations(ctx.kv_cache.num_blocks)
            ctx.block_manager.on_reuse = self.region.reused

    async def stop(self) -> None:
        if self.region is not None:
            self.region.close()

    def capabilities(self) -> Capabilities | None:
        return CAPABILITIES if self.region is not None else None

    def describe(self, lease: Lease, source: nodes_pb2.KVSource) -> None:
        """describe: the region, and each leased block's generation now (a layer-wise lease is
        still being written: not readable here)."""
        if self.region is not None and not source.layerwise:
            source.shm_region, source.region_bytes = self.region.name, self.region.nbytes
            source.block_generations.extend(self.region.generations[lease.block_ids].tolist())


class ShmReader:
    """read: maps the prefill node's region once and copies leased blocks out of it."""

    name = "shm"

    def __init__(self):
        self.host_id = host_id()
        self._regions: dict[str, torch.Tensor] = {}

    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def can_read(self, source: nodes_pb2.KVSource, layout: KVLayout) -> bool:
        return (
            not source.layerwise
            and source.host_id == self.host_id
            and bool(REGION_NAME.fullmatch(source.shm_region))
            and source.layout.block_size == layout.block_size
            and (SHM_DIR / source.shm_region).exists()
        )

    def _attach(self, source: nodes_pb2.KVSource, layout: KVLayout) -> torch.Tensor:
        if not REGION_NAME.fullmatch(source.shm_region):
            raise KVTransferError(f"not a pdserve KV region: {source.shm_region!r}")
        region = self._regions.get(source.shm_region)
        if region is None:
            path = SHM_DIR / source.shm_region
            if not path.exists():
                raise KVTransferError(f"shared-memory region {source.shm_region} is gone")
            block_bytes = layout.num_bytes(layout.block_size)
            if source.region_bytes != path.stat().st_size or source.region_bytes % block_bytes:
                raise KVTransferError(
                    f"region {source.shm_region}: size {source.region_bytes} does not match the file or the layout"
                )
            raw = torch.from_file(str(path), shared=True, size=source.region_bytes, dtype=torch.uint8)
            region = raw.view(getattr(torch, layout.dtype)).view(
                layout.num_layers,
                2,
                source.region_bytes // block_bytes,
                layout.block_size,
                layout.num_kv_heads,
                layout.head_dim,
            )
            self._regions[source.shm_region] = region
        return region

    def _generations(self, source: nodes_pb2.KVSource) -> torch.Tensor | None:
        path = SHM_DIR / f"{source.shm_region}{GEN_SUFFIX}"
        key = str(path)
        if key not in self._regions:
            if not (GENERATION_CHECK and source.block_generations and path.exists()):
                return None
            self._regions[key] = torch.from_file(key, shared=True, size=path.stat().st_size // 8, dtype=torch.int64)
        return self._regions[key]

    def can_skip(self, source: nodes_pb2.KVSource) -> bool:
        """Blocks can be left out where the generation counters check what is read (the whole-KV
        digest cannot check a part)."""
        return GENERATION_CHECK and len(source.block_generations) == len(source.block_ids) > 0

    async def read(
        self,
        source: nodes_pb2.KVSource,
        kv_cache: KVCache,
        layout: KVLayout,
        block_ids: list[int],
        skip_blocks: int = 0,
    ) -> None:
        layout.check(KVLayout.from_proto(source.layout), same_block_size=True)
        src = self._attach(source, layout)
        src_ids = list(source.block_ids)
        if len(src_ids) != -(-source.num_tokens // layout.block_size) or len(src_ids) > len(block_ids):
            raise KVTransferError(f"{len(src_ids)} source blocks do not hold {source.num_tokens} tokens")
        if max(src_ids, default=0) >= src.shape[2]:
            raise KVTransferError(f"block ids beyond the region {source.shm_region}")
        if not 0 <= skip_blocks < len(src_ids):
            raise KVTransferError(f"cannot leave out {skip_blocks} of {len(src_ids)} blocks")
        dst_ids = block_ids[skip_blocks : len(src_ids)]
        generations = self._generations(source)
        if skip_blocks and generations is None:
            raise KVTransferError(f"lease {source.lease_id}: a partial read needs the region's generation counters")
        if generations is None or len(source.block_generations) != len(src_ids):
            digest = await asyncio.to_thread(copy_blocks, src, src_ids, kv_cache.kv, dst_ids, source.num_tokens)
            if digest != source.digest:
                raise KVCorrupt(
                    f"KV digest mismatch after the shared-memory read (lease {source.lease_id}): "
                    "the blocks changed under the read"
                )
            return
        src_ids = src_ids[skip_blocks:]
        index = np.asarray(src_ids)
        expected = np.asarray(source.block_generations[skip_blocks:], dtype=np.int64)
        gens = generations.numpy()

        def checked_copy() -> None:  # one thread hop; the copies release the GIL
            if not np.array_equal(gens[index], expected):
                raise KVTransferError(f"kv_lease {source.lease_id} ended before the shared-memory read")
            copy_blocks(src, src_ids, kv_cache.kv, dst_ids, 0, False)
            if not np.array_equal(gens[index], expected):
                raise KVCorrupt(
                    f"the lease {source.lease_id} ended during the shared-memory read: "
                    "its blocks may have changed under it"
                )

        await asyncio.to_thread(checked_copy)

    async def close(self) -> None:
        self._regions.clear()


CAPABILITIES = Capabilities("shm", partial=GENERATION_CHECK, same_host=True)
TRANSPORT = Transport(
    "shm", sender=ShmSender, reader=lambda ctx: ShmReader(), sender_options=ShmOptions, sender_switch="shm"
)
