"""One request as the router follows it across attempts (router/server.py), and the node
messages it is made of."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from engine.sampling_params import SamplingParams
from pdserve_api import common_pb2, generate_pb2, nodes_pb2
from router.frontend import final_message
from router.pool import Endpoint


@dataclass
class Request:
    """One request as the router follows it across attempts: what the client has been sent so far
    is what a migrated attempt starts from."""

    rid: str  # the router's own: the nodes know the request by it, so clients' ids cannot collide
    prompt: list[int]
    params: SamplingParams
    deadline: float
    timings: common_pb2.Timings
    label: str = ""  # the client's request_id, only echoed back (and logged); the rid where none
    generated: list[int] = field(default_factory=list)  # every token streamed to the client so far
    emitted: int = 0  # characters of text streamed so far

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def ends_at_next_token(self) -> bool:
        """Whether the next token is the last max_tokens allows (n > 1, beams: none of the
        prefill's tokens is a sample's)."""
        return not self.several and self.params.max_tokens <= len(self.generated) + 1

    def past_deadline(self) -> bool:
        return bool(self.deadline) and time.time() >= self.deadline

    @property
    def several(self) -> bool:
        """n > 1 or beams: the samples (beams) fork on the decode node, each drawing its first token there."""
        return self.params.forks

    def message(self, part) -> generate_pb2.GenerateResponse:
        """A decode node's (or a prefill's) message as the client's, counted as sent."""
        self.generated.extend(part.token_ids)
        self.emitted += len(part.text)
        msg = generate_pb2.GenerateResponse(
            request_id=self.label or self.rid,
            token_ids=part.token_ids,
            text=part.text,
            logprobs=part.logprobs,
            index=part.index,
            finish_reason=part.finish_reason,
        )
        if part.finished:
            return final_message(msg, part.finish_reason, len(self.prompt), len(self.generated), self.timings)
        return msg

    def prefilled(self, reply, node: str, local: bool) -> None:
        """The prefill's timings, from the attempt whose first token the client got."""
        t = self.timings
        if t.first_token:
            return
        t.prefill_start, t.prefill_end, t.cached_tokens = reply.prefill_start, reply.prefill_end, reply.cached_tokens
        t.prefill_node, t.local_prefill = node, local
        t.first_token = 0 if self.several and not local else time.time()  # n > 1, beams: the decode node's first

    def decoding_on(self, node: str) -> None:
        """The decode node of the attempt streaming now (a migration moves it; the prefill's
        timings stay the first attempt's)."""
        self.timings.decode_node = node

    def transferred(self, part: nodes_pb2.DecodeResponse) -> None:
        """The decode node's first message of a remote attempt: the KV transfer's timings."""
        t = self.timings
        t.first_token = t.first_token or time.time()
        t.transfer_start, t.transfer_end = part.transfer_start, part.transfer_end
        t.decode_admitted, t.kv_transport = part.decode_admitted, part.kv_transport
        t.kv_bytes, t.decode_cached_tokens = part.kv_bytes, part.cached_tokens


class PrefillFailed(Exception):
    """A prefill failed before anything streamed: a layer-wise one after it had described its KV,
    or every prefill node the request tried was unreachable."""

    def __init__(self, code: grpc.StatusCode, details: str, node: Endpoint):
        super().__init__(details)
        self.code, self.details, self.node = code, details, node


async def next_reply(replies, node: Endpoint, raw: bool = False) -> nodes_pb2.PrefillResponse:
    """The next message of a StreamPrefill call. raw: its errors as they are (before the
    descriptor, when the prefill may still be retried elsewhere), else as PrefillFailed."""
    try:
        reply = await replies.read()
    except grpc.aio.AioRpcError as e:
        if raw:
            raise
        raise PrefillFailed(e.code(), e.details(), node) from None
    if reply is grpc.aio.EOF:
        if raw:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "prefill stream ended early")
        raise PrefillFailed(grpc.StatusCode.UNAVAILABLE, "prefill stream ended before the first token", node)
    return reply


def as_part(reply: nodes_pb2.PrefillResponse) -> nodes_pb2.DecodeResponse:
    """A prefill's first token as a stream message."""
    part = nodes_pb2.DecodeResponse(
        token_ids=[reply.first_token_id], text=reply.text, finished=reply.finished, finish_reason=reply.finish_reason
    )
    if reply.HasField("logprobs"):
        part.logprobs.append(reply.logprobs)
    return part
