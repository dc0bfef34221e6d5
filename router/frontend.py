"""What every pdserve Generation server does the same way: check and tokenize requests, measure
them, and speak gRPC. The request's path itself is each server's `_serve`: the router's
disaggregated one (router/server.py) or the colocated baseline's (pdserve/colocated.py)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from engine.model_config import ModelConfig
from engine.model_source import resolve_model
from engine.structured_output import GrammarCompiler, StructuredOutput
from engine.tokenizer import (
    apply_chat_template,
    bad_words_token_ids,
    check_prompt_length,
    load_tokenizer,
    prompt_token_ids,
)
from pdserve_api import common_pb2, generate_pb2, generate_pb2_grpc
from router.config import RouterConfig
from serving.metrics import Metrics
from serving.protocol import sampling_from_proto
from serving.tool_calls import (
    constrained_output,
    join_fragments,
    template_messages,
    template_tools,
    tool_calls_for,
)

log = logging.getLogger(__name__)
SLOW_FIRST_TOKEN_S = 5.0  # a first token later than this is logged with its timeline (where it waited)
OUTCOME_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.NOT_FOUND: "invalid",
    grpc.StatusCode.FAILED_PRECONDITION: "invalid",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "cancelled",
}


class RequestError(Exception):
    """Ends a request with a gRPC status; each ingress turns it into its own error reply."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details

    def __reduce__(self):  # crosses processes under Ray Serve
        return RequestError, (self.code, self.details)


class RateLimiter:
    """A token bucket per client: `rate` requests/s, bursts of `burst`."""

    def __init__(self, rate: float, burst: float | None = None):
        if rate <= 0:
            raise ValueError(f"rate limit must be > 0 requests/s, got {rate}")
        self.rate, self.burst = rate, burst or max(1.0, rate)
        self.buckets: dict[str, tuple[float, float]] = {}

    def allow(self, client: str) -> bool:
        now = time.monotonic()
        tokens, last = self.buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens < 1:
            self.buckets[client] = (tokens, now)
            return False
        self.buckets[client] = (tokens - 1, now)
        if len(self.buckets) > 100_000:  # forget idle clients
            self.buckets = {c: v for c, v in self.buckets.items() if now - v[1] < 60}
        return True


