"""The router: the public Generation service in front of the prefill and decode pools.

It tokenizes and checks requests, picks a prefill node and a decode node, and relays tokens.
It never touches KV bytes: the decode node reads them from the prefill node directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from engine.model_config import ModelConfig
from engine.model_source import resolve_model
from engine.tokenizer import apply_chat_template, check_prompt_length, load_tokenizer, prompt_token_ids
from pdserve.grpc_server import GrpcServer
from pdserve.metrics import Metrics
from pdserve.protocol import sampling_from_proto, sampling_to_proto
from pdserve_api import common_pb2, generate_pb2, generate_pb2_grpc, nodes_pb2, nodes_pb2_grpc
from router.pool import EndpointPool, NoHealthyNode

log = logging.getLogger(__name__)
OUTCOME_BY_CODE = {grpc.StatusCode.INVALID_ARGUMENT: "invalid", grpc.StatusCode.NOT_FOUND: "invalid",
                   grpc.StatusCode.FAILED_PRECONDITION: "invalid", grpc.StatusCode.UNAVAILABLE: "unavailable",
                   grpc.StatusCode.RESOURCE_EXHAUSTED: "unavailable", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
                   grpc.StatusCode.CANCELLED: "cancelled"}


class RequestError(Exception):
    """Ends a request with a gRPC status; each ingress turns it into its own error reply."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details

    def __reduce__(self):  # crosses processes under Ray Serve
        return RequestError, (self.code, self.details)


