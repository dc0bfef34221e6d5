"""A router, prefill nodes and decode nodes as real gRPC servers on localhost sockets, in this
process (each node with its own engine thread)."""

from __future__ import annotations

import asyncio
import contextlib

from decode_node.config import DecodeConfig
from decode_node.server import DecodeNode
from engine import EngineConfig
from kvtransfer.security import NONE
from kvtransfer.shm import ShmOptions
from prefill_node.config import PrefillConfig
from prefill_node.server import PrefillNode
from router.config import RouterConfig
from router.server import Router


def engine_config(model, **kwargs) -> EngineConfig:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("block_size", 4)
    return EngineConfig(model=str(model), **kwargs)


@contextlib.asynccontextmanager
async def local_cluster(
    model,
    num_prefill=1,
    num_decode=1,
    prefill_engine=None,
    decode_engine=None,
    lease_ttl_s=30.0,
    shm=True,
    kv_transport="auto",
    check_interval_s=0.2,
    security=NONE,
    kv_layerwise="auto",
    **router_args,
):
    """router_args: RouterConfig fields."""
    prefills = [
        PrefillNode(
            engine_config(model, **(prefill_engine or {})),
            PrefillConfig(lease_ttl_s=lease_ttl_s),
            security=security,
            kv_options=(ShmOptions(shm),),
        )
        for _ in range(num_prefill)
    ]
    decodes = [
        DecodeNode(
            engine_config(model, **(decode_engine or {})), DecodeConfig(kv_transport=kv_transport), security=security
        )
        for _ in range(num_decode)
    ]
    for node in prefills + decodes:
        await node.start()
    router_args.setdefault("local_prefill", "off")  # these tests follow the KV; test_placement.py the rest
    router = Router(
        str(model),
        [p.address for p in prefills],
        [d.address for d in decodes],
        RouterConfig(port=0, kv_layerwise=kv_layerwise, **router_args),
        check_interval_s=check_interval_s,
        internal_security=security,
    )
    await router.start()
    try:
        yield router, prefills, decodes
    finally:
        await router.stop(0)
        for node in prefills + decodes:
            await node.stop(0)


@contextlib.asynccontextmanager
async def another_router(model, prefills, decodes, **router_args):
    """A second router over the same nodes (as a second router replica under Serve): it knows
    only what the nodes report, nothing of the first router's traffic."""
    router_args.setdefault("local_prefill", "off")
    router = Router(
        str(model),
        [p.address for p in prefills],
        [d.address for d in decodes],
        RouterConfig(port=0, **router_args),
        check_interval_s=0.2,
    )
    await router.start()
    try:
        yield router
    finally:
        await router.stop(0)


def used_blocks(node) -> int:
    return node.llm.block_manager.num_used_blocks


async def wait_for_no_blocks(nodes, timeout=5.0) -> None:
    """Blocks are freed asynchronously (lease release, aborts), and a decode node's stream closes
    just after its last message: wait until all blocks are back and no stream is open."""
    for _ in range(int(timeout / 0.02)):
        if all(used_blocks(n) == 0 and getattr(n, "num_active", 0) == 0 for n in nodes):
            return
        await asyncio.sleep(0.02)
    raise AssertionError({n.address: (used_blocks(n), getattr(n, "num_active", 0)) for n in nodes})


def split_results(model, requests: list[tuple[list[int], object]], **cluster) -> list:
    """Each (prompt, SamplingParams) through a local cluster's router, one after another, after
    which no node holds a block; returns the Completions."""
    from router.client import AsyncClient
    from serving.protocol import sampling_to_proto

    async def scenario():
        async with local_cluster(model, **cluster) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                results = []
                for prompt, params in requests:
                    wire = {f.name: v for f, v in sampling_to_proto(params).ListFields()}
                    results.append(await client.generate(prompt, **wire))
            await wait_for_no_blocks(prefills + decodes)
            return results

    return asyncio.run(scenario())
