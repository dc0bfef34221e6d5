"""pdserve on a private local Ray cluster (started and stopped here): deploy from the Serve
config, generate through Serve's gRPC proxy and the router's own port, per-pool autoscaling,
and a scale-down that loses no tokens."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import threading
import time

import grpc
import pytest
from cluster import local_cluster
from conftest import make_engine, run_to_completion
from ray_cluster import HANG_S, replica_counts, serves, start_ray, stop_ray, tiny_config, wait_until

from engine import SamplingParams
from pdserve import serve_config
from pdserve.ray_serve import wait_running
from router.client import AsyncClient, Client

pytestmark = pytest.mark.ray
PROMPT = [5, 17, 33, 8, 90, 41, 7]


@pytest.fixture(scope="module")
def deployed(tiny_llama, tmp_path_factory):
    start_ray(tmp_path_factory.mktemp("ray"))
    config = tiny_config(tiny_llama)
    config["applications"][0]["args"]["decode"]["engine"]["max_num_seqs"] = 4
    # Long prompts prefill in chunks of 64 tokens: under the prefill-heavy load the prefill replica
    # is the bottleneck (its queue is the signal) however fast or busy the machine is; with whole
    # prompts in one step, the router and the clients were the bottleneck on two busy cores and the
    # queue stayed under the target (seen: 0-2 pending for 10 minutes).
    config["applications"][0]["args"]["prefill"]["engine"]["max_num_batched_tokens"] = 64
    try:
        serve_config.deploy(serve_config.validate(config))
        wait_running(["pdserve"], HANG_S)
        args = config["applications"][0]["args"]
        direct = f"127.0.0.1:{args['router']['direct_port']}"
        proxy = f"127.0.0.1:{config['grpc_options']['port']}"
        wait_until(lambda: serves(direct, PROMPT), HANG_S, "the router to discover both pools")
        yield config, direct, proxy
    finally:
        stop_ray()


def test_generate_through_the_proxy_and_the_direct_port_equals_pdserve_up(deployed, tiny_llama):
    config, direct, proxy = deployed

    async def up_cluster():
        async with local_cluster(tiny_llama) as (router, _, _):
            async with AsyncClient(router.address) as client:
                return await client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)

    expected = asyncio.run(up_cluster()).token_ids
    via_direct = Client(direct).generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    via_proxy = Client(proxy, metadata=[("application", "pdserve")])
    streamed = via_proxy.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    unary = via_proxy.generate_unary(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    assert via_direct.token_ids == streamed.token_ids == unary.token_ids == expected
    assert streamed.usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 24}
    assert via_direct.timings["kv_transport"] == "shm"  # both replicas on this Ray node
    with pytest.raises(grpc.RpcError) as err:
        via_proxy.generate(PROMPT, max_tokens=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.value.details()
    assert via_proxy.models() == [str(tiny_llama)]
    # The OpenAI-compatible HTTP API through Serve's HTTP ingress: the same tokens.
    import openai

    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{config['http_options']['port']}/v1", api_key="none", max_retries=0
    )
    completion = http.completions.create(
        model=str(tiny_llama), prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == via_direct.text and completion.usage.completion_tokens == 24
    chunks = list(
        http.completions.create(
            model=str(tiny_llama),
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == via_direct.text
    # Serve's ingress keeps the app's OpenAI-shaped 404s and health.
    import httpx

    base = f"http://127.0.0.1:{config['http_options']['port']}"
    missing = httpx.get(f"{base}/v1/foo")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Invalid URL (GET /v1/foo)"
    assert httpx.get(f"{base}/health").json()["status"] == "ok"


def test_replicas_run_at_normal_priority(deployed):
    """Ray starts workers at nice 15; the Serve config's runtime_env puts the replicas back at 0,
    or any busy process on the machine starves the serving workload."""
    import psutil

    nice = {}
    for p in psutil.Process().children(recursive=True):  # this test's cluster only
        try:
            title = (p.cmdline() or [""])[0]
            if title.startswith("ray::ServeReplica:pdserve:"):
                nice[title.removeprefix("ray::ServeReplica:pdserve:").split(".")[0]] = p.nice()
        except psutil.Error:  # a process that ended meanwhile, or a zombie not yet reaped
            continue
    assert nice == {"Router": 0, "Prefill": 0, "Decode": 0}, nice


def run_load(address: str, concurrency: int, stop: threading.Event, prompt, **params) -> list:
    """prompt: the token ids every request sends, or a function that makes each request's."""
    errors: list = []

    async def worker():
        async with AsyncClient(address, timeout=HANG_S) as client:
            while not stop.is_set():
                try:
                    await client.generate(prompt() if callable(prompt) else prompt, **params)
                except grpc.aio.AioRpcError as e:
                    errors.append(e)
                    await asyncio.sleep(0.1)

    async def main():
        await asyncio.gather(*(worker() for _ in range(concurrency)))

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    return [thread, errors]


