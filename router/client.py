"""Python clients for a pdserve router (or any server of the Generation service).

    from router.client import Client
    with Client("127.0.0.1:8000") as c:
        for part in c.stream("Why is the sky blue?", max_tokens=64):
            print(part.text, end="", flush=True)
        result = c.generate("Hello", max_tokens=8, temperature=0)

`AsyncClient` has the same methods as coroutines / async iterators. Errors arrive as
grpc.RpcError with the server's status code and message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace

from google.protobuf.json_format import MessageToDict

from kvtransfer.security import NONE, Security
from pdserve_api import common_pb2, generate_pb2, generate_pb2_grpc


@dataclass
class Completion:
    text: str = ""
    request_id: str = ""  # the id the client chose, or the one the router assigned
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    others: dict[int, Completion] = field(default_factory=dict)  # n > 1: samples 1..n-1

    @property
    def samples(self) -> list[Completion]:
        """Every sample by index (this one is sample 0)."""
        return [self] + [self.others[i] for i in sorted(self.others)]

    def add(self, part: generate_pb2.GenerateResponse) -> None:
        sample = self if part.index == 0 else self.others.setdefault(part.index, Completion())
        self.request_id = part.request_id or self.request_id
        sample.text += part.text
        sample.token_ids.extend(part.token_ids)
        sample.logprobs.extend(dict(zip(lp.token_ids, lp.logprobs)) for lp in part.logprobs)
        sample.finish_reason = part.finish_reason or sample.finish_reason
        for s in part.samples:  # the unary form
            if s.index:
                self.others[s.index] = Completion(
                    s.text,
                    list(s.token_ids),
                    s.finish_reason,
                    logprobs=[dict(zip(lp.token_ids, lp.logprobs)) for lp in s.logprobs],
                )
        if part.finished:
            self.usage = MessageToDict(
                part.usage, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            self.timings = MessageToDict(part.timings, preserving_proto_field_name=True)


def build_request(
    prompt: str | list[int] | None = None,
    *,
    messages: list[dict] | None = None,
    model: str = "",
    request_id: str = "",
    **sampling,
) -> generate_pb2.GenerateRequest:
    """sampling: max_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids, ignore_eos, logprobs,
    n, best_of."""
    req = generate_pb2.GenerateRequest(
        request_id=request_id, model=model, sampling=common_pb2.SamplingParams(**sampling)
    )
    if messages is not None:
        req.messages.CopyFrom(generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**m) for m in messages]))
    elif isinstance(prompt, str):
        req.prompt = prompt
    elif prompt is not None:
        req.prompt_token_ids.CopyFrom(common_pb2.TokenIds(ids=list(prompt)))
    return req


class Client:
    """metadata: sent with every call, e.g. [("application", "pdserve")] through Ray Serve's proxy.
    api_key: one of the router's --api-key-file keys (sent as `authorization: Bearer <key>`).
    security: TLS (the CA to trust) and/or the bearer token of a protected router."""

    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        metadata: list[tuple[str, str]] | None = None,
        security: Security = NONE,
        api_key: str | None = None,
    ):
        security = replace(security, token=api_key) if api_key else security
        self.channel = security.sync_channel(address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.timeout = timeout
        self.metadata = (metadata or []) + security.metadata() or None

    def stream(self, prompt=None, **kwargs) -> Iterator[generate_pb2.GenerateResponse]:
        """Yields the response messages as they arrive; closing the iterator cancels the request."""
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout, metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def generate(self, prompt=None, **kwargs) -> Completion:
        result = Completion()
        for part in self.stream(prompt, **kwargs):
            result.add(part)
        return result

    def generate_unary(self, prompt=None, **kwargs) -> Completion:
        result = Completion()
        result.add(
            self.stub.GenerateUnary(build_request(prompt, **kwargs), timeout=self.timeout, metadata=self.metadata)
        )
        return result

    def tokenize(self, prompt: str) -> list[int]:
        return list(
            self.stub.Tokenize(
                generate_pb2.TokenizeRequest(prompt=prompt), timeout=self.timeout, metadata=self.metadata
            ).token_ids
        )

    def models(self) -> list[str]:
        return [
            m.id
            for m in self.stub.ListModels(
                generate_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self.metadata
            ).models
        ]

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient:
    """Client's calls as coroutines; the same arguments."""

    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        metadata: list[tuple[str, str]] | None = None,
        security: Security = NONE,
        api_key: str | None = None,
    ):
        security = replace(security, token=api_key) if api_key else security
        self.channel = security.channel(address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.timeout = timeout
        self.metadata = metadata

    async def stream(self, prompt=None, **kwargs) -> AsyncIterator[generate_pb2.GenerateResponse]:
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=self.timeout, metadata=self.metadata)
        try:
            async for part in call:
                yield part
        finally:
            call.cancel()

    async def generate(self, prompt=None, **kwargs) -> Completion:
        result = Completion()
        async for part in self.stream(prompt, **kwargs):
            result.add(part)
        return result

    async def generate_unary(self, prompt=None, **kwargs) -> Completion:
        result = Completion()
        result.add(
            await self.stub.GenerateUnary(build_request(prompt, **kwargs), timeout=self.timeout, metadata=self.metadata)
        )
        return result

    async def tokenize(self, prompt: str) -> list[int]:
        reply = await self.stub.Tokenize(
            generate_pb2.TokenizeRequest(prompt=prompt), timeout=self.timeout, metadata=self.metadata
        )
        return list(reply.token_ids)

    async def models(self) -> list[str]:
        reply = await self.stub.ListModels(
            generate_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self.metadata
        )
        return [m.id for m in reply.models]

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
