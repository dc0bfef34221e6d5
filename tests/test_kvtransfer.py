"""kvtransfer's pieces driven directly: layouts, the byte stream, leases, the status ladder, and
corruption caught before any decode."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import time

import fake_transport
import pytest
import torch
import xxhash

from engine.kv_cache import KVCache
from kvtransfer import transports
from kvtransfer.base import KVCorrupt, KVTransferError, TransferStatus, host_id
from kvtransfer.grpc_stream import GrpcStreamReader
from kvtransfer.layout import KVLayout, KVLayoutMismatch, StreamWriter, block_runs, copy_blocks, gather, kv_digest
from kvtransfer.lease import LeaseTable
from kvtransfer.receiver import KVReceiver
from kvtransfer.shm import GENERATION_CHECK, SHM_DIR, SharedKVRegion, ShmReader, sweep_stale_regions
from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc
from serving.grpc_server import GrpcServer

LAYERS, HEADS, DIM = 3, 2, 8


def cache(num_blocks: int, block_size: int, dtype=torch.bfloat16, buffer=None) -> KVCache:
    return KVCache(LAYERS, num_blocks, block_size, HEADS, DIM, dtype, torch.device("cpu"), buffer)


def filled(num_blocks=16, block_size=4) -> KVCache:
    c = cache(num_blocks, block_size)
    c.kv.copy_(torch.randn(c.kv.shape))
    return c


def source(c: KVCache, block_ids: list[int], num_tokens: int, **kw) -> nodes_pb2.KVSource:
    layout = KVLayout.of(c, "fp")
    return nodes_pb2.KVSource(
        lease_id="L1",
        layout=layout.to_proto(),
        block_ids=block_ids,
        num_tokens=num_tokens,
        digest=kv_digest(c.kv, block_ids, num_tokens),
        num_bytes=layout.num_bytes(num_tokens),
        **kw,
    )


def tokens(c: KVCache, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    return c.export_kv(block_ids, num_tokens)  # [layers, 2, T, heads, dim]


def test_block_runs():
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert block_runs([]) == []


def test_stream_roundtrip_between_block_sizes():
    src, dst = filled(16, 4), cache(8, 8)
    src_ids, dst_ids, n = [7, 2, 3, 11], [5, 1], 14
    data = gather(src.kv, src_ids, n, torch.empty(10_000, dtype=torch.uint8))
    assert data.numel() == KVLayout.of(src, "x").num_bytes(n)
    writer = StreamWriter(dst.kv, dst_ids, n)
    for start in range(0, data.numel(), 1000):  # chunks that straddle pieces
        writer.write(data[start : start + 1000])
    assert writer.offset == data.numel()
    assert torch.equal(tokens(dst, dst_ids, n), tokens(src, src_ids, n))
    assert kv_digest(dst.kv, dst_ids, n) == kv_digest(src.kv, src_ids, n)
    with pytest.raises(ValueError, match="longer than the blocks"):
        writer.write(data[:1])


def test_copy_blocks_coalesces_runs_and_copies_exactly():
    src, dst = filled(16, 4), cache(16, 4)
    src_ids, dst_ids = [1, 2, 3, 8, 9], [4, 5, 6, 7, 0]
    digest = copy_blocks(src.kv, src_ids, dst.kv, dst_ids, 18)
    assert digest == kv_digest(src.kv, src_ids, 18)
    assert torch.equal(tokens(dst, dst_ids, 20), tokens(src, src_ids, 20))
    untouched = [b for b in range(16) if b not in dst_ids]
    assert dst.kv[:, :, untouched].abs().sum() == 0


def test_layout_check_names_each_difference():
    a = KVLayout(30, 3, 64, "bfloat16", 16, "abc")
    a.check(KVLayout(30, 3, 64, "bfloat16", 32, "abc"))  # block size may differ by default
    with pytest.raises(KVLayoutMismatch, match="block_size: decode 16, prefill 32"):
        a.check(KVLayout(30, 3, 64, "bfloat16", 32, "abc"), same_block_size=True)
    with pytest.raises(KVLayoutMismatch, match="num_layers: decode 30, prefill 24; head_dim: decode 64, prefill 128"):
        a.check(KVLayout(24, 3, 128, "bfloat16", 16, "abc"))


def test_layout_check_names_windows_that_differ_and_the_wire_keeps_them():
    gemma = KVLayout(26, 4, 256, "bfloat16", 16, "abc", attention="window 4096 on layers 0,2,4")
    gemma.check(KVLayout.from_proto(gemma.to_proto()))
    with pytest.raises(KVLayoutMismatch, match="attention: decode 'window 4096 on layers 0,2,4', prefill 'full'"):
        gemma.check(KVLayout(26, 4, 256, "bfloat16", 16, "abc"))
    older = gemma.to_proto()
    older.ClearField("attention")  # a node from before the field: not compared
    gemma.check(KVLayout.from_proto(older))


def test_deterministic_kv_moves_only_between_equal_numerics_and_block_sizes():
    det = KVLayout(30, 3, 64, "bfloat16", 16, "abc", "deterministic (amx; ...)")
    det.check(KVLayout(30, 3, 64, "bfloat16", 16, "abc", "deterministic (amx; ...)"))
    with pytest.raises(KVLayoutMismatch, match=r"numerics: decode 'deterministic \(amx; ...\)', prefill 'default'"):
        det.check(KVLayout(30, 3, 64, "bfloat16", 16, "abc"))
    with pytest.raises(KVLayoutMismatch, match="numerics: .*avx2"):
        det.check(KVLayout(30, 3, 64, "bfloat16", 16, "abc", "deterministic (avx2; ...)"))
    with pytest.raises(KVLayoutMismatch, match="block_size: decode 16, prefill 32"):  # attention sums per block
        det.check(KVLayout(30, 3, 64, "bfloat16", 32, "abc", "deterministic (amx; ...)"))
    # the wire: an older node's layout has no numerics (proto "": the default); tcp's JSON leaves it
    # out where it is the default, which an older node would refuse as an unknown field
    assert KVLayout.from_proto(KVLayout(30, 3, 64, "bfloat16", 16, "abc").to_proto()).numerics == "default"
    assert KVLayout.from_proto(det.to_proto()) == det
    from kvtransfer.tcp import _layout_dict

    assert "numerics" not in _layout_dict(KVLayout(30, 3, 64, "bfloat16", 16, "abc"))
    assert KVLayout(**_layout_dict(det)) == det


def test_lease_table_expiry():
    t = LeaseTable(ttl_s=0.05)
    lease = t.add("r1", [1, 2], 7, 123)
    assert t.get(lease.lease_id) is lease
    time.sleep(0.08)
    assert t.get(lease.lease_id) is None  # expired leases are not served
    assert t.pop_expired() == [lease] and len(t) == 0
    with pytest.raises(ValueError, match="ttl"):
        LeaseTable(0)


@pytest.fixture
def fake():
    """The test-only transport (tests/fake_transport.py), registered in one line while a test runs."""
    transports.register(fake_transport.TRANSPORT)
    yield fake_transport
    del transports.TRANSPORTS[fake_transport.NAME]


def test_fake_transport_status_ladder_and_corruption(fake):
    async def scenario():
        src = filled()
        fake.REGISTRY["p0"] = src
        dst = cache(16, 4)
        receiver = KVReceiver(dst, KVLayout.of(dst, "fp"), "fake")
        src_ids, dst_ids = [3, 4, 5], [0, 9, 10]
        at_p0 = {"transport_params": {"fake": b"p0"}}
        transfer = receiver.start(source(src, src_ids, 10, **at_p0), dst_ids)
        assert transfer.status is TransferStatus.WAITING
        await transfer.wait()
        assert transfer.status is TransferStatus.SUCCESS and transfer.transport == "fake"
        assert torch.equal(tokens(dst, dst_ids, 10), tokens(src, src_ids, 10))
        # The source changes after its digest was taken: the read is refused, never used.
        desc = source(src, src_ids, 10, **at_p0)
        src.kv[0, 0, 4].add_(1)
        transfer = receiver.start(desc, dst_ids)
        with pytest.raises(KVCorrupt):
            await transfer.wait()
        assert transfer.status is TransferStatus.FAILED
        # Another layout is refused before any byte moves.
        other = cache(16, 4, dtype=torch.float32)
        before = other.kv.clone()
        bad = KVReceiver(other, KVLayout.of(other, "fp"), "fake").start(source(src, src_ids, 10, **at_p0), dst_ids)
        with pytest.raises(KVLayoutMismatch, match="dtype"):
            await bad.wait()
        assert torch.equal(other.kv, before)
        del fake.REGISTRY["p0"]

    asyncio.run(scenario())


def test_a_new_transport_is_one_file_and_one_line(fake, tiny_llama):
    """tests/fake_transport.py, registered by the fixture's one line, carries every request between
    real nodes: the prefill node serves it, the decode node reads with it, the router names it in
    the timeline; greedy tokens equal the engine alone (fp32)."""
    from cluster import local_cluster, wait_for_no_blocks
    from conftest import make_engine, run_to_completion

    from engine import SamplingParams
    from router.client import AsyncClient

    engine = make_engine(tiny_llama)
    engine.add_request("x", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=6, temperature=0))
    want = run_to_completion(engine)["x"].token_ids

    async def scenario():
        async with local_cluster(tiny_llama, kv_transport="fake") as (router, prefills, decodes):
            load = await decodes[0].GetLoad(common_pb2.LoadRequest(), None)
            assert [t.name for t in load.kv_transports] == ["fake"]  # what it reads with
            async with AsyncClient(router.address) as client:
                out = await client.generate([5, 6, 7, 8, 9, 10], max_tokens=6, temperature=0)
            await wait_for_no_blocks(prefills + decodes)
            return out

    out = asyncio.run(scenario())
    assert out.token_ids == want and out.timings["kv_transport"] == "fake"


def test_shm_one_sided_read():
    async def scenario():
        layout_bytes = KVLayout.of(cache(1, 4), "fp").num_bytes(4) * 16
        region = SharedKVRegion(layout_bytes)
        try:
            src = cache(16, 4, buffer=region.tensor)
            src.kv.copy_(torch.randn(src.kv.shape))
            dst = cache(16, 4)
            desc = source(src, [6, 7, 1], 11, host_id=host_id(), shm_region=region.name, region_bytes=region.nbytes)
            reader = ShmReader()
            assert reader.can_read(desc, KVLayout.of(dst, "fp"))
            await reader.read(desc, dst, KVLayout.of(dst, "fp"), [2, 3, 4])
            assert torch.equal(tokens(dst, [2, 3, 4], 11), tokens(src, [6, 7, 1], 11))
            assert not reader.can_read(
                nodes_pb2.KVSource(host_id="elsewhere", shm_region=region.name, layout=desc.layout),
                KVLayout.of(dst, "fp"),
            )
        finally:
            region.close()

    asyncio.run(scenario())


def test_shm_regions_are_owner_only():
    """A region holds every request's KV: 0600 from its creation (they were 0644, readable by any
    local user past mTLS and lease keys), whatever the umask."""
    old = os.umask(0o022)
    try:
        region = SharedKVRegion(1 << 16)
        region.add_generations(16)
    finally:
        os.umask(old)
    try:
        for path in (region.path, region.gen_path):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    finally:
        region.close()


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's file takes root")
def test_the_sweep_leaves_another_users_regions_alone():
    """A stale region (its process gone) of another user is not this node's to remove: the sweep
    skips it (as a non-root user, removing it failed and took the node's start down)."""
    dead = _dead_pid()
    theirs = SHM_DIR / f"pdserve-kv-{dead}-0badc0de"
    mine = SHM_DIR / f"pdserve-kv-{dead}-0000c0de"
    for path in (theirs, mine):
        path.write_bytes(b"")
    os.chown(theirs, 65534, 65534)
    try:
        sweep_stale_regions()
        assert theirs.exists() and not mine.exists()
    finally:
        theirs.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been waited for)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.skipif(not GENERATION_CHECK, reason="generation checks are used on x86 only")
