"""A dead engine says so (docs/reliability.md, security and faults): once a node's engine loop
dies (a step raised), its gRPC health and liveness answer NOT_SERVING, the router sends its work
elsewhere, and the node's process exits with status 1 for `pdserve up` or Serve to restart it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from cluster import engine_config, local_cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_node.config import DecodeConfig
from decode_node.server import DecodeNode
from engine import SamplingParams
from router.client import AsyncClient
from serving.grpc_server import LIVENESS
from serving.process import run_until_signalled

HANG_S = 300  # a guard against a hang, far above a slow machine's time
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def kill_engine(node) -> None:
    """The node's next engine step raises, as a device fault or a bug would; a request makes it step."""

    def broken():
        raise RuntimeError("injected: the step failed")

    node.llm.step = broken
    await node.engine.call(node.llm.add_request, "poke", [1, 2, 3], SamplingParams(max_tokens=2))


async def health(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
        return reply.status


async def until(condition, timeout: float) -> None:
    for _ in range(int(timeout / 0.05)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def test_a_dead_engine_reports_not_serving_and_the_router_goes_elsewhere(tiny_llama):
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}

    async def scenario():
        async with local_cluster(tiny_llama, num_decode=2, check_interval_s=0.1) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                want = await client.generate([1, 2, 3, 4], **params)
                await kill_engine(decodes[0])
                await until(lambda: _all_not_serving(decodes[0].address), timeout=60)
                assert decodes[0].dead.is_set()
                await until(lambda: _router_dropped(router, decodes[0].address), timeout=60)
                for _ in range(4):  # every one on the live node
                    assert (await client.generate([1, 2, 3, 4], **params)).token_ids == want.token_ids

    asyncio.run(asyncio.wait_for(scenario(), HANG_S))


async def _all_not_serving(address: str) -> bool:
    return all([await health(address, s) == NOT_SERVING for s in ("", LIVENESS, "pdserve.v1.DecodeNode")])


async def _router_dropped(router, address: str) -> bool:
    return not any(e.healthy for e in router.decode_pool.endpoints if e.address == address)


def test_the_process_exits_with_status_1_when_its_engine_dies(tiny_llama):
    """run_until_signalled, what `python -m decode_node` runs: no signal comes, the engine dies."""
    nodes = []

    def make_node():
        nodes.append(DecodeNode(engine_config(tiny_llama), DecodeConfig()))
        return nodes[0]

    async def scenario():
        runner = asyncio.ensure_future(run_until_signalled(make_node))
        while not nodes or not nodes[0].server.address.split(":")[-1].isdigit():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        await kill_engine(nodes[0])
        await runner

    with pytest.raises(SystemExit) as exit_:
        asyncio.run(asyncio.wait_for(scenario(), HANG_S))
    assert exit_.value.code == 1
