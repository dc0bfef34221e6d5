"""The disaggregated path end to end: real gRPC servers on localhost sockets, tiny random model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import pytest
import torch
from cluster import another_router, local_cluster, used_blocks, wait_for_no_blocks
from conftest import engine_alone, make_engine, run_to_completion
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from engine.config import DECODE_NODE_PREFILL_TOKENS
from pdserve_api import common_pb2, nodes_pb2, nodes_pb2_grpc
from router.client import AsyncClient

PROMPTS = [[5, 17, 33, 8, 90, 41, 7, 99, 100, 3, 4], [200, 3], list(range(11, 40)), [64, 65, 66]]
GREEDY = dict(max_tokens=16, temperature=0, ignore_eos=True)
# Told to read over tcp, a decode node gets the KV layer by layer (router kv_layerwise auto).
TRANSPORTS = {
    "shm": dict(kv_transport="shm"),
    "tcp-layerwise": dict(kv_transport="tcp"),
    "tcp": dict(kv_transport="tcp", kv_layerwise="off"),
    "grpc": dict(kv_transport="grpc"),
}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return engine_alone(tiny_llama, PROMPTS, **GREEDY)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_disaggregated_equals_engine_alone_equals_transformers(tiny_llama, reference, transport):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for p, ref in zip(PROMPTS, reference):
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=hf.config.vocab_size, pad_token_id=0
        )
        assert out[0, len(p) :].tolist() == ref

    async def scenario():
        async with local_cluster(tiny_llama, **TRANSPORTS[transport]) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                for p, ref in zip(PROMPTS, reference):
                    result = await client.generate(p, **GREEDY)
                    assert result.token_ids == ref
                    assert result.timings["kv_transport"] == transport
                    assert result.usage == {"prompt_tokens": len(p), "completion_tokens": 16}
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_prefill_and_decode_with_different_block_sizes(tiny_llama, reference):
    async def scenario():
        async with local_cluster(
            tiny_llama, prefill_engine={"block_size": 8}, decode_engine={"block_size": 4}, kv_transport="auto"
        ) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                result = await client.generate(PROMPTS[2], **GREEDY)
                assert result.token_ids == reference[2]
                assert result.timings["kv_transport"] == "tcp"  # shm needs one block layout; auto then picks tcp
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_streaming_is_in_order_and_equals_unary(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                parts = [
                    part
                    async for part in client.stream(
                        "Hello world", max_tokens=12, temperature=0, ignore_eos=True, logprobs=2
                    )
                ]
                unary = await client.generate_unary(
                    "Hello world", max_tokens=12, temperature=0, ignore_eos=True, logprobs=2
                )
        assert len(parts) >= 2 and all(not p.finished for p in parts[:-1]) and parts[-1].finished
        assert [t for p in parts for t in p.token_ids] == unary.token_ids
        assert "".join(p.text for p in parts) == unary.text
        assert sum(len(p.logprobs) for p in parts) == 12 == len(unary.logprobs)
        assert unary.finish_reason == "length" and unary.usage["completion_tokens"] == 12

    asyncio.run(scenario())


@pytest.mark.parametrize("kv_transport", ["shm", "tcp"])
def test_a_one_token_answer_has_the_text_of_the_engine_alone(tiny_llama, kv_transport):
    """A first token that ends the request (max_tokens 1, or a stop token) ends at the prefill
    node: its text is final there, an incomplete character flushed as U+FFFD as the engine alone
    does (it was held back for a decode that never came: '')."""
    engine = make_engine(tiny_llama)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    for start in range(10, 200):  # a prompt whose greedy first token is an incomplete character
        engine.add_request(str(start), [start, start + 1, start + 2], greedy)
        out = run_to_completion(engine)[str(start)]
        if out.text == "\ufffd":
            break
    else:
        pytest.fail("no prompt found")

    async def scenario():
        async with local_cluster(tiny_llama, kv_transport=kv_transport) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                prompt = [start, start + 1, start + 2]
                return (
                    await client.generate(prompt, max_tokens=1, temperature=0),
                    await client.generate(prompt, max_tokens=5, temperature=0, stop_token_ids=out.token_ids),
                )

    at_max, stopped = asyncio.run(scenario())
    assert (at_max.text, at_max.finish_reason) == ("\ufffd", "length")
    assert (stopped.token_ids, stopped.text, stopped.finish_reason) == (out.token_ids, "\ufffd", "stop")


@pytest.mark.parametrize("local_prefill", ["off", "auto"])
def test_32_concurrent_requests_over_1_prefill_and_2_decodes(tiny_llama, local_prefill):
    """off: every prefill remote, so every KV crosses; auto (what users run): the router places each."""
    prompts = [[(7 * i + j) % 300 + 1 for j in range(3 + i % 13)] for i in range(32)]
    expected = engine_alone(tiny_llama, prompts, **GREEDY)

    async def scenario():
        async with local_cluster(tiny_llama, num_prefill=1, num_decode=2, local_prefill=local_prefill) as (
            router,
            prefills,
            decodes,
        ):
            async with AsyncClient(router.address) as client:
                results = await asyncio.gather(*(client.generate(p, **GREEDY) for p in prompts))
            assert [r.token_ids for r in results] == expected
            await wait_for_no_blocks(prefills + decodes)
            return results

    results = asyncio.run(scenario())
    ports = {r.timings.get("kv_transport") for r in results}
    assert ports == {"shm"} if local_prefill == "off" else ports <= {"shm", None, ""}


def test_least_outstanding_spreads_decodes(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama, num_prefill=1, num_decode=2) as (router, prefills, decodes):
            counts = {d.address: 0 for d in decodes}
            original = router.decode_pool.pick

            def counting_pick(*args, **kwargs):
                e = original(*args, **kwargs)
                counts[e.address] += 1
                return e

            router.decode_pool.pick = counting_pick
            async with AsyncClient(router.address) as client:
                await asyncio.gather(*(client.generate(PROMPTS[0], max_tokens=30, ignore_eos=True) for _ in range(8)))
            assert all(c >= 2 for c in counts.values()), counts

    asyncio.run(scenario())


def test_cancellation_mid_stream_frees_blocks_on_both_sides(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                stream = client.stream(PROMPTS[2], max_tokens=200, temperature=0, ignore_eos=True)
                got = 0
                async for part in stream:
                    got += len(part.token_ids)
                    if got >= 5:
                        assert used_blocks(decodes[0]) > 0
                        break
                await stream.aclose()
            await wait_for_no_blocks(prefills + decodes)
            assert decodes[0].llm.requests == {}

    asyncio.run(scenario())


def test_deadline_stops_the_work_and_frees_blocks(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama, decode_engine={"max_num_seqs": 1}) as (router, prefills, decodes):
            async with AsyncClient(router.address, timeout=0.3) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:  # 1000 decode steps take well over 0.3 s
                    await client.generate(PROMPTS[0], max_tokens=1000, ignore_eos=True)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_bad_inputs_get_their_status_codes(tiny_llama):
    cases = [
        (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty"),
        (dict(prompt=[1] * 2000), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
        (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(prompt="hi", temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(prompt="hi", top_p=0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (dict(prompt="hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (dict(prompt="hi", top_k=-2), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (dict(prompt=[5, 999999]), grpc.StatusCode.INVALID_ARGUMENT, "prompt token ids"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
        (dict(prompt="hi", model="gpt-17"), grpc.StatusCode.NOT_FOUND, "gpt-17"),
    ]

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                for kwargs, code, words in cases:
                    prompt = kwargs.pop("prompt", None)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate(prompt, **kwargs)
                    assert err.value.code() == code, (kwargs, err.value)
                    assert words in err.value.details(), (kwargs, err.value.details())
                assert (await client.generate([5, 6], max_tokens=2)).usage["completion_tokens"] == 2
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_no_healthy_node_is_unavailable(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            await decodes[0].server.set_serving(False)  # e.g. draining
            for _ in range(50):
                if not router.decode_pool.endpoints[0].healthy:
                    break
                await asyncio.sleep(0.1)
            async with AsyncClient(router.address) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate(PROMPTS[0], max_tokens=4)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "no healthy decode node" in err.value.details()
                await decodes[0].server.set_serving(True)
                for _ in range(50):
                    if router.decode_pool.endpoints[0].healthy:
                        break
                    await asyncio.sleep(0.1)
                assert (await client.generate(PROMPTS[0], max_tokens=4)).finish_reason == "length"
            await wait_for_no_blocks(prefills + decodes)  # the refused request's lease was released

    asyncio.run(scenario())


def test_unread_kv_lease_expires(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama, lease_ttl_s=0.3) as (router, prefills, decodes):
            channel = grpc.aio.insecure_channel(prefills[0].address)
            reply = await nodes_pb2_grpc.PrefillNodeStub(channel).Prefill(
                nodes_pb2.PrefillRequest(
                    request_id="orphan", prompt_token_ids=PROMPTS[2], sampling=common_pb2.SamplingParams(max_tokens=5)
                )
            )
            assert reply.kv.lease_id and used_blocks(prefills[0]) > 0
            await wait_for_no_blocks(prefills, timeout=3)  # nobody read it: the lease expired
            released = await nodes_pb2_grpc.PrefillNodeStub(channel).ReleaseKV(
                nodes_pb2.ReleaseKVRequest(lease_id=reply.kv.lease_id, access_key=reply.kv.access_key)
            )
            assert not released.released
            await channel.close()

    asyncio.run(scenario())


def test_ending_a_lease_leaves_another_lease_on_the_same_cached_blocks_readable(tiny_llama):
    """Two prefills of one prompt share its cached blocks (prefix caching): the first lease's end
    must not refuse a shared-memory read of the second (generations move when a block is reused)."""
    from kvtransfer.layout import KVLayout
    from kvtransfer.shm import ShmReader

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            channel = grpc.aio.insecure_channel(prefills[0].address)
            stub = nodes_pb2_grpc.PrefillNodeStub(channel)
            ask = nodes_pb2.PrefillRequest(
                prompt_token_ids=PROMPTS[2], sampling=common_pb2.SamplingParams(max_tokens=5)
            )
            first, second = [await stub.Prefill(ask) for _ in range(2)]
            assert set(first.kv.block_ids[:4]) == set(second.kv.block_ids[:4])  # shared, cached blocks
            await stub.ReleaseKV(nodes_pb2.ReleaseKVRequest(lease_id=first.kv.lease_id, access_key=first.kv.access_key))
            dst = decodes[0].llm.kv_cache
            blocks = list(range(len(second.kv.block_ids)))
            await ShmReader().read(second.kv, dst, KVLayout.from_proto(second.kv.layout), blocks)
            src = prefills[0].llm.kv_cache
            n = second.kv.num_tokens
            assert torch.equal(dst.export_kv(blocks, n), src.export_kv(list(second.kv.block_ids), n))
            await stub.ReleaseKV(
                nodes_pb2.ReleaseKVRequest(lease_id=second.kv.lease_id, access_key=second.kv.access_key)
            )
            await channel.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "decode_engine, kv_transport, says",
    [
        ({"dtype": "bfloat16"}, "auto", "dtype: decode 'bfloat16', prefill 'float32'"),
        ({"deterministic": True}, "shm", "numerics: decode 'deterministic ("),
        ({"deterministic": True}, "tcp", "prefill 'default'"),
    ],
)
def test_layout_mismatch_is_refused(tiny_llama, decode_engine, kv_transport, says):
    """Before a byte moves: KV of another dtype, or computed in another numerics mode."""

    async def scenario():
        cluster = local_cluster(tiny_llama, decode_engine=decode_engine, kv_transport=kv_transport)
        async with cluster as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate(PROMPTS[0], max_tokens=4)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert says in err.value.details()
                assert "model_fingerprint" not in err.value.details()  # same checkpoint
            await wait_for_no_blocks(prefills + decodes)

    asyncio.run(scenario())


def test_every_server_has_health_and_reflection(tiny_llama):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            for server, service in [
                (router, "pdserve.v1.Generation"),
                (prefills[0], "pdserve.v1.PrefillNode"),
                (prefills[0], "pdserve.v1.KVPlane"),
                (decodes[0], "pdserve.v1.DecodeNode"),
            ]:
                async with grpc.aio.insecure_channel(server.address) as channel:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=service)
                    )
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                    responses = stub.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                    )
                    names = [s.name async for r in responses for s in r.list_services_response.service]
                    assert service in names and "grpc.health.v1.Health" in names

    asyncio.run(scenario())


def test_colocated_baseline_serves_the_same_tokens(tiny_llama, reference):
    from cluster import engine_config

    from pdserve.colocated import ColocatedServer

    async def scenario():
        server = ColocatedServer(engine_config(tiny_llama))
        await server.start()
        try:
            async with AsyncClient(server.address) as client:
                results = await asyncio.gather(*(client.generate(p, **GREEDY) for p in PROMPTS))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await client.generate("", max_tokens=3)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await server.stop(0)
        assert [r.token_ids for r in results] == reference
        assert server.metrics.sample("pdserve_requests_total", outcome="ok") == len(PROMPTS)

    asyncio.run(scenario())


def test_an_unreachable_prefill_node_is_retried_on_another(tiny_llama, reference):
    async def scenario():
        async with local_cluster(tiny_llama, num_prefill=2, check_interval_s=60) as (router, prefills, decodes):
            await prefills[0].stop(0)  # gone, and the router has not noticed yet
            async with AsyncClient(router.address) as client:
                results = [await client.generate(p, **GREEDY) for p in PROMPTS]
            assert [r.token_ids for r in results] == reference
            assert not router.prefill_pool.endpoints[0].healthy

    asyncio.run(scenario())


@pytest.mark.parametrize("local_prefill", ["auto", "off"])
def test_with_the_last_prefill_node_unreachable_the_decode_node_prefills_where_it_may(
    tiny_llama, reference, local_prefill
):
    """auto: the first request tries the prefill node (nothing measured yet), finds it gone and
    prefills on the decode node; so do the rest. off: a clear UNAVAILABLE."""

    async def scenario():
        async with local_cluster(tiny_llama, check_interval_s=60, local_prefill=local_prefill) as (router, prefills, _):
            await prefills[0].stop(0)  # gone, and the router has not noticed yet
            async with AsyncClient(router.address) as client:
                if local_prefill == "off":
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.generate(PROMPTS[0], **GREEDY)
                    details = err.value.details()  # the cause, and that no other node is left
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy prefill node" in details
                    assert details.startswith("prefill: ") and len(details) > len("prefill:  (no healthy")
                    return
                results = [await client.generate(p, **GREEDY) for p in PROMPTS]
            assert [r.token_ids for r in results] == reference  # fp32
            assert all(r.timings.get("local_prefill") for r in results)
            assert not router.prefill_pool.endpoints[0].healthy

    asyncio.run(scenario())


def test_a_local_prefill_beside_decodes_goes_a_chunk_a_step_and_answers_the_same(tiny_llama, tmp_path):
    """A decode node computes a prompt beside its decoding sequences DECODE_NODE_PREFILL_TOKENS a
    step by default (each step stalls them for a chunk, not the whole prompt); the answer is the
    engine alone's (fp32)."""
    prompt = [(j * 31) % 270 + 13 for j in range(150)]
    want = engine_alone(tiny_llama, [prompt], **GREEDY)[0]
    log = tmp_path / "steps.jsonl"

    async def scenario():
        async with local_cluster(tiny_llama, local_prefill="always", decode_engine={"step_log": str(log)}) as (
            router,
            _,
            decodes,
        ):
            assert decodes[0].llm.config.prefill_tokens_with_decodes == DECODE_NODE_PREFILL_TOKENS
            async with AsyncClient(router.address) as client:
                # (1,000 steps of decoding: the prompt's few steps come long before its end, however busy the machine)
                decoding = client.stream([5, 6, 7, 8], max_tokens=1000, temperature=0, ignore_eos=True)
                await anext(decoding)  # decoding on the node
                result = await client.generate(prompt, **GREEDY)
                await decoding.aclose()
                return result

    assert asyncio.run(scenario()).token_ids == want
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    beside = [n for step in steps if step["decodes"] for n, _ in step["prefills"]]
    assert sum(beside) == len(prompt), steps
    assert max(beside) == DECODE_NODE_PREFILL_TOKENS, beside


