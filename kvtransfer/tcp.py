"""The `tcp` transport, the raw TCP data plane (across hosts): one-sided reads of leased KV blocks over
plain sockets, layer-wise (a KV cache in host memory) and partial.

gRPC stays the control plane (Prefill returns the KVSource descriptor, ReleaseKV ends the lease);
the bytes move here, without per-chunk Python objects or staging copies:
- sender (the prefill node's TcpKVServer): for each piece of the layer-ordered stream, one
  `sendall` of a memoryview straight over the engine's KV tensor;
- receiver (the decode node's TcpReader): `recv_into` straight into its own reserved blocks, over
  N parallel connections, each reading one contiguous range of layers.
A KV cache on a GPU goes through a host copy of one layer at a time on either end (host_layers).

Wire format of one read (all integers little-endian); a connection carries one read after another
(readers keep a few idle connections per prefill node, so a read costs no connect or handshake):
    request : b"PDK1" | u32 length | JSON {lease_id, access_key, token, layout, layers: [a, b],
              first_block}
    reply   : u32 length | JSON {ok, num_tokens, num_bytes, layerwise} or {ok: false, code, error}
    then    : num_bytes raw bytes, layers a..b-1 of the layer-ordered stream of the lease's blocks
              from first_block on (0: all; more: the reader's prefix cache holds the first ones),
              each layer followed by its u64 xxh3 digest when first_block > 0
Layer-wise (a lease whose prefill still computes, `layerwise` true): each layer is sent as soon as
the forward has written it, followed by its u64 xxh3 digest; the connection that ends at the last
layer then gets the trailer, u32 length | JSON {finished, token_id, text_chars} or {finished,
finish_reason}: the first token, straight from the prefill node. A prefill that fails or is
cancelled closes the connection.
Security as on the gRPC plane: TLS (mutual when configured) wraps the socket, and the internal
token is checked when one is configured; besides, every lease has its own random access key
(as an RDMA rkey), known only to whoever got the KVSource, so a peer that can merely reach the
port reads nothing. Integrity: the layout and model fingerprint are checked on both ends before a
byte moves, and the receiver hashes each layer as it lands (still in cache) and checks the combined digest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import socket
import socketserver
import ssl
import struct
import threading
import time
from dataclasses import dataclass

import torch

from engine.config import option
from engine.kv_cache import KVCache
from engine.kv_progress import PrefillFailed
from kvtransfer.base import Capabilities, KVCorrupt, KVSender, KVTransferError, SenderContext, Transport
from kvtransfer.layout import KVLayout, KVLayoutMismatch, as_bytes, combine_digests, digest_views, layer_views, pieces
from kvtransfer.lease import Lease, LeaseTable
from kvtransfer.security import NONE, Security
from pdserve_api import nodes_pb2

log = logging.getLogger(__name__)
MAGIC = b"PDK1"
MAX_HEADER = 64 << 10
SOCKET_BUFFER = 8 << 20  # bytes of kernel buffer per socket: keeps a fast link busy
LAYER_WAIT_S = 120.0  # layer-wise: the longest wait for one layer (at most one forward) or the first token
IDLE_S = 60.0  # the server closes a connection that asks nothing for this long
POOL_IDLE_S = 30.0  # readers reuse a connection idle for less (well inside IDLE_S)
DEFAULT_CONNECTIONS = 1  # measured best on 2 cores (loopback 0.90 of raw TCP vs 0.75 with 2); more for fast links


@dataclass(frozen=True)
class TcpSenderOptions:
    kv_tcp_port: int = option(0, "the raw TCP KV data plane's port (0: any free port)", per_process=True)


@dataclass(frozen=True)
class TcpReaderOptions:
    kv_tcp_connections: int = option(
        DEFAULT_CONNECTIONS, "parallel connections per KV read on the tcp transport (each reads a range of layers)"
    )

    def __post_init__(self):
        if self.kv_tcp_connections < 1:
            raise ValueError(f"kv_tcp_connections must be >= 1, got {self.kv_tcp_connections}")


# ---- framing ------------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        view = view[n:]


def _recv_json(sock: socket.socket) -> dict:
    size = bytearray(4)
    _recv_exact(sock, memoryview(size))
    (n,) = struct.unpack("<I", size)
    if n > MAX_HEADER:
        raise ConnectionError(f"header of {n} bytes")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body))
    return json.loads(body)


def _send_json(sock: socket.socket, obj: dict, prefix: bytes = b"") -> None:
    body = json.dumps(obj).encode()
    sock.sendall(prefix + struct.pack("<I", len(body)) + body)


def _layout_dict(layout: KVLayout) -> dict:
    """(numerics only where it is not the default: a node of an earlier version refuses a field it
    does not know)"""
    return {k: v for k, v in dataclasses.asdict(layout).items() if k != "numerics" or v != "default"}


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


def host_layers(kv: torch.Tensor, block_ids: list[int], num_tokens: int, layers: range):
    """Per layer: the byte views a socket sends from or receives into, and the (host, device)
    staging pairs, empty for a kv in host memory (the views are the cache itself). A kv on a GPU
    moves through a host copy of one layer at a time (copied before the send, after the receive)."""
    if on_host(kv):
        for views in layer_views(kv, block_ids, num_tokens, layers):
            yield views, []
        return
    for layer in layers:
        device = list(pieces(kv, block_ids, num_tokens, range(layer, layer + 1)))
        host = [torch.empty(p.shape, dtype=p.dtype) for p in device]
        yield [as_bytes(h) for h in host], list(zip(host, device))


def on_host(kv: torch.Tensor) -> bool:
    return kv.device.type == "cpu"


# ---- the prefill side ---------------------------------------------------------------------
class TcpSender(KVSender):
    """The node's TcpKVServer; streams layers where the KV cache is in host memory."""

    def __init__(self, options: TcpSenderOptions):
        self.port = options.kv_tcp_port
        self.server: TcpKVServer | None = None
        self.layerwise = False

    def attach(self, ctx: SenderContext) -> None:
        self.server = TcpKVServer(ctx.kv_cache, ctx.layout, ctx.leases, ctx.host, self.port, ctx.security)
        self.layerwise = on_host(ctx.kv_cache.kv)

    async def start(self) -> None:
        self.server.start()

    async def stop(self) -> None:
        self.server.stop()

    def capabilities(self) -> Capabilities:
        return Capabilities("tcp", layerwise=self.layerwise, partial=True)

    def describe(self, lease: Lease, source: nodes_pb2.KVSource) -> None:
        source.tcp_address = self.server.address