def test_shm_read_checks_block_generations_instead_of_hashing():
    async def scenario():
        layout_bytes = KVLayout.of(cache(1, 4), "fp").num_bytes(4) * 16
        region = SharedKVRegion(layout_bytes)
        region.add_generations(16)
        try:
            src = cache(16, 4, buffer=region.tensor)
            src.kv.copy_(torch.randn(src.kv.shape))
            dst = cache(16, 4)
            region.reused(6)  # block 6 held other contents before: it is at generation 1
            gens = region.generations[[6, 7, 1]].tolist()
            assert gens == [1, 0, 0]
            # A wrong digest on purpose: with generations the reader hashes nothing.
            desc = source(
                src,
                [6, 7, 1],
                11,
                host_id=host_id(),
                shm_region=region.name,
                region_bytes=region.nbytes,
                block_generations=gens,
            )
            desc.digest ^= 1
            reader = ShmReader()
            await reader.read(desc, dst, KVLayout.of(dst, "fp"), [2, 3, 4])
            assert torch.equal(tokens(dst, [2, 3, 4], 11), tokens(src, [6, 7, 1], 11))
            region.reused(7)  # the lease ended and block 7 was taken for new contents: a read now is refused
            with pytest.raises(KVTransferError, match="ended before"):
                await reader.read(desc, dst, KVLayout.of(dst, "fp"), [2, 3, 4])
        finally:
            region.close()
        assert not list(SHM_DIR.glob(f"{region.name}*"))

    asyncio.run(scenario())