# ---- layer-wise KV streaming -----------------------------------------------------------------
def slow_layers(node, seconds: float) -> None:
    """Each layer of the node's forward takes `seconds` longer: time to act inside a prefill."""
    model = node.llm.runner.model
    forward = model.forward

    def slowed(ids, positions, meta, kv_cache, layer_done=None):
        def done(layer):
            time.sleep(seconds)
            if layer_done is not None:
                layer_done(layer)

        return forward(ids, positions, meta, kv_cache, done)

    model.forward = slowed


def test_layerwise_decode_reads_the_kv_while_the_prefill_computes(tiny_llama, reference):
    async def scenario():
        async with local_cluster(tiny_llama, kv_transport="tcp") as (router, prefills, decodes):
            slow_layers(prefills[0], 0.2)
            async with AsyncClient(router.address) as client:
                result = await client.generate(PROMPTS[0], **GREEDY)
            assert result.token_ids == reference[0]
            t = result.timings
            assert t["kv_transport"] == "tcp-layerwise"
            assert t["transfer_start"] < t["prefill_end"] - 0.2  # reading began a layer or more before the end
            await wait_for_no_blocks(prefills + decodes)
            assert len(prefills[0].leases) == 0

    asyncio.run(scenario())


def test_layerwise_prefill_cancelled_or_finished_at_once_frees_both_sides(tiny_llama):
    async def scenario():
        async with local_cluster(tiny_llama, kv_transport="tcp") as (router, prefills, decodes):
            slow_layers(prefills[0], 0.3)
            async with AsyncClient(router.address) as client:
                # cancelled while the decode node reads layer by layer
                stream = client.stream(PROMPTS[2], max_tokens=50, temperature=0, ignore_eos=True)
                task = asyncio.ensure_future(stream.__anext__())
                reading = False
                for _ in range(100):
                    reading = len(prefills[0].leases) == 1 and used_blocks(decodes[0]) > 0
                    if reading:
                        break
                    await asyncio.sleep(0.01)
                assert reading and not task.done()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await wait_for_no_blocks(prefills + decodes)
                for _ in range(3000):  # released while its read pinned it: gone once the read ends
                    if not len(prefills[0].leases):
                        break
                    await asyncio.sleep(0.01)
                assert len(prefills[0].leases) == 0 and decodes[0].num_active == 0
                # the first token ends the request (max_tokens 1): the prefill node answers with no KV,
                # and the decode node is not asked to read any
                stub, calls = router.decode_pool.endpoints[0].stub, []
                decode_call = stub.Decode
                stub.Decode = lambda *args, **kwargs: calls.append(args) or decode_call(*args, **kwargs)
                result = await client.generate(PROMPTS[1], max_tokens=1, temperature=0)
                assert len(result.token_ids) == 1 and result.finish_reason == "length" and not calls
            await wait_for_no_blocks(prefills + decodes)
            assert len(prefills[0].leases) == 0 and decodes[0].num_active == 0

    asyncio.run(scenario())


