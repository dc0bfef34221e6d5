"""The raw TCP data plane (kvtransfer/tcp.py) on real sockets: exact bytes across block sizes and
connection counts, and every refusal before a byte is written."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time

import pytest
import torch
from test_kvtransfer import cache, filled, tokens

from engine.kv_progress import LayerProgress
from kvtransfer.base import KVCorrupt, KVTransferError
from kvtransfer.grpc_stream import GrpcStreamReader
from kvtransfer.layout import KVLayout, KVLayoutMismatch, kv_digest
from kvtransfer.lease import LeaseTable
from kvtransfer.security import Security
from kvtransfer.shm import ShmReader
from kvtransfer.tcp import TcpKVServer, TcpReader, layer_ranges
from pdserve_api import nodes_pb2


@pytest.fixture
def plane():
    """A prefill side: a filled KV cache, its lease table and its TCP server."""
    src = filled(16, 4)
    leases = LeaseTable(30)
    server = TcpKVServer(src, KVLayout.of(src, "fp"), leases)
    server.start()
    yield src, leases, server
    server.stop()


def lease_source(src, leases, server, block_ids, num_tokens, **overrides) -> nodes_pb2.KVSource:
    digest = kv_digest(src.kv, block_ids, num_tokens)
    lease = leases.add("r1", block_ids, num_tokens, digest)
    layout = KVLayout.of(src, "fp")
    fields = dict(
        lease_id=lease.lease_id,
        access_key=lease.access_key,
        tcp_address=server.address,
        layout=layout.to_proto(),
        block_ids=block_ids,
        num_tokens=num_tokens,
        digest=digest,
        num_bytes=layout.num_bytes(num_tokens),
    )
    return nodes_pb2.KVSource(**(fields | overrides))


def test_layer_ranges_cover_every_layer_once():
    assert layer_ranges(30, 4) == [(0, 7), (7, 15), (15, 22), (22, 30)]
    assert layer_ranges(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert layer_ranges(5, 1) == [(0, 5)]


@pytest.mark.parametrize("connections,staged", [(1, False), (2, False), (3, False), (2, True)])
def test_reads_exact_bytes_into_blocks_of_another_size(plane, connections, staged, monkeypatch):
    """staged: both ends move each layer through a host copy, as a KV cache on a GPU does."""
    import kvtransfer.tcp as tcp

    if staged:
        monkeypatch.setattr(tcp, "on_host", lambda kv: False)
    src, leases, server = plane
    src_ids, n = [7, 2, 3, 11], 14
    source = lease_source(src, leases, server, src_ids, n)
    dst, dst_ids = cache(8, 8), [5, 1]
    asyncio.run(TcpReader(connections=connections).read(source, dst, KVLayout.of(dst, "fp"), dst_ids))
    assert torch.equal(tokens(dst, dst_ids, n), tokens(src, src_ids, n))
    untouched = [b for b in range(8) if b not in dst_ids]
    assert dst.kv[:, :, untouched].abs().sum() == 0


def test_reads_reuse_a_connection_and_survive_its_end(plane, monkeypatch):
    """One connection carries read after read (no connect per read); a pooled connection the server
    has since closed (idle too long) is replaced without failing the read; close() and stop() end them."""
    import kvtransfer.tcp as tcp

    src, leases, server = plane
    reader, dst = TcpReader(), cache(8, 8)

    async def reads():
        for i in range(3):
            n = 5 + i
            source = lease_source(src, leases, server, [3, 4], n)
            await reader.read(source, dst, KVLayout.of(dst, "fp"), [0, 1])
            assert torch.equal(tokens(dst, [0, 1], n), tokens(src, [3, 4], n))
            assert len(server._open) == 1 and len(reader._idle[server.address]) == 1
        monkeypatch.setattr(tcp, "IDLE_S", 0.1)
        await reader.read(lease_source(src, leases, server, [3, 4], 8), dst, KVLayout.of(dst, "fp"), [0, 1])
        pooled = reader._idle[server.address][0][0]
        await asyncio.sleep(0.5)  # the server's handler ends that connection
        assert len(server._open) == 0
        await reader.read(lease_source(src, leases, server, [3, 4], 8), dst, KVLayout.of(dst, "fp"), [0, 1])
        assert reader._idle[server.address][0][0] is not pooled
        await reader.close()

    asyncio.run(reads())
    assert reader._idle == {}
    deadline = time.monotonic() + 5
    while server._open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server._open


def test_stopping_the_server_ends_pooled_connections(plane):
    src, leases, server = plane
    reader, dst = TcpReader(), cache(8, 8)
    asyncio.run(reader.read(lease_source(src, leases, server, [3, 4], 8), dst, KVLayout.of(dst, "fp"), [0, 1]))
    assert len(server._open) == 1  # its handler thread waits for the next read
    server.stop()
    deadline = time.monotonic() + 5
    while server._open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server._open
    with pytest.raises(KVTransferError, match="failed"):  # the pooled connection is dead, and so is the port
        asyncio.run(reader.read(lease_source(src, leases, server, [3, 4], 8), dst, KVLayout.of(dst, "fp"), [0, 1]))


def test_a_wrong_access_key_reads_nothing(plane):
    src, leases, server = plane
    source = lease_source(src, leases, server, [1, 2], 8, access_key="0" * 32)
    dst = cache(4, 4)
    with pytest.raises(KVTransferError, match="NOT_FOUND"):
        asyncio.run(TcpReader().read(source, dst, KVLayout.of(dst, "fp"), [0, 1]))
    assert dst.kv.abs().sum() == 0


def test_a_layout_mismatch_is_refused_before_a_byte_is_written(plane):
    src, leases, server = plane
    source = lease_source(src, leases, server, [1, 2], 8)
    dst = cache(4, 4, dtype=torch.float32)
    with pytest.raises(KVLayoutMismatch, match="dtype"):
        asyncio.run(TcpReader().read(source, dst, KVLayout.of(dst, "fp"), [0, 1]))
    # The server checks too: a receiver that lies about its own layout in the descriptor.
    with pytest.raises(KVLayoutMismatch, match="model_fingerprint"):
        asyncio.run(TcpReader().read(source, dst, KVLayout.of(dst, "other"), [0, 1]))
    assert dst.kv.abs().sum() == 0


def test_blocks_changed_under_the_read_are_caught(plane):
    src, leases, server = plane
    source = lease_source(src, leases, server, [1, 2], 8)
    src.kv[0, 0, 1].add_(1.0)  # after the digest was taken
    dst = cache(4, 4)
    with pytest.raises(KVCorrupt):
        asyncio.run(TcpReader().read(source, dst, KVLayout.of(dst, "fp"), [0, 1]))


def test_the_internal_token_is_required_when_configured():
    src = filled(16, 4)
    leases = LeaseTable(30)
    server = TcpKVServer(src, KVLayout.of(src, "fp"), leases, security=Security(token="s3cret"))
    server.start()
    try:
        source = lease_source(src, leases, server, [1, 2], 8)
        dst = cache(4, 4)
        with pytest.raises(KVTransferError, match="UNAUTHENTICATED"):
            asyncio.run(TcpReader().read(source, dst, KVLayout.of(dst, "fp"), [0, 1]))
        asyncio.run(TcpReader(Security(token="s3cret")).read(source, dst, KVLayout.of(dst, "fp"), [0, 1]))
        assert torch.equal(tokens(dst, [0, 1], 8), tokens(src, [1, 2], 8))
    finally:
        server.stop()


def test_a_peer_that_stalls_or_vanishes_fails_the_read_without_hanging():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    src = filled(16, 4)
    source = nodes_pb2.KVSource(
        lease_id="x",
        access_key="k",
        tcp_address=f"127.0.0.1:{listener.getsockname()[1]}",
        layout=KVLayout.of(src, "fp").to_proto(),
        block_ids=[1],
        num_tokens=4,
        digest=1,
    )
    dst = cache(4, 4)
    try:
        with pytest.raises(KVTransferError, match="timed out"):  # accepts, never answers
            asyncio.run(TcpReader(timeout_s=0.5).read(source, dst, KVLayout.of(dst, "fp"), [0]))
    finally:
        listener.close()
    with pytest.raises(KVTransferError, match="refused|failed"):  # nobody listens any more
        asyncio.run(TcpReader(timeout_s=0.5).read(source, dst, KVLayout.of(dst, "fp"), [0]))


def test_garbage_on_the_port_does_not_hurt_the_server(plane):
    src, leases, server = plane
    host, port = server.address.rsplit(":", 1)
    for junk in (b"", b"GET / HTTP/1.1\r\n\r\n", b"PDK1" + (10**9).to_bytes(4, "little"), b"PDK1\x05\x00\x00\x00{bad"):
        with socket.create_connection((host, int(port)), timeout=2) as s:
            try:
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                assert s.recv(100) == b""  # closed without a word
            except (ConnectionResetError, BrokenPipeError):  # or reset, with our junk unread
                pass
            except OSError as e:  # or already gone before our shutdown (a race the server may win)
                assert e.errno == errno.ENOTCONN, e
    source = lease_source(src, leases, server, [3], 4)
    dst = cache(4, 4)
    asyncio.run(TcpReader().read(source, dst, KVLayout.of(dst, "fp"), [2]))
    assert torch.equal(tokens(dst, [2], 4), tokens(src, [3], 4))


# ---- layer-wise streaming ------------------------------------------------------------------
def layerwise_source(src, leases, server, block_ids, num_tokens):
    progress = LayerProgress(src.kv.shape[0])
    lease = leases.add("r1", block_ids, num_tokens, 0, progress)
    layout = KVLayout.of(src, "fp")
    return progress, nodes_pb2.KVSource(
        lease_id=lease.lease_id,
        access_key=lease.access_key,
        tcp_address=server.address,
        layout=layout.to_proto(),
        block_ids=block_ids,
        num_tokens=num_tokens,
        num_bytes=layout.num_bytes(num_tokens),
        layerwise=True,
    )


def layer_bytes(c, block_ids, num_tokens, layer):
    return tokens(c, block_ids, num_tokens)[layer]


@pytest.mark.parametrize("connections", [1, 2])
def test_layerwise_reads_each_layer_as_it_is_written_then_the_trailer(plane, connections):
    src, leases, server = plane
    src_ids, dst_ids, n = [7, 2, 3], [5, 1], 10
    progress, source = layerwise_source(src, leases, server, src_ids, n)
    dst = cache(8, 8)

    async def scenario():
        read = asyncio.ensure_future(
            TcpReader(connections=connections).read(source, dst, KVLayout.of(dst, "fp"), dst_ids)
        )
        for layer in range(src.kv.shape[0]):
            progress.layer_done(layer)
            # the reader has this layer while the later ones are still "computing"
            for _ in range(200):
                if torch.equal(layer_bytes(dst, dst_ids, n, layer), layer_bytes(src, src_ids, n, layer)):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"layer {layer} did not arrive before the next was written")
            if layer + 1 < src.kv.shape[0]:
                assert layer_bytes(dst, dst_ids, n, layer + 1).abs().sum() == 0
        await asyncio.sleep(0.05)
        assert not read.done()  # waits for the first token
        progress.finish({"finished": False, "token_id": 42, "text_chars": 3})
        return await read

    assert asyncio.run(scenario()) == {"finished": False, "token_id": 42, "text_chars": 3}
    assert torch.equal(tokens(dst, dst_ids, n), tokens(src, src_ids, n))


def test_a_layerwise_prefill_that_fails_fails_the_read_at_once(plane):
    src, leases, server = plane
    progress, source = layerwise_source(src, leases, server, [1, 2], 8)
    dst = cache(4, 4)

    async def scenario():
        read = asyncio.ensure_future(TcpReader(timeout_s=30).read(source, dst, KVLayout.of(dst, "fp"), [0, 1]))
        progress.layer_done(0)
        await asyncio.sleep(0.1)
        started = time.monotonic()
        progress.fail("aborted")
        with pytest.raises(KVTransferError, match="layer-wise"):
            await read
        assert time.monotonic() - started < 5

    asyncio.run(scenario())


def test_a_corrupt_layer_is_caught_as_it_lands(plane, monkeypatch):
    src, leases, server = plane
    progress, source = layerwise_source(src, leases, server, [1, 2], 8)
    import kvtransfer.tcp as tcp

    real, calls = tcp.digest_views, []

    def sender_flips_layer_1(views):  # the server's handler threads only: its second digest is layer 1's
        if "process_request" not in threading.current_thread().name:
            return real(views)
        calls.append(1)
        return real(views) ^ (len(calls) == 2)

    monkeypatch.setattr(tcp, "digest_views", sender_flips_layer_1)
    for layer in range(src.kv.shape[0]):
        progress.layer_done(layer)
    progress.finish({"finished": False, "token_id": 1, "text_chars": 0})
    dst = cache(4, 4)
    with pytest.raises(KVCorrupt, match="layer 1"):
        asyncio.run(TcpReader(timeout_s=5).read(source, dst, KVLayout.of(dst, "fp"), [0, 1]))


def test_only_tcp_reads_a_layerwise_source(plane):
    src, leases, server = plane
    _, source = layerwise_source(src, leases, server, [1, 2], 8)
    layout = KVLayout.of(src, "fp")
    assert not GrpcStreamReader().can_read(source, layout)
    assert not ShmReader().can_read(source, layout)
    assert TcpReader().can_read(source, layout)


def test_a_lease_does_not_expire_under_a_read_in_flight(plane):
    """A layer-wise read stalls past the lease's TTL (its prefill ended, a layer still to come):
    the read pins the lease, so the expiry sweep leaves it (and its blocks) until the read ends; it
    used to expire it mid-read, and its blocks could be reused while their bytes were still sent."""
    src, leases, server = plane
    leases.ttl_s = 0.2
    src_ids, dst_ids, n = [7, 2, 3], [5, 1], 10
    progress, source = layerwise_source(src, leases, server, src_ids, n)
    lease, dst = leases.get(source.lease_id), cache(8, 8)

    async def scenario():
        read = asyncio.ensure_future(TcpReader().read(source, dst, KVLayout.of(dst, "fp"), dst_ids))
        progress.layer_done(0)
        for _ in range(1000):  # the read is in flight: layer 0 has arrived
            if torch.equal(layer_bytes(dst, dst_ids, n, 0), layer_bytes(src, src_ids, n, 0)):
                break
            await asyncio.sleep(0.01)
        leases.start_clock(lease)
        await asyncio.sleep(0.5)  # past the TTL, the read still waiting for layer 1
        assert leases.pop_expired() == [] and not read.done()
        assert leases.get(lease.lease_id) is None  # an expired lease takes no new read
        for layer in range(1, src.kv.shape[0]):
            progress.layer_done(layer)
        progress.finish({"finished": False, "token_id": 42, "text_chars": 3})
        await read
        expired = []
        for _ in range(3000):  # the server's thread unpins after its last send: maybe just after the reader has it
            if expired := leases.pop_expired():
                break
            await asyncio.sleep(0.01)
        assert expired == [lease]  # unpinned: it expires now

    asyncio.run(scenario())
    assert torch.equal(tokens(dst, dst_ids, n), tokens(src, src_ids, n))