class TcpKVServer:
    """Serves leased blocks of one KV cache to decode nodes; a thread per connection (the copies
    into the socket release the GIL)."""

    def __init__(
        self,
        kv_cache: KVCache,
        layout: KVLayout,
        leases: LeaseTable,
        host: str = "127.0.0.1",
        port: int = 0,
        security: Security = NONE,
    ):
        self.kv_cache, self.layout, self.leases, self.security = kv_cache, layout, leases, security
        self.ssl = _server_context(security)
        plane = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                plane._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            block_on_close = False

        self._server = Server((host, port), Handler)
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-tcp", daemon=True)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()  # connected sockets, closed on stop

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._lock:  # idle pooled connections too: their handler threads end
            for raw in self._open:
                try:
                    raw.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _serve(self, raw: socket.socket) -> None:
        """One connection: read requests one after another (readers keep their connections), until
        the peer closes it, stays idle IDLE_S, or anything fails."""
        _tune(raw)
        with self._lock:
            self._open.add(raw)
        try:
            sock = self.ssl.wrap_socket(raw, server_side=True) if self.ssl else raw
            while self._serve_one(sock):
                pass
        except (OSError, ValueError, ssl.SSLError, PrefillFailed, TimeoutError) as e:
            log.info("kv tcp: connection ended: %s", e)  # a peer that went away or spoke nonsense, a failed prefill
        finally:
            with self._lock:
                self._open.discard(raw)
            raw.close()

    def _serve_one(self, sock: socket.socket) -> bool:
        """Serves one read; False when the peer closed the connection instead of asking again."""
        magic = bytearray(4)
        sock.settimeout(IDLE_S)  # also while sending: a peer that takes no byte this long ends the read and its pin
        got = sock.recv_into(magic)
        if got == 0:
            return False
        _recv_exact(sock, memoryview(magic)[got:])
        if bytes(magic) != MAGIC:
            return False
        request = _recv_json(sock)
        refusal, lease, layers = self._check(request)
        if refusal:
            _send_json(sock, {"ok": False, "code": refusal[0], "error": refusal[1]})
            return True
        try:
            self._send(sock, request, lease, layers)
        finally:
            self.leases.unpin(lease)
        return True

    def _send(self, sock: socket.socket, request: dict, lease, layers: range) -> None:
        """Sends a pinned lease's layers (the lease cannot expire under the read: a read that raced
        its expiry would send blocks already reused, with digests of those bytes)."""
        first = int(request.get("first_block", 0))
        num_tokens = lease.num_tokens - first * self.layout.block_size
        if not 0 <= first < len(lease.block_ids) or num_tokens <= 0:
            _send_json(
                sock,
                {
                    "ok": False,
                    "code": "INVALID_ARGUMENT",
                    "error": f"first_block {first} outside the lease's {len(lease.block_ids)} blocks",
                },
            )
            return
        num_bytes = self.layout.num_bytes(num_tokens) * len(layers) // self.layout.num_layers
        progress = lease.progress
        per_layer_digest = progress is not None or first > 0
        _send_json(
            sock,
            {"ok": True, "num_tokens": lease.num_tokens, "num_bytes": num_bytes, "layerwise": progress is not None},
        )
        staged = host_layers(self.kv_cache.kv, lease.block_ids[first:], num_tokens, layers)
        for layer, (layer_bytes, on_device) in zip(layers, staged):
            if progress is not None:  # layer-wise: each layer as soon as it is written, then its digest
                progress.wait_layer(layer, LAYER_WAIT_S)
            for host, device in on_device:
                host.copy_(device)
            for view in layer_bytes:
                sock.sendall(view)
            if per_layer_digest:
                sock.sendall(struct.pack("<Q", digest_views(layer_bytes)))
        if progress is not None and layers.stop == self.layout.num_layers:
            _send_json(sock, progress.wait_outcome(LAYER_WAIT_S))

    def _check(self, request: dict):
        """(refusal (code, message) or None, lease, layers)."""
        try:
            lease_id, key = str(request["lease_id"]), str(request["access_key"])
            expect = KVLayout(**request["layout"])
            a, b = (int(x) for x in request["layers"])
        except (KeyError, TypeError, ValueError) as e:
            return ("INVALID_ARGUMENT", f"malformed kv request: {e}"), None, None
        if self.security.token and not hmac.compare_digest(
            str(request.get("token", "")).encode(), self.security.token.encode()
        ):
            return ("UNAUTHENTICATED", "missing or wrong bearer token"), None, None
        lease = self.leases.get(lease_id)
        if lease is None or not hmac.compare_digest(key.encode(), lease.access_key.encode()):
            return ("NOT_FOUND", f"no kv_lease {lease_id!r} (released, expired or a wrong key)"), None, None
        try:
            self.layout.check(expect, sides=("prefill", "decode"))
        except KVLayoutMismatch as e:
            return ("FAILED_PRECONDITION", str(e)), None, None
        if not 0 <= a < b <= self.layout.num_layers:
            return ("INVALID_ARGUMENT", f"layers [{a}, {b}) outside [0, {self.layout.num_layers})"), None, None
        if self.leases.pin(lease_id) is None:  # expired during the checks
            return ("NOT_FOUND", f"no kv_lease {lease_id!r} (released, expired or a wrong key)"), None, None
        return None, lease, range(a, b)