def test_a_long_step_does_not_make_a_node_look_dead(tiny_llama):
    """GetLoad (part of the router's health check) answers during a step, however long the step."""

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            slow_layers(prefills[0], 1.0)  # a 2-second prefill step
            async with AsyncClient(router.address) as client:
                request = asyncio.ensure_future(client.generate(PROMPTS[0], max_tokens=2, temperature=0))
                await asyncio.sleep(0.5)
                async with grpc.aio.insecure_channel(prefills[0].address) as channel:
                    load = await nodes_pb2_grpc.PrefillNodeStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=0.5)
                assert load.num_running == 1 and not request.done()
                assert router.prefill_pool.healthy()
                await request

    asyncio.run(scenario())


def test_a_slow_first_token_is_logged_with_where_it_waited(tiny_llama, monkeypatch, caplog):
    """Past SLOW_FIRST_TOKEN_S the router logs the request's timeline: each step's time since it
    arrived, and where the prefill ran (a hang or a queue is found from the log, not guessed)."""
    import router.frontend as frontend

    monkeypatch.setattr(frontend, "SLOW_FIRST_TOKEN_S", 0.0)

    async def scenario():
        async with local_cluster(tiny_llama) as (router, prefills, decodes):
            async with AsyncClient(router.address) as client:
                await client.generate(PROMPTS[0], max_tokens=3, temperature=0)
            return prefills[0].address, decodes[0].address

    with caplog.at_level("WARNING", logger="router.frontend"):
        prefill, decode = asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow first token")]
    assert len(lines) == 1, lines
    steps = ("prefill_start", "prefill_end", "transfer_start", "transfer_end", "decode_admitted", "first_token", "done")
    assert (
        all(f"{step} +" in lines[0] for step in steps) and f"(prefill on {prefill}; decode on {decode})" in lines[0]
    ), lines[0]