class Router(generate_pb2_grpc.GenerationServicer):
    def __init__(self, model: str, prefill: list[str], decode: list[str], host: str = "127.0.0.1", port: int = 0,
                 max_model_len: int | None = None, check_interval_s: float = 1.0, metrics: Metrics | None = None):
        model_dir = resolve_model(model)
        self.model_id = model
        self.model_config = ModelConfig.from_dir(model_dir)
        self.max_model_len = max_model_len or self.model_config.max_position_embeddings
        self.tokenizer = load_tokenizer(model_dir)
        self.prefill_pool = EndpointPool("prefill", prefill, check_interval_s)
        self.decode_pool = EndpointPool("decode", decode, check_interval_s)
        self.metrics = metrics or Metrics()
        self.server = GrpcServer(host, port)
        self.server.add(generate_pb2_grpc.add_GenerationServicer_to_server, self,
                        generate_pb2.DESCRIPTOR.services_by_name["Generation"])

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await asyncio.gather(self.prefill_pool.start(), self.decode_pool.start())
        await self.server.start()

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        await asyncio.gather(self.prefill_pool.close(), self.decode_pool.close())

    # ---- a request's life ---------------------------------------------------------------
    async def serve(self, request: generate_pb2.GenerateRequest,
                    deadline: float = 0.0) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The request's path (`_serve`), measured: TTFT, TPOT, end-to-end, outcome, tokens."""
        outcome, last = "error", None
        try:
            async for msg in self._serve(request, deadline):
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
            self.metrics.inc("pdserve_requests_total", outcome=outcome)
            if last is not None and last.finished:
                self._observe(last.timings, last.usage)

    def _observe(self, t: common_pb2.Timings, usage: common_pb2.Usage) -> None:
        m = self.metrics
        m.observe("pdserve_request_ttft_seconds", t.first_token - t.queued)
        m.observe("pdserve_request_e2e_seconds", t.done - t.queued)
        m.observe("pdserve_request_queue_seconds", max(0.0, t.prefill_start - t.queued))
        if usage.completion_tokens > 1:
            m.observe("pdserve_request_tpot_seconds", (t.done - t.first_token) / (usage.completion_tokens - 1))
        m.inc("pdserve_prompt_tokens_total", usage.prompt_tokens)
        m.inc("pdserve_generation_tokens_total", usage.completion_tokens)

    async def _serve(self, request: generate_pb2.GenerateRequest,
                     deadline: float = 0.0) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """1. check, 2. remote prefill (first token; KV leased there), 3. remote decode (the decode
        node pulls the KV from the prefill node), 4. stream, with usage and timings at the end.
        Raises RequestError; deadline is unix seconds (0: none)."""
        timings = common_pb2.Timings(queued=time.time())
        rid = request.request_id or uuid.uuid4().hex
        # 1. check
        prompt, params = self._check(request)
        sampling = sampling_to_proto(params)

        # 2. remote prefill on the least busy healthy prefill node
        prefill = _pick(self.prefill_pool)
        with prefill.track(), self._outstanding(prefill):
            first = await _unary("prefill", prefill.stub.Prefill(
                nodes_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, deadline=deadline),
                timeout=_remaining(deadline)))
        timings.prefill_start, timings.prefill_end = first.prefill_start, first.prefill_end
        timings.first_token = time.time()
        head = generate_pb2.GenerateResponse(request_id=rid, token_ids=[first.first_token_id], text=first.text)
        if first.HasField("logprobs"):
            head.logprobs.append(first.logprobs)
        if first.finished:
            yield _final(head, first.finish_reason, len(prompt), 1, timings)
            return
        yield head

        # 3. remote decode on the least busy healthy decode node; it reads the KV itself
        num_generated = 1
        decode_started = False  # once it streams, the decode node has read the KV and released it
        call = None
        try:
            decode = _pick(self.decode_pool)
            with decode.track(), self._outstanding(decode):
                call = decode.stub.Decode(nodes_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=prompt, output_token_ids=[first.first_token_id],
                    sampling=sampling, kv=first.kv, deadline=deadline, num_emitted_chars=len(first.text)),
                    timeout=_remaining(deadline))
                # 4. stream
                async for part in call:
                    if not decode_started:
                        decode_started = True
                        timings.transfer_start, timings.transfer_end = part.transfer_start, part.transfer_end
                        timings.decode_admitted, timings.kv_transport = part.decode_admitted, part.kv_transport
                        timings.kv_bytes = part.kv_bytes
                    num_generated += len(part.token_ids)
                    msg = generate_pb2.GenerateResponse(request_id=rid, token_ids=part.token_ids, text=part.text,
                                                        logprobs=part.logprobs)
                    yield _final(msg, part.finish_reason, len(prompt), num_generated, timings) if part.finished else msg
        except grpc.aio.AioRpcError as e:
            raise RequestError(e.code(), f"decode: {e.details()}") from None
        finally:
            if call is not None and not call.done():
                call.cancel()  # a cancelled client, or a deadline: the decode node stops and frees
            if not decode_started:  # nobody read the KV: free it on the prefill node now
                await asyncio.shield(self._release_kv(prefill, first.kv.lease_id))

    # ---- steps ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _outstanding(self, endpoint):
        role = "prefill" if endpoint in self.prefill_pool.endpoints else "decode"
        self.metrics.set("pdserve_node_outstanding_requests", endpoint.outstanding, role=role, node=endpoint.address)
        try:
            yield
        finally:
            self.metrics.set("pdserve_node_outstanding_requests", endpoint.outstanding - 1, role=role,
                             node=endpoint.address)

    def _check(self, request: generate_pb2.GenerateRequest) -> tuple[list[int], object]:
        if request.model and request.model != self.model_id:
            raise RequestError(grpc.StatusCode.NOT_FOUND,
                               f"model {request.model!r} is not served here (serving {self.model_id!r})")
        try:
            params = sampling_from_proto(request.sampling)
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
            prompt = apply_chat_template(self.tokenizer, [{"role": m.role, "content": m.content}
                                                          for m in request.messages.messages])
        else:
            prompt = request.prompt
        return prompt_token_ids(self.tokenizer, prompt, self.model_config.vocab_size)

    @staticmethod
    async def _release_kv(prefill, lease_id: str) -> None:
        try:
            await nodes_pb2_grpc.KVPlaneStub(prefill.channel).ReleaseKV(
                nodes_pb2.ReleaseKVRequest(lease_id=lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:  # the lease expires on its own
            log.warning("ReleaseKV %s on %s failed: %s", lease_id, prefill.address, e.code().name)

    # ---- Generation service (grpc.aio) ------------------------------------------------------
    async def Generate(self, request, context):
        try:
            async for msg in self.serve(request, _deadline(context)):
                yield msg
        except RequestError as e:
            await context.abort(e.code, e.details)

    async def GenerateUnary(self, request, context) -> generate_pb2.GenerateResponse:
        try:
            return await self.generate_unary(request, _deadline(context))
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
    async def generate_unary(self, request, deadline: float = 0.0) -> generate_pb2.GenerateResponse:
        whole = generate_pb2.GenerateResponse()
        async for msg in self.serve(request, deadline):
            whole.request_id = msg.request_id
            whole.token_ids.extend(msg.token_ids)
            whole.text += msg.text
            whole.logprobs.extend(msg.logprobs)
            if msg.finished:
                whole.finished, whole.finish_reason = True, msg.finish_reason
                whole.usage.CopyFrom(msg.usage)
                whole.timings.CopyFrom(msg.timings)
        return whole

    def tokenize(self, request) -> generate_pb2.TokenizeResponse:
        try:
            if request.WhichOneof("input") == "messages":
                text = apply_chat_template(self.tokenizer, [{"role": m.role, "content": m.content}
                                                            for m in request.messages.messages])
            else:
                text = request.prompt
            ids = prompt_token_ids(self.tokenizer, text, self.model_config.vocab_size)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return generate_pb2.TokenizeResponse(token_ids=ids, max_model_len=self.max_model_len)

    def list_models(self) -> generate_pb2.ListModelsResponse:
        card = generate_pb2.ModelCard(id=self.model_id, max_model_len=self.max_model_len,
                                      dtype=self.model_config.checkpoint_dtype)
        return generate_pb2.ListModelsResponse(models=[card])


def _pick(pool: EndpointPool):
    try:
        return pool.pick()
    except NoHealthyNode as e:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, str(e)) from None


async def _unary(role: str, call):
    try:
        return await call
    except grpc.aio.AioRpcError as e:
        raise RequestError(e.code(), f"{role}: {e.details()}") from None


def _deadline(context) -> float:
    remaining = context.time_remaining()
    return time.time() + remaining if remaining is not None else 0.0


def _remaining(deadline: float) -> float | None:
    return max(0.001, deadline - time.time()) if deadline else None


def _final(msg: generate_pb2.GenerateResponse, reason: str, prompt_tokens: int, completion_tokens: int,
           timings: common_pb2.Timings) -> generate_pb2.GenerateResponse:
    timings.done = time.time()
    msg.finished, msg.finish_reason = True, reason
    msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens))
    msg.timings.CopyFrom(timings)
    return msg