class CorruptingKVPlane(nodes_pb2_grpc.KVPlaneServicer):
    """Streams a valid header, then a chunk whose bytes do not match its digest."""

    def __init__(self, layout: KVLayout, num_tokens: int):
        self.layout, self.num_tokens = layout, num_tokens

    async def PullKV(self, request, context):
        nbytes = self.layout.num_bytes(self.num_tokens)
        data = bytes(nbytes)
        header = nodes_pb2.KVHeader(layout=self.layout.to_proto(), num_tokens=self.num_tokens, num_bytes=nbytes)
        yield nodes_pb2.KVChunk(header=header, offset=0, data=data, digest=xxhash.xxh3_64_intdigest(b"other"))


def test_grpc_stream_refuses_a_corrupt_chunk():
    async def scenario():
        dst = cache(16, 4)
        layout = KVLayout.of(dst, "fp")
        server = GrpcServer()
        server.add(
            nodes_pb2_grpc.add_KVPlaneServicer_to_server,
            CorruptingKVPlane(layout, 6),
            nodes_pb2.DESCRIPTOR.services_by_name["KVPlane"],
        )
        await server.start()
        reader = GrpcStreamReader()
        try:
            desc = nodes_pb2.KVSource(
                lease_id="x",
                kv_address=server.address,
                layout=layout.to_proto(),
                num_tokens=6,
                num_bytes=layout.num_bytes(6),
            )
            with pytest.raises(KVCorrupt, match="offset 0 failed its digest"):
                await reader.read(desc, dst, layout, [0, 1])
            assert dst.kv.abs().sum() == 0  # nothing was written into the blocks
        finally:
            await reader.close()
            await server.stop(0)

    asyncio.run(scenario())