async def _until_known(pool, prompt: list[int], guard_s: float = 120.0) -> None:
    """Until some node of the pool has reported caching the prompt's history (a guard, not a
    speed check: reports come with every health check, 0.2 s apart here)."""
    began = time.monotonic()
    while not any(pool.cached_tokens(e, prompt) >= 36 for e in pool.endpoints):
        assert time.monotonic() < began + guard_s, "the nodes' cache reports never reached the router"
        await asyncio.sleep(0.05)


def test_a_second_router_routes_by_what_the_nodes_report_caching(tiny_llama):
    """Two routers over the same nodes (as two router replicas under Serve): histories sent
    through one, their follow-ups through the other go to the prefill node that caches the
    history. The second router learns the caches from the nodes' load reports, not from its own
    traffic (it sent none). Four histories: a blind pick would match all four 1 time in 16."""
    histories = [[(k * 53 + j * 7) % 280 + 11 for j in range(40)] for k in range(4)]

    async def scenario():
        async with local_cluster(tiny_llama, num_prefill=2) as (first, prefills, decodes):
            async with another_router(tiny_llama, prefills, decodes) as second:
                async with AsyncClient(first.address) as a, AsyncClient(second.address) as b:
                    placed = [(await a.generate(h, max_tokens=2, temperature=0)).timings for h in histories]
                    for h in histories:  # the second router's view, from the nodes' load reports
                        await _until_known(second.prefill_pool, h + [5, 6])
                    follow = [(await b.generate(h + [5, 6], max_tokens=2, temperature=0)).timings for h in histories]
                    return placed, follow

    placed, follow = asyncio.run(scenario())
    assert len({t["prefill_node"] for t in placed}) == 2, placed  # both nodes hold some history
    for p, f in zip(placed, follow):
        assert f["prefill_node"] == p["prefill_node"] and int(f.get("cached_tokens", 0)) >= 36, (p, f)


