"""The colocated baseline: one engine doing both phases (prefill chunks mixed into the decode
batch, as a single vLLM instance does), behind the same Generation service. For comparing
disaggregated serving against it on equal hardware.

    python -m router.colocated --port 50051 [engine args]
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from engine import EngineConfig, LLMEngine
from engine.async_engine import AsyncEngine
from pdserve.grpc_server import GrpcServer
from pdserve.metrics import EngineExporter, Metrics
from pdserve.protocol import logprobs_to_proto
from pdserve.security import NONE, Security
from pdserve_api import common_pb2, generate_pb2, generate_pb2_grpc
from router.frontend import Frontend, RequestError, final_message


class ColocatedServer(Frontend):
    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 0, metrics: Metrics | None = None,
                 security: Security = NONE):
        engine = LLMEngine(config)
        super().__init__(config.model, engine.max_model_len, metrics)
        self.engine = AsyncEngine(engine)
        self.exporter = EngineExporter(self.metrics, "colocated", self.engine, lambda: len(engine.requests))
        self.server = GrpcServer(host, port, security)
        self.server.add(generate_pb2_grpc.add_GenerationServicer_to_server, self,
                        generate_pb2.DESCRIPTOR.services_by_name["Generation"])

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await self.server.start()
        self._export = asyncio.create_task(self.exporter.run())

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        self._export.cancel()
        self.engine.stop()

    async def _serve(self, request: generate_pb2.GenerateRequest,
                     deadline: float = 0.0) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """1. check, 2. prefill and decode in the one engine, 3. stream."""
        timings = common_pb2.Timings(queued=time.time())
        rid = request.request_id or uuid.uuid4().hex
        prompt, params = self._check(request)
        engine = self.engine.engine
        n = 0
        try:
            async for out in self.engine.stream(rid, lambda: engine.add_request(rid, prompt, params)):
                if n == 0:
                    timings.prefill_start = timings.queued
                    timings.first_token = timings.prefill_end = time.time()
                    timings.cached_tokens, timings.prefill_node = out.num_cached_tokens, self.address
                n += len(out.new_token_ids)
                msg = generate_pb2.GenerateResponse(request_id=rid, token_ids=out.new_token_ids, text=out.new_text,
                                                    index=out.index, finish_reason=out.finish_reason or "")
                if out.logprobs:  # one entry per new token (several after a verified draft)
                    msg.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs[-len(out.new_token_ids):])
                yield final_message(msg, out.finish_reason, len(prompt), n, timings) if out.last else msg
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def main() -> None:
    import argparse

    from pdserve.cli import HelpFormatter, add_engine_args, engine_config
    from pdserve.process import pin_cpus, run_until_signalled, setup_logging

    ap = argparse.ArgumentParser(prog="router.colocated", formatter_class=HelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="the interface to listen on")
    ap.add_argument("--port", type=int, default=0, help="the gRPC port (0: any, printed in the READY line)")
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="serve Prometheus /metrics here (0: any port) (default: no metrics server)")
    add_engine_args(ap)
    args = ap.parse_args()
    setup_logging()
    pin_cpus(args.cpus)
    asyncio.run(run_until_signalled(lambda: ColocatedServer(engine_config(args), args.host, args.port),
                                    metrics_port=args.metrics_port))


if __name__ == "__main__":
    main()
