"""The registered KV transports, in the order `--kv-transport auto` prefers them: the one-sided
read on one host, then the raw TCP data plane, then the gRPC stream. Adding a transport is one
file (its Transport: sender, reader, capabilities, options; docs/kv_transfer.md) and one line here.
"""

from __future__ import annotations

from kvtransfer import grpc_stream, shm, tcp
from kvtransfer.base import Capabilities, Transport

TRANSPORTS: dict[str, Transport] = {}


def register(transport: Transport) -> None:
    """Adds a transport after those registered before it (auto tries it after them)."""
    TRANSPORTS[transport.name] = transport


register(shm.TRANSPORT)
register(tcp.TRANSPORT)
register(grpc_stream.TRANSPORT)
CHOICES = ("auto", *TRANSPORTS)  # --kv-transport (a transport registered later is not a flag choice)


def named(name: str) -> list[Transport]:
    """The transports a decode node reads with: every one for auto, else the one named."""
    if name == "auto":
        return list(TRANSPORTS.values())
    if name not in TRANSPORTS:
        raise ValueError(f"kv_transport must be one of {('auto', *TRANSPORTS)}, got {name!r}")
    return [TRANSPORTS[name]]


def sender_options() -> list[type]:
    return [t.sender_options for t in TRANSPORTS.values() if t.sender_options]


def reader_options() -> list[type]:
    return [t.reader_options for t in TRANSPORTS.values() if t.reader_options]


def choose(
    senders: list[Capabilities], readers: list[Capabilities], same_host: bool, layerwise: bool = False
) -> Capabilities | None:
    """The transport a decode node (its readers, in its order) would read a prefill node's lease
    with (its senders), as the two nodes report them, and what it can do there; None: none can.
    layerwise: only one that streams the layers of a prefill still computing, on both sides."""
    offered = {s.name: s for s in senders}
    for reader in readers:
        sender = offered.get(reader.name)
        if sender is None or (reader.same_host and not same_host):
            continue
        both = Capabilities(
            reader.name, reader.layerwise and sender.layerwise, reader.partial and sender.partial, reader.same_host
        )
        if both.layerwise or not layerwise:
            return both
    return None