class Frontend(generate_pb2_grpc.GenerationServicer):
    api_keys: tuple[str, ...] = ()  # the public API's keys, when it has any (a router sets them)

    def __init__(
        self,
        model: str,
        max_model_len: int | None = None,
        metrics: Metrics | None = None,
        max_outstanding: int = RouterConfig.max_outstanding,
        rate_limit: float | None = None,
        rate_burst: float | None = None,
        chat_template: str | None = None,
        tool_call_parser: str = RouterConfig.tool_call_parser,
    ):
        """max_outstanding: requests in flight before new ones get RESOURCE_EXHAUSTED at once;
        rate_limit: requests/s per client (`x-client-id` metadata, else the peer address);
        chat_template: a Jinja template file used instead of the model's; tool_call_parser: the
        format tool calls are parsed in under tool_choice auto (auto: the template's)."""
        self.max_outstanding = max_outstanding
        self.num_outstanding = 0
        self.rate_limiter = RateLimiter(rate_limit, rate_burst) if rate_limit else None
        model_dir = resolve_model(model)
        self.model_id = model
        self.model_config = ModelConfig.from_dir(model_dir)
        self.max_model_len = max_model_len or self.model_config.max_position_embeddings
        self.tokenizer = load_tokenizer(model_dir)
        if chat_template:
            if self.tokenizer is None:
                raise ValueError("chat_template: this model has no tokenizer to render a template with")
            try:
                self.tokenizer.chat_template = Path(chat_template).read_text()
            except OSError as e:
                raise ValueError(f"chat_template: cannot read {chat_template}: {e.strerror}") from None
        self.tool_call_parser = tool_call_parser
        cfg = self.model_config
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)  # structured output
        self.metrics = metrics or Metrics()

    async def _serve(self, request, deadline: float) -> AsyncIterator[generate_pb2.GenerateResponse]:
        raise NotImplementedError
        yield

    def health(self) -> dict:
        """What GET /health reports: {"status": "ok"}, or {"status": "unavailable", "message": why};
        a router adds each pool's healthy and total nodes."""
        return {"status": "ok"}

    # ---- a request's life ---------------------------------------------------------------
    async def serve(
        self, request: generate_pb2.GenerateRequest, deadline: float = 0.0, client: str = "", authorization: str = ""
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The request's path (`_serve`), behind admission control, and measured: TTFT, TPOT,
        end-to-end, outcome, tokens. authorization: the API key the request came with; under API
        keys it salts the request's prefix-cache blocks (tenants never share one)."""
        if self.api_keys:
            request.sampling.cache_salt = tenant_salt(authorization, request.sampling.cache_salt)
        if self.num_outstanding >= self.max_outstanding:
            self.metrics.inc("pdserve_requests_total", outcome="unavailable")
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at capacity: {self.num_outstanding} requests in flight (max_outstanding "
                f"{self.max_outstanding}); retry later",
            )
        if self.rate_limiter is not None and not self.rate_limiter.allow(client):
            self.metrics.inc("pdserve_requests_total", outcome="unavailable")
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"client {client!r} is over its rate limit of {self.rate_limiter.rate:g} requests/s",
            )
        outcome, last = "error", None
        self.num_outstanding += 1
        try:
            tools = self._tool_calls(request)
            await self._compile(request, tools is not None)
            async for msg in self._serve(request, deadline):
                if tools is not None:
                    tools.rewrite(msg)
                last = msg
                yield msg
            outcome = "ok"
        except RequestError as e:
            outcome = OUTCOME_BY_CODE.get(e.code, "error")
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self.num_outstanding -= 1
            self.metrics.inc("pdserve_requests_total", outcome=outcome)
            if last is not None and last.finished:
                self._observe(last.timings, last.usage)

    def _observe(self, t: common_pb2.Timings, usage: common_pb2.Usage) -> None:
        if t.first_token and t.first_token - t.queued > SLOW_FIRST_TOKEN_S:  # where a slow one waited
            log.warning(
                "slow first token (%.1f s, %d prompt tokens, %d cached): %s",
                t.first_token - t.queued,
                usage.prompt_tokens,
                t.cached_tokens,
                timeline(t),
            )
        m = self.metrics
        m.observe("pdserve_request_ttft_seconds", t.first_token - t.queued)
        m.observe("pdserve_request_e2e_seconds", t.done - t.queued)
        m.observe("pdserve_request_queue_seconds", max(0.0, t.prefill_start - t.queued))
        if usage.completion_tokens > 1:
            m.observe("pdserve_request_tpot_seconds", (t.done - t.first_token) / (usage.completion_tokens - 1))
        m.inc("pdserve_prompt_tokens_total", usage.prompt_tokens)
        m.inc("pdserve_generation_tokens_total", usage.completion_tokens)

    def _tool_calls(self, request: generate_pb2.GenerateRequest):
        """A chat request's tools: checked, a required or named call held to its schema (a
        structured output the nodes apply), and what parses its calls out of the output."""
        if request.WhichOneof("input") != "messages":
            return None
        chat = request.messages
        try:
            tools = tool_calls_for(chat, self.tool_call_parser, self._template())
            constraint = constrained_output(chat) if tools is not None else None
            held = constraint is not None and request.sampling.structured_output == constraint  # served again
            if constraint is not None and _no_room_for_a_grammar(request.sampling):
                raise ValueError("tool_choice: a required or named call takes no ignore_eos, min_tokens or bad_words")
            if tools is not None and request.sampling.HasField("structured_output") and not held:
                raise ValueError(
                    "tool_choice: tool calls and a structured output cannot be combined (tool_choice none can)"
                )
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if constraint is not None:
            request.sampling.structured_output.CopyFrom(constraint)
        return tools

    async def _compile(self, request: generate_pb2.GenerateRequest, from_tools: bool) -> None:
        """A structured output's grammar, compiled and cached on a worker thread (a large schema
        takes a while; the event loop serves the other requests meanwhile); refused naming the
        field, tools where it holds a tool call, before any node works on it."""
        if not request.sampling.HasField("structured_output"):
            return
        so = request.sampling.structured_output
        try:
            await asyncio.to_thread(self.grammars.compile, StructuredOutput(so.kind, so.spec))
        except ValueError as e:
            why = f"tools: a function's parameters schema cannot be held to: {e}" if from_tools else str(e)
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, why) from None

    def _check(self, request: generate_pb2.GenerateRequest) -> tuple[list[int], object]:
        if request.model and request.model != self.model_id:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here (serving {self.model_id!r})"
            )
        try:
            if request.sampling.bad_words:  # the nodes take them tokenized
                words = bad_words_token_ids(self.tokenizer, list(request.sampling.bad_words))
                request.sampling.ClearField("bad_words")
                request.sampling.bad_words_token_ids.extend(common_pb2.TokenIds(ids=list(w)) for w in words)
            params = sampling_from_proto(request.sampling)
            params.check_token_ids(self.model_config.vocab_size)
            if params.structured_output is not None:  # compiled here once: a bad one is refused before any node
                self.grammars.compile(params.structured_output)
            ids = self._prompt_ids(request)
            check_prompt_length(len(ids), self.max_model_len)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return ids, params

    def _prompt_ids(self, request) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "prompt_token_ids":
            prompt = list(request.prompt_token_ids.ids)
        elif kind == "messages":
            prompt = self._render(request.messages)
        else:
            prompt = request.prompt
        return prompt_token_ids(self.tokenizer, prompt, self.model_config.vocab_size)

    def _template(self) -> str | None:
        """The chat template tools are rendered with (of a model with several, the tool_use one)."""
        try:
            return self.tokenizer.get_chat_template(tools=[{}])
        except (AttributeError, ValueError):  # no tokenizer, or no template
            return None

    def _render(self, chat: generate_pb2.ChatMessages) -> str:
        return apply_chat_template(self.tokenizer, template_messages(chat), tools=template_tools(chat))

    # ---- Generation service (grpc.aio) ------------------------------------------------------
    async def Generate(self, request, context):
        try:
            async for msg in self.serve(request, _deadline(context), client_of(context), _authorization(context)):
                yield msg
        except RequestError as e:
            await context.abort(e.code, e.details)

    async def GenerateUnary(self, request, context) -> generate_pb2.GenerateResponse:
        try:
            return await self.generate_unary(request, _deadline(context), client_of(context), _authorization(context))
        except RequestError as e:
            await context.abort(e.code, e.details)

    async def Tokenize(self, request, context) -> generate_pb2.TokenizeResponse:
        try:
            return self.tokenize(request)
        except RequestError as e:
            await context.abort(e.code, e.details)

    async def ListModels(self, request, context) -> generate_pb2.ListModelsResponse:
        return self.list_models()

    # ---- the same, transport-free (the Ray Serve ingress calls these) ---------------------------
    async def generate_unary(
        self, request, deadline: float = 0.0, client: str = "", authorization: str = ""
    ) -> generate_pb2.GenerateResponse:
        """The whole stream in one message: sample 0 in the top-level fields, and with n > 1 every
        sample in `samples`."""
        whole = generate_pb2.GenerateResponse()
        samples: dict[int, generate_pb2.Sample] = {}
        async for msg in self.serve(request, deadline, client, authorization):
            whole.request_id = msg.request_id
            sample = samples.setdefault(msg.index, generate_pb2.Sample(index=msg.index))
            sample.token_ids.extend(msg.token_ids)
            sample.text += msg.text
            sample.logprobs.extend(msg.logprobs)
            sample.finish_reason = msg.finish_reason or sample.finish_reason
            if msg.tool_calls:  # fragments joined into whole calls
                calls = join_fragments(list(sample.tool_calls) + list(msg.tool_calls))
                del sample.tool_calls[:]
                sample.tool_calls.extend(calls)
            if msg.finished:
                whole.finished = True
                whole.usage.CopyFrom(msg.usage)
                whole.timings.CopyFrom(msg.timings)
        first = samples.get(0, generate_pb2.Sample())
        whole.token_ids.extend(first.token_ids)
        whole.text, whole.finish_reason = first.text, first.finish_reason
        whole.logprobs.extend(first.logprobs)
        whole.tool_calls.extend(first.tool_calls)
        if len(samples) > 1:
            whole.samples.extend(samples[i] for i in sorted(samples))
        return whole

    def tokenize(self, request) -> generate_pb2.TokenizeResponse:
        try:
            if request.WhichOneof("input") == "messages":
                text = self._render(request.messages)
            else:
                text = request.prompt
            ids = prompt_token_ids(self.tokenizer, text, self.model_config.vocab_size)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return generate_pb2.TokenizeResponse(token_ids=ids, max_model_len=self.max_model_len)

    def list_models(self) -> generate_pb2.ListModelsResponse:
        card = generate_pb2.ModelCard(
            id=self.model_id, max_model_len=self.max_model_len, dtype=self.model_config.checkpoint_dtype
        )
        return generate_pb2.ListModelsResponse(models=[card])


