"""Who may talk to a pdserve server: TLS (mutual on the internal ports) and a shared bearer token.

- Public port (the router): TLS with the server's certificate; optionally API keys (any of them
  as `authorization: Bearer <key>` metadata, the same keys as the HTTP API's Authorization header).
- Internal ports (prefill, decode, KV plane): mutual TLS (a client certificate signed by the
  cluster CA is required) and/or a shared bearer token. An unknown peer cannot submit requests,
  read KV or push it.
Certificates, tokens and keys come from files. The standard health service stays open (Kubernetes
probes); every other method needs the token when one is configured.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import grpc

from engine.config import option

OPEN_METHODS = ("/grpc.health.v1.Health/",)
# Every pdserve gRPC server and channel sets its message limit explicitly: a KV chunk plus headroom.
MAX_MESSAGE_BYTES = 8 << 20
MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# Channels between pdserve processes (router -> nodes, decode -> prefill) ping the peer every 5 s
# and give it 5 s to answer: a host that vanishes without closing its sockets (its link cut, its
# power gone) fails the calls in flight in about 10 s, where TCP alone waits minutes.
KEEPALIVE_MS = 5000
INTERNAL_CHANNEL_OPTIONS = [
    *MESSAGE_OPTIONS,
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a node back at the same address (a host that returned) is reconnected within 10 s, not
    # after gRPC's default backoff of up to 2 minutes
    ("grpc.max_reconnect_backoff_ms", 10_000),
]
# ...and every pdserve server accepts those pings (gRPC's default answers a ping more often than
# every 5 minutes with GOAWAY "too_many_pings").
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
]


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class Security:
    cert: str | None = None  # PEM: this process's certificate (server, and client for mTLS)
    key: str | None = None
    ca: str | None = None  # PEM: the CA that signs the peers' certificates
    token: str | None = None  # shared bearer token: clients send it, servers require it
    require_client_cert: bool = False  # mTLS on this server
    api_keys: tuple[str, ...] = ()  # the public port: a server accepts any of these

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise ValueError("tls: --tls-cert and --tls-key go together")
        if self.require_client_cert and not (self.cert and self.ca):
            raise ValueError("tls: mutual TLS needs --tls-cert, --tls-key and --tls-ca")

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    @classmethod
    def from_files(
        cls, cert=None, key=None, ca=None, token_file=None, require_client_cert=False, api_key_file=None
    ) -> Security:
        token = Path(token_file).read_text().strip() if token_file else None
        if token_file and not token:
            raise ValueError(f"token file {token_file} is empty")
        return cls(cert, key, ca, token, require_client_cert, read_api_keys(api_key_file) if api_key_file else ())

    # ---- servers ------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.ca),
            require_client_auth=self.require_client_cert,
        )

    def interceptors(self) -> list:
        if self.api_keys:
            return [TokenCheck(self.api_keys, "invalid or missing API key (metadata authorization: Bearer <key>)")]
        return [TokenCheck((self.token,), "missing or wrong bearer token")] if self.token else []

    # ---- clients ------------------------------------------------------------------------
    def channel(self, address: str, options: list = MESSAGE_OPTIONS) -> grpc.aio.Channel:
        # One instance per call type: grpc.aio files an interceptor under its first matching type only.
        interceptors = [AddTokenUnary(self.token), AddTokenStream(self.token)] if self.token else None
        if self.tls or self.ca:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.ca), private_key=_read(self.key), certificate_chain=_read(self.cert)
            )
            return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)

    def sync_channel(self, address: str, options: list = MESSAGE_OPTIONS) -> grpc.Channel:
        """A blocking channel (the sync client); the token goes in each call's metadata()."""
        if self.tls or self.ca:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.ca), private_key=_read(self.key), certificate_chain=_read(self.cert)
            )
            return grpc.secure_channel(address, creds, options=options)
        return grpc.insecure_channel(address, options=options)

    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []


NONE = Security()


@dataclass(frozen=True)
class SecurityConfig:
    """The internal ports' options: every node's, and the router's as their client."""

    cli_title: ClassVar[str] = "security (internal ports: mutual TLS when a CA is given, and/or a token)"
    tls_cert: str | None = option(None, "PEM certificate of this process (server, and client for mTLS)")
    tls_key: str | None = option(None, "PEM private key")
    tls_ca: str | None = option(None, "PEM CA that signs the cluster's certificates (enables mutual TLS)")
    token_file: str | None = option(None, "file holding the shared internal bearer token")

    def security(self) -> Security:
        return Security.from_files(
            self.tls_cert, self.tls_key, self.tls_ca, self.token_file, require_client_cert=bool(self.tls_ca)
        )


def read_api_keys(path: str) -> tuple[str, ...]:
    """API keys, one per line (blank lines ignored)."""
    try:
        keys = tuple(line.strip() for line in Path(path).read_text().splitlines() if line.strip())
    except OSError as e:
        raise ValueError(f"cannot read the API key file {path}: {e.strerror}") from None
    if not keys:
        raise ValueError(f"the API key file {path} holds no key (one per line)")
    return keys


def authorized(given: str, accepted: tuple[bytes, ...]) -> bool:
    """Whether an Authorization value is `Bearer <one of the keys>`, compared in constant time
    against every key (not stopping at a match)."""
    matches = [hmac.compare_digest(given.encode(), k) for k in accepted]
    return any(matches)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses calls without one of the bearer tokens (UNAUTHENTICATED), except the health service."""

    def __init__(self, tokens: tuple[str, ...], message: str):
        self.accepted = tuple(f"Bearer {t}".encode() for t in tokens)
        self.message = message

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if authorized(given, self.accepted):
            return await continuation(details)
        return _deny(await continuation(details), self.message)


def _deny(handler, message: str):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover

    if handler is None:
        return None
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


class _Token:
    def __init__(self, token: str):
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, details):
        metadata = list(details.metadata or []) + [self.header]
        return details._replace(metadata=grpc.aio.Metadata(*metadata))


class AddTokenUnary(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the bearer token to every unary call of a channel."""

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class AddTokenStream(_Token, grpc.aio.UnaryStreamClientInterceptor):
    """Adds the bearer token to every server-streaming call of a channel."""

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)