def test_a_second_router_prefills_a_follow_up_on_the_decode_node_caching_its_history(tiny_llama):
    """Conditional disaggregation across two routers: a history sent through one router, its
    follow-up through the other is prefilled on the decode node (only the new tokens computed):
    the second router knows the decode node's cache from its reports. (The second router first
    measures one remote prefill of its own: until then it places every prefill remotely.)"""
    history = [(j * 29) % 270 + 13 for j in range(40)]
    engine = make_engine(tiny_llama)
    engine.add_request("f", history + [5, 6], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    want = run_to_completion(engine)["f"].token_ids

    async def scenario():
        async with local_cluster(tiny_llama, local_prefill="auto") as (first, prefills, decodes):
            async with another_router(tiny_llama, prefills, decodes, local_prefill="auto") as second:
                async with AsyncClient(first.address) as a, AsyncClient(second.address) as b:
                    await a.generate(history, max_tokens=4, temperature=0, ignore_eos=True)
                    await b.generate([9, 8, 7, 6, 5, 4, 3, 2], max_tokens=4, temperature=0, ignore_eos=True)
                    await _until_known(second.decode_pool, history + [5, 6])
                    return await b.generate(history + [5, 6], max_tokens=4, temperature=0, ignore_eos=True)

    result = asyncio.run(scenario())
    assert result.token_ids == want
    assert result.timings.get("local_prefill") and int(result.timings.get("cached_tokens", 0)) >= 36, result.timings
