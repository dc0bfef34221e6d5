"""The router as a Ray Serve deployment and the application's ingress.

Clients reach it two ways, both speaking the same Generation service:
- through Ray Serve's gRPC proxy (standard ingress; `application` metadata names the app): the
  methods below. The proxy costs about 1 ms per streamed message, so tokens that pile up while a
  message is in flight are merged into the next one (`coalesce`);
- on the replica's own gRPC port (`direct_port`), where streaming costs what it costs under
  `pdserve up`.
Node addresses come from the registry (through Ray), refreshed every `discovery_interval_s`.
"""

import asyncio
import logging
import typing
from collections.abc import AsyncIterator

import grpc
import ray
from fastapi import FastAPI, Request
from ray import serve

from kvtransfer.security import SecurityConfig, authorized
from pdserve_api import generate_pb2
from router.config import RouterConfig
from router.frontend import client_of
from router.openai_api import OpenAIAPI, add_error_handlers
from router.server import RequestError, Router
from serving.metrics import Metrics
from serving.registry import CALL_TIMEOUT_S, Announcement, registry
from serving.tool_calls import join_fragments

log = logging.getLogger(__name__)


async def coalesce(
    stream: AsyncIterator[generate_pb2.GenerateResponse],
) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """Yields the stream's messages, merging those that arrive while the previous one is being
    sent, so a slow consumer gets fewer, fuller messages and no token is dropped or reordered."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump():
        try:
            async for msg in stream:
                await queue.put(msg)
        except BaseException as e:  # re-raised to the consumer
            await queue.put(e)
        await queue.put(done)

    task = asyncio.create_task(pump())
    pending = None  # taken from the queue but not merged: another sample's message, or the end
    try:
        while True:
            item, pending = (pending if pending is not None else await queue.get()), None
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            # merge what queued behind it, within one sample and up to the message that ends it
            while not queue.empty() and not item.finished and not item.finish_reason:
                nxt = queue.get_nowait()
                if nxt is done or isinstance(nxt, BaseException) or nxt.index != item.index:
                    pending = nxt
                    break
                item = _merge(item, nxt)
            yield item
    finally:
        task.cancel()


def _merge(a: generate_pb2.GenerateResponse, b: generate_pb2.GenerateResponse) -> generate_pb2.GenerateResponse:
    merged = generate_pb2.GenerateResponse()
    merged.CopyFrom(b)  # the later one's finish, usage and timings
    del merged.token_ids[:], merged.logprobs[:]
    merged.token_ids.extend(list(a.token_ids) + list(b.token_ids))
    merged.logprobs.extend(list(a.logprobs) + list(b.logprobs))
    merged.text = a.text + b.text
    del merged.tool_calls[:]
    merged.tool_calls.extend(join_fragments(list(a.tool_calls) + list(b.tool_calls)))
    return merged


def _client(grpc_context) -> str:
    """Who is asking, for the rate limit (as on the direct port: router/frontend.py client_of)."""
    return client_of(grpc_context) if grpc_context is not None else ""


def _set_error(grpc_context, e: RequestError) -> typing.NoReturn:
    """Serve's proxy answers with the status set on grpc_context when the method then raises."""
    if grpc_context is not None:
        grpc_context.set_code(e.code)
        grpc_context.set_details(e.details)
    raise e


# The OpenAI-compatible HTTP API, through Serve's HTTP proxy (http_options.port). (No
# `from __future__ import annotations` in this module: FastAPI resolves `Request` from the
# methods' annotations, which must be real classes once Serve ships the class to a replica.)
http_app = FastAPI(title="pdserve OpenAI-compatible API", docs_url=None, redoc_url=None)
add_error_handlers(http_app)