def _no_room_for_a_grammar(s: common_pb2.SamplingParams) -> bool:
    """What a structured output refuses (each could leave no token the grammar allows)."""
    return s.ignore_eos or s.min_tokens > 0 or bool(s.bad_words) or bool(s.bad_words_token_ids)


def client_of(context) -> str:
    """Who is asking, for the rate limit: the x-client-id metadata, else the peer's address."""
    metadata = dict(context.invocation_metadata() or ())
    return metadata.get("x-client-id") or context.peer().rsplit(":", 1)[0]


def _authorization(context) -> str:
    return dict(context.invocation_metadata() or ()).get("authorization", "")


def _deadline(context) -> float:
    remaining = context.time_remaining()
    return time.time() + remaining if remaining is not None else 0.0


def remaining(deadline: float) -> float | None:
    return max(0.001, deadline - time.time()) if deadline else None


TIMELINE = ("prefill_start", "prefill_end", "transfer_start", "transfer_end", "decode_admitted", "first_token", "done")


def timeline(t: common_pb2.Timings) -> str:
    """Where a request's time went, each step since the router got it: 'prefill_start +0.0s ...'
    (a gap before prefill_start is the prefill queue; before decode_admitted, the decode node's)."""
    steps = " ".join(f"{name} +{getattr(t, name) - t.queued:.2f}s" for name in TIMELINE if getattr(t, name))
    where = f" (prefill on {t.prefill_node}{', local' if t.local_prefill else ''}" if t.prefill_node else ""
    if where and t.decode_node and (t.decode_node != t.prefill_node or t.migrations):
        where += f"; decode on {t.decode_node}" + (f" after {t.migrations} migration(s)" if t.migrations else "")
    where += ")" if where else ""
    return steps + where


def final_message(
    msg: generate_pb2.GenerateResponse,
    reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    timings: common_pb2.Timings,
) -> generate_pb2.GenerateResponse:
    timings.done = time.time()
    msg.finished, msg.finish_reason = True, reason
    msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))
    msg.timings.CopyFrom(timings)
    return msg


def tenant_salt(authorization: str, cache_salt: str) -> str:
    """A request's cache_salt under API keys: its key's own (a digest, never the key) before the
    salt the client chose, so that requests under different keys never share a cached block and no
    client can pick another key's salt."""
    key = authorization.removeprefix("Bearer ").encode()
    return f"key:{hashlib.sha256(key).hexdigest()[:32]}/{cache_salt}"