def under_load(address, prompt, params, until, what, timeout_s=HANG_S):
    """Runs load until `until(counts)` holds; returns every replica count seen meanwhile."""
    stop = threading.Event()
    thread, errors = run_load(address, 12, stop, prompt, **params)
    seen = []
    try:
        wait_until(lambda: seen.append(replica_counts()) or until(seen[-1]), timeout_s, what, last=lambda: seen[-1])
    finally:
        stop.set()
        thread.join(timeout=HANG_S)
    assert not errors, errors[:3]
    return seen


def test_each_pool_scales_on_its_own_signal(deployed):
    config, direct, _ = deployed
    assert replica_counts() == {"Router": 1, "Prefill": 1, "Decode": 1}
    # Prefill-heavy: long prompts, one output token.
    long_prompt = [(i * 37) % 300 + 1 for i in range(900)]
    seen = under_load(direct, long_prompt, dict(max_tokens=1), lambda c: c["Prefill"] == 2, "prefill to scale up")
    assert all(c["Decode"] == 1 for c in seen), seen
    wait_until(lambda: replica_counts()["Prefill"] == 1, HANG_S, "prefill to scale back down", last=replica_counts)
    # Decode-heavy: short prompts, long outputs.
    seen = under_load(
        direct, PROMPT, dict(max_tokens=600, ignore_eos=True), lambda c: c["Decode"] == 2, "decode to scale up"
    )
    assert all(c["Prefill"] == 1 for c in seen), seen


def test_the_planner_policy_sizes_both_pools_from_one_model(deployed, tmp_path):
    """The application-level PlannerPolicy (pdserve/autoscaling.py) in place of the two threshold
    policies, on a step line written for this test: decoding costs 22 ms a sequence against a
    10 ms TPOT SLO (one replica holds ~40 tokens/s), a prompt 2 ms a token against a 10 s TTFT
    (one replica ~0.5 of these long prompts a second). A decode-heavy load grows Decode and not
    Prefill; a prefill-heavy one Prefill and not Decode: one model sets both from what the pools
    report."""
    config, direct, _ = deployed
    step = {"fixed": 0.001, "per_token": 0.002, "per_pair": 0.0, "per_context": 0.0, "per_sequence": 0.02}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"version": 2, "engines": {"1": {"step": step}}}))
    planned = copy.deepcopy(config)
    planned["applications"][0]["autoscaling_policy"] = {
        "policy_function": "pdserve.autoscaling:PlannerPolicy",
        "policy_kwargs": {"profile": str(profile), "slo_ttft_s": 10.0, "slo_tpot_s": 0.01, "max_kv_utilization": 1.0},
    }
    one_each = {"Router": 1, "Prefill": 1, "Decode": 1}
    try:
        serve_config.deploy(serve_config.validate(planned))
        wait_running(["pdserve"], HANG_S)
        wait_until(lambda: replica_counts() == one_each, HANG_S, "one replica a pool", last=replica_counts)
        seen = under_load(
            direct, PROMPT, dict(max_tokens=600, ignore_eos=True), lambda c: c["Decode"] == 2, "decode to scale up"
        )
        assert all(c["Prefill"] == 1 for c in seen), seen
        wait_until(lambda: replica_counts() == one_each, HANG_S, "decode back to one", last=replica_counts)
        # Prompts of 900 new tokens each (one prompt sent again would come from the prefix cache,
        # which the planner counts as the cheap prefill it is)
        rng = random.Random(0)
        new_prompts = lambda: [rng.randrange(1, 300) for _ in range(900)]  # noqa: E731
        seen = under_load(direct, new_prompts, dict(max_tokens=1), lambda c: c["Prefill"] == 2, "prefill to scale up")
        assert all(c["Decode"] == 1 for c in seen), seen
    finally:  # the thresholds back, and the pools back to one replica each, for the tests after
        serve_config.deploy(serve_config.validate(config))
        wait_running(["pdserve"], HANG_S)
        wait_until(lambda: replica_counts() == one_each, HANG_S, "one replica a pool again", last=replica_counts)