@serve.deployment(name="Router", ray_actor_options={"num_cpus": 0})
@serve.ingress(http_app)
class RouterDeployment:
    async def __init__(
        self,
        app_name: str,
        model: str,
        config: RouterConfig = RouterConfig(),
        security: SecurityConfig = SecurityConfig(),
        pools=(),
    ):
        # pools: the prefill and decode deployments' handles (bound so that they deploy with us).
        self._watch: asyncio.Task | None = None
        self.announcement: Announcement | None = None
        # The direct port is preferred, not required: a second router replica on one host takes
        # another, and announces it in the registry (role "router") with the host's IP.
        self.router = Router(
            model,
            [],
            [],
            config,
            host=config.host,
            check_interval_s=1.0,
            metrics=Metrics("ray"),
            internal_security=security.security(),
            any_port_if_taken=True,
        )
        await self.router.start()
        self.openai = OpenAIAPI(self.router, self.router.api_keys)
        self.accepted = tuple(f"Bearer {k}".encode() for k in self.router.api_keys)
        self.registry = registry(app_name)
        self.discovery_interval_s = config.discovery_interval_s
        try:
            await self._discover()
        except Exception:  # the registry restarting: the watch below tries again
            log.exception("node discovery failed")
        self._watch = asyncio.create_task(self._watch_registry())
        port = self.router.address.rsplit(":", 1)[1]
        replica = serve.get_replica_context().replica_id.unique_id
        self.announcement = Announcement(app_name, "router", replica, f"{ray.util.get_node_ip_address()}:{port}")
        await self.announcement.start()

    async def _discover(self) -> None:
        nodes = await asyncio.wait_for(self.registry.snapshot.remote(), CALL_TIMEOUT_S)
        if not nodes["settled"]:  # a registry restarted moments ago: its replicas still renewing
            return
        await self.router.prefill_pool.update(nodes["prefill"])
        await self.router.decode_pool.update(nodes["decode"])

    async def _watch_registry(self) -> None:
        while True:
            await asyncio.sleep(self.discovery_interval_s)
            try:
                await self._discover()
            except Exception:  # the registry restarts (max_restarts=-1); keep the last view
                log.exception("node discovery failed")

    async def direct_address(self) -> str:
        return self.router.address

    # ---- the OpenAI-compatible HTTP API, through Serve's HTTP proxy ----------------------------
    @http_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self.openai.completions(request)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self.openai.chat_completions(request)

    @http_app.get("/v1/models")
    async def models(self, request: Request):
        return await self.openai.models(request)

    @http_app.get("/health")
    async def health(self, request: Request):
        return await self.openai.health(request)

    # ---- the Generation service, through Serve's gRPC proxy --------------------------------
    def _authorization(self, grpc_context) -> str:
        """The request's API key (metadata authorization: Bearer <key>); refused with
        UNAUTHENTICATED where the router has keys and this is none of them (as on the direct port)."""
        given = dict(grpc_context.invocation_metadata() or ()).get("authorization", "") if grpc_context else ""
        if self.accepted and not authorized(given, self.accepted):
            _set_error(
                grpc_context,
                RequestError(
                    grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key (metadata authorization: Bearer <key>)"
                ),
            )
        return given

    async def Generate(self, request: generate_pb2.GenerateRequest, grpc_context=None):
        try:
            key = self._authorization(grpc_context)
            async for msg in coalesce(self.router.serve(request, client=_client(grpc_context), authorization=key)):
                yield msg
        except RequestError as e:
            _set_error(grpc_context, e)

    async def GenerateUnary(self, request: generate_pb2.GenerateRequest, grpc_context=None):
        try:
            key = self._authorization(grpc_context)
            return await self.router.generate_unary(request, client=_client(grpc_context), authorization=key)
        except RequestError as e:
            _set_error(grpc_context, e)

    async def Tokenize(self, request: generate_pb2.TokenizeRequest, grpc_context=None):
        try:
            self._authorization(grpc_context)
            return self.router.tokenize(request)
        except RequestError as e:
            _set_error(grpc_context, e)

    async def ListModels(self, request: generate_pb2.ListModelsRequest, grpc_context=None):
        try:
            self._authorization(grpc_context)
            return self.router.list_models()
        except RequestError as e:
            _set_error(grpc_context, e)

    async def __del__(self):
        """Serve's shutdown, also of a replica whose __init__ failed half-way."""
        if self._watch is not None:
            self._watch.cancel()
        if self.announcement is not None:
            await self.announcement.stop()
        if hasattr(self, "router"):
            await self.router.stop(5.0)