def _server_context(security: Security) -> ssl.SSLContext | None:
    if not security.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(security.cert, security.key)
    if security.require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(security.ca)
    return ctx


def _client_context(security: Security) -> ssl.SSLContext | None:
    if not (security.tls or security.ca):
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if security.ca:
        ctx.load_verify_locations(security.ca)
    else:  # as the gRPC plane without --tls-ca: the system's trusted roots
        ctx.load_default_certs()
    if security.cert:
        ctx.load_cert_chain(security.cert, security.key)
    return ctx


# ---- the decode side ----------------------------------------------------------------------
def layer_ranges(num_layers: int, connections: int) -> list[tuple[int, int]]:
    """Splits [0, num_layers) into at most `connections` contiguous, near-equal ranges."""
    n = max(1, min(connections, num_layers))
    bounds = [num_layers * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


class TcpReader:
    name = "tcp"

    def __init__(self, security: Security = NONE, connections: int = DEFAULT_CONNECTIONS, timeout_s: float = 60.0):
        self.security = security
        self.ssl = _client_context(security)
        self.connections = connections
        self.timeout_s = timeout_s  # per socket operation: a stalled peer fails the read, never hangs it
        self._lock = threading.Lock()
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}  # address -> (connection, idle since)

    def capabilities(self) -> Capabilities:
        return Capabilities("tcp", layerwise=True, partial=True)

    def can_read(self, source: nodes_pb2.KVSource, layout: KVLayout) -> bool:
        return bool(source.tcp_address)

    def can_skip(self, source: nodes_pb2.KVSource) -> bool:
        return True  # the sender then sends each layer's digest

    async def read(
        self,
        source: nodes_pb2.KVSource,
        kv_cache: KVCache,
        layout: KVLayout,
        block_ids: list[int],
        skip_blocks: int = 0,
    ) -> dict | None:
        """Returns the trailer of a layer-wise source (the first token), else None."""
        layout.check(KVLayout.from_proto(source.layout))  # before a byte is written
        ranges = layer_ranges(layout.num_layers, self.connections)
        # Every connection runs to its end (or its timeout) before this returns, so that nothing
        # writes into the blocks after a failure has been reported.
        results = await asyncio.gather(
            *(
                asyncio.to_thread(self._read_layers, source, kv_cache, layout, block_ids, a, b, skip_blocks)
                for a, b in ranges
            ),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if source.layerwise:  # every layer was checked against the sender's digest as it landed
            return _check_trailer(results[-1][1], source)
        if skip_blocks:  # so was every layer of a partial read
            return None
        digest = combine_digests([d for layer_digests, _ in results for d in layer_digests])  # ranges in order
        if digest != source.digest:
            raise KVCorrupt(f"KV digest mismatch after the tcp read (lease {source.lease_id})")
        return None

    def _read_layers(
        self,
        source: nodes_pb2.KVSource,
        kv_cache: KVCache,
        layout: KVLayout,
        block_ids: list[int],
        a: int,
        b: int,
        skip_blocks: int,
    ) -> tuple[list[int], dict | None]:
        """Reads layers [a, b) into the blocks (from block skip_blocks on); returns their digests,
        and the trailer of a layer-wise source if b is the last layer."""
        address = source.tcp_address
        request = {
            "lease_id": source.lease_id,
            "access_key": source.access_key,
            "token": self.security.token or "",
            "layout": _layout_dict(layout),
            "layers": [a, b],
            "first_block": skip_blocks,
        }
        num_tokens = source.num_tokens - skip_blocks * layout.block_size
        sock = None
        try:
            sock, reply = self._ask(address, request)
            if not reply.get("ok"):
                self._give_back(address, sock)  # a refusal leaves the connection usable
                sock = None
            _check_reply(reply, source, layout.num_bytes(num_tokens) * (b - a) // layout.num_layers, address)
            digests, sent = [], bytearray(8)
            staged = host_layers(kv_cache.kv, block_ids[skip_blocks:], num_tokens, range(a, b))
            for layer, (layer_bytes, on_device) in zip(range(a, b), staged):
                for view in layer_bytes:
                    _recv_exact(sock, view)  # straight into the reserved blocks
                digests.append(digest_views(layer_bytes))  # while the layer is still in cache
                for host, device in on_device:
                    device.copy_(host)
                if source.layerwise or skip_blocks:
                    _recv_exact(sock, memoryview(sent))
                    if struct.unpack("<Q", sent)[0] != digests[-1]:
                        raise KVCorrupt(
                            f"KV digest mismatch in layer {layer} of the tcp read (lease {source.lease_id})"
                        )
            trailer = _recv_json(sock) if source.layerwise and b == layout.num_layers else None
            self._give_back(address, sock)
            sock = None
            return digests, trailer
        except (OSError, ssl.SSLError, ValueError) as e:
            if isinstance(e, KVLayoutMismatch):
                raise
            why = " (a layer-wise stream ends so when its prefill fails or is cancelled)" if source.layerwise else ""
            raise KVTransferError(f"KV read from {address} (layers {a}-{b - 1}) failed: {e}{why}") from e
        finally:
            if sock is not None:  # a read that failed midway leaves the connection in an unknown state
                sock.close()

    def _ask(self, address: str, request: dict) -> tuple[socket.socket, dict]:
        """Sends the request on an idle pooled connection, or on a new one if there is none or the
        pooled one turns out closed (its server restarted or timed it out); returns it and the reply."""
        while True:
            sock = self._take(address)
            pooled = sock is not None
            sock = sock or self._connect(address)
            try:
                _send_json(sock, request, prefix=MAGIC)
                return sock, _recv_json(sock)
            except BaseException as e:
                sock.close()
                if not (pooled and isinstance(e, OSError)):
                    raise

    def _connect(self, address: str) -> socket.socket:
        host, _, port = address.rpartition(":")
        raw = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout_s)
        _tune(raw)
        return self.ssl.wrap_socket(raw, server_hostname=host.strip("[]")) if self.ssl else raw

    def _take(self, address: str) -> socket.socket | None:
        with self._lock:
            idle = self._idle.get(address, [])
            while idle:
                sock, since = idle.pop()
                if time.monotonic() - since < POOL_IDLE_S:
                    return sock
                sock.close()
        return None

    def _give_back(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self.connections:
                idle.append((sock, time.monotonic()))
                return
        sock.close()

    async def close(self) -> None:
        with self._lock:
            for idle in self._idle.values():
                for sock, _ in idle:
                    sock.close()
            self._idle.clear()


def _check_reply(reply: dict, source: nodes_pb2.KVSource, num_bytes: int, address: str) -> None:
    """Raises unless the server's reply to a read is the one expected: a refusal, or other sizes."""
    if not reply.get("ok"):
        if reply.get("code") == "FAILED_PRECONDITION":
            raise KVLayoutMismatch(reply.get("error"))
        raise KVTransferError(f"KV read from {address} refused: {reply.get('code')}: {reply.get('error')}")
    said = (reply.get("num_tokens"), reply.get("num_bytes"), bool(reply.get("layerwise")))
    if said != (source.num_tokens, num_bytes, source.layerwise):
        raise KVTransferError(
            f"KV reply says {said[0]} tokens / {said[1]} bytes / layerwise {said[2]}, expected "
            f"{source.num_tokens} / {num_bytes} / {source.layerwise}"
        )


def _check_trailer(trailer, source: nodes_pb2.KVSource) -> dict:
    ok = (
        isinstance(trailer, dict)
        and isinstance(trailer.get("finished"), bool)
        and (
            trailer["finished"]
            or isinstance(trailer.get("token_id"), int)
            and isinstance(trailer.get("text_chars"), int)
        )
    )
    if not ok:
        raise KVTransferError(f"malformed layer-wise trailer for lease {source.lease_id}: {trailer!r}")
    return trailer


TRANSPORT = Transport(
    "tcp",
    sender=TcpSender,
    reader=lambda ctx: TcpReader(ctx.security, ctx.options.kv_tcp_connections),
    sender_options=TcpSenderOptions,
    reader_options=TcpReaderOptions,
)
