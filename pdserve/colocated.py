"""`pdserve colocated`: one engine doing both phases (prefill chunks mixed into the decode batch, as
a single vLLM instance does), behind the same Generation service as the router. The baseline
disaggregated serving is compared with on equal hardware.

    pdserve colocated --port 50051 [engine options]
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from engine import EngineConfig, LLMEngine
from kvtransfer.security import NONE, Security
from pdserve_api import common_pb2, generate_pb2, generate_pb2_grpc
from router.config import RouterConfig
from router.frontend import Frontend, RequestError, final_message
from serving.metrics import Metrics
from serving.node import EngineServer
from serving.options import from_args
from serving.process import pin_cpus, run_until_signalled, setup_logging
from serving.protocol import logprobs_to_proto


class ColocatedServer(EngineServer, Frontend):
    role = "colocated"

    def __init__(
        self,
        config: EngineConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics: Metrics | None = None,
        security: Security = NONE,
    ):
        llm = LLMEngine(config)
        EngineServer.__init__(self, llm, host, port, security, metrics)
        Frontend.__init__(self, config.model, llm.max_model_len, self.metrics)
        self.server.add(
            generate_pb2_grpc.add_GenerationServicer_to_server,
            self,
            generate_pb2.DESCRIPTOR.services_by_name["Generation"],
        )

    def num_open(self) -> int:
        return len(self.llm.requests)

    async def _serve(
        self, request: generate_pb2.GenerateRequest, deadline: float = 0.0
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """1. check, 2. prefill and decode in the one engine, 3. stream."""
        timings = common_pb2.Timings(queued=time.time())
        rid = uuid.uuid4().hex  # its own: a client's id only labels the answer, so two cannot collide
        prompt, params = self._check(request)
        n = 0
        try:
            async for out in self.engine.stream(rid, lambda: self.llm.add_request(rid, prompt, params)):
                if n == 0:
                    timings.prefill_start = timings.queued
                    timings.first_token = timings.prefill_end = time.time()
                    timings.cached_tokens, timings.prefill_node = out.num_cached_tokens, self.address
                n += len(out.new_token_ids)
                msg = generate_pb2.GenerateResponse(
                    request_id=request.request_id or rid,
                    token_ids=out.new_token_ids,
                    text=out.new_text,
                    index=out.index,
                    finish_reason=out.finish_reason or "",
                )
                if out.logprobs:  # one entry per new token (several after a verified draft)
                    msg.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs[-len(out.new_token_ids) :])
                yield final_message(msg, out.finish_reason, len(prompt), n, timings) if out.last else msg
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def run(args) -> int:
    """`pdserve colocated`: serves until SIGTERM or SIGINT (its options: pdserve/cli.py)."""
    setup_logging()
    pin_cpus(args.cpus)
    port = from_args(RouterConfig, args).port
    asyncio.run(
        run_until_signalled(
            lambda: ColocatedServer(from_args(EngineConfig, args), args.host, port), metrics_port=args.metrics_port
        )
    )
    return 0