def test_scale_down_during_streaming_loses_no_token(deployed, tiny_llama):
    config, direct, _ = deployed
    params = dict(max_tokens=900, temperature=0, ignore_eos=True)
    engine = make_engine(tiny_llama)
    engine.add_request("ref", PROMPT, SamplingParams(**params))
    expected = run_to_completion(engine)["ref"].token_ids

    def redeploy(decode_min: int, decode_max: int) -> None:
        changed = copy.deepcopy(config)
        for dep in changed["applications"][0]["deployments"]:
            if dep["name"] == "Decode":
                dep["autoscaling_config"].update(min_replicas=decode_min, max_replicas=decode_max)
        serve_config.deploy(serve_config.validate(changed))

    redeploy(2, 2)
    wait_until(lambda: replica_counts()["Decode"] == 2, HANG_S, "two decode replicas", last=replica_counts)
    wait_until(lambda: serves(direct, PROMPT), HANG_S, "the router")
    before = {k: v for k, v in _replica_ids().items() if k != "Decode"}
    assert len(before["Router"]) == 1 and len(before["Prefill"]) == 1

    async def streams():
        async with AsyncClient(direct) as client:
            return await asyncio.gather(*(client.generate(PROMPT, **params) for _ in range(8)))

    results = []
    thread = threading.Thread(target=lambda: results.extend(asyncio.run(streams())))
    thread.start()
    time.sleep(1.0)
    redeploy(1, 1)  # a replica-count change: one decode replica drains, nothing else restarts
    thread.join(timeout=HANG_S)
    assert len(results) == 8
    assert all(r.token_ids == expected and r.finish_reason == "length" for r in results)
    wait_until(lambda: replica_counts()["Decode"] == 1, HANG_S, "the decode pool to shrink", last=replica_counts)
    assert {k: v for k, v in _replica_ids().items() if k != "Decode"} == before


def _replica_ids() -> dict[str, set[str]]:
    """deployment -> the names of its live replica actors (Serve names them after the replica id)."""
    import ray

    ids: dict[str, set[str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if name.startswith("SERVE_REPLICA::pdserve#"):
            ids.setdefault(name.split("#")[1], set()).add(name)
    return ids


def test_pdserve_serve_redeploys_on_an_existing_cluster(deployed, tmp_path):
    """The CLI path: validate the file, connect to the cluster, deploy declaratively, wait."""
    import subprocess
    import sys

    import ray
    import yaml

    config, direct, _ = deployed
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "serve",
            "--config",
            str(path),
            "--address",
            ray.get_runtime_context().gcs_address,
            "--timeout",
            str(HANG_S),
        ],
        capture_output=True,
        text=True,
        timeout=HANG_S + 60,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "application 'pdserve' is RUNNING" in r.stdout
    assert serves(direct, PROMPT)
    bad = tmp_path / "bad.yaml"
    config = copy.deepcopy(config)
    config["applications"][0]["deployments"][1]["autoscaling_config"]["max_replicsa"] = 3
    bad.write_text(yaml.safe_dump(config))
    r = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "--config", str(bad), "--address", "unused"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "max_replicsa" in r.stderr