def test_grpc_stream_reports_a_missing_lease(tiny_llama):
    from cluster import local_cluster

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            dst = decodes[0].llm.kv_cache
            reader = GrpcStreamReader()
            desc = nodes_pb2.KVSource(
                lease_id="nope",
                kv_address=prefills[0].address,
                layout=decodes[0].layout.to_proto(),
                num_tokens=3,
                num_bytes=decodes[0].layout.num_bytes(3),
            )
            with pytest.raises(Exception, match="NOT_FOUND: no kv_lease 'nope'"):
                await reader.read(desc, dst, decodes[0].layout, [0])
            await reader.close()

    asyncio.run(scenario())


def test_buffer_pool_reuses_the_smallest_fitting_buffer():
    from kvtransfer.buffers import BufferPool

    pool = BufferPool()
    a, b = pool.acquire(100), pool.acquire(1000)
    pool.release(a)
    pool.release(b)
    assert pool.acquire(500) is b  # not a (too small); no tensor comparisons on the way
    assert pool.acquire(50) is a
    assert pool.acquire(10).numel() == 10  # none free: a new one


def test_the_transport_docs_list_the_registered_transports():
    """docs/kv_transfer.md's table names exactly the registered transports, in auto's order, each
    with the file it lives in: adding one without its row (or moving one) fails here."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "kv_transfer.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `(kvtransfer/\w+\.py)` \|", doc, re.M)
    assert rows == [(name, t.sender.__module__.replace(".", "/") + ".py") for name, t in transports.TRANSPORTS.items()]


def test_the_transport_chosen_from_what_both_nodes_report():
    """kvtransfer.transports.choose, which the router asks (it names no transport itself): the
    decode node's first reader (its order) that the prefill node serves and that can reach it."""
    from kvtransfer.base import Capabilities as C

    shm, tcp, grpc = C("shm", partial=True, same_host=True), C("tcp", layerwise=True, partial=True), C("grpc")
    every = [shm, tcp, grpc]
    assert transports.choose(every, every, same_host=True) == shm  # one host: the one-sided read
    assert transports.choose(every, every, same_host=False) == tcp  # across hosts: the TCP plane
    assert transports.choose(every, every, same_host=True, layerwise=True) == tcp  # streaming wanted
    assert transports.choose([tcp, grpc], every, same_host=True) == tcp  # a prefill node with --no-shm
    gpu_tcp = C("tcp", partial=True)  # a KV cache on a GPU: tcp reads it, but cannot stream its layers
    assert transports.choose([gpu_tcp, grpc], every, same_host=False) == gpu_tcp
    assert transports.choose([gpu_tcp, grpc], every, same_host=False, layerwise=True) is None
    assert transports.choose(every, [grpc], same_host=False) == grpc  # a decode node told --kv-transport grpc
    assert transports.choose([grpc], [tcp], same_host=False) is None
