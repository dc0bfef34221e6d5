"""pdserve on a Ray cluster of two hosts (tests/ray_hosts.py): a head (host A: the routers and the
prefill pool) and a worker (host B: the decode pool) in two network namespaces joined by a veth
pair, each started with `ray start` and its own resources; `pdserve serve --address` deploys the
application from the Serve config. The KV can only cross over the network (each host has its own
/dev/shm). Then the hosts fail: a router replica killed, the decode host's Ray node killed
mid-stream (and brought back), the link cut. fp32 throughout: greedy tokens equal the engine's
alone. Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from conftest import engine_alone
from host_client import answer
from netns import why_no_namespaces
from ray_cluster import free_port, tiny_config

WHY = why_no_namespaces()
pytestmark = [pytest.mark.ray, pytest.mark.skipif(WHY is not None, reason=WHY or "")]

HEAD = {"pdserve_router": 4, "pdserve_prefill": 16}
WORKER = {"pdserve_decode": 16}
PROMPTS = [[(i * 37 + j * 11) % 300 + 1 for j in range(12 + 30 * i)] for i in range(3)]
MAX_TOKENS = 12
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# Streams that are in flight when a host goes: each decode message waits this long.
DELAY_MESSAGE_S = 0.2
# The bound a stream whose decode host is lost ends within (killed: its sockets close at once;
# link cut: gRPC keepalive, 5 s pings with 5 s to answer), with room for two busy cores.
LOST_HOST_BOUND_S = 60.0


def two_host_config(model, tmp_path) -> str:
    """The Serve config of tests/ray_cluster.py (tiny model, fp32, quick scaling) with two
    router replicas; written where `pdserve serve --address` reads it."""
    config = tiny_config(model)
    config["http_options"]["port"], config["grpc_options"]["port"] = free_port(), free_port()
    app = config["applications"][0]
    app["runtime_env"]["env_vars"]["PDSERVE_FAULT_DELAY_MESSAGE_S"] = str(DELAY_MESSAGE_S)
    # Long prompts prefill in chunks: under the prefill-heavy load the prefill replica is the
    # bottleneck (its queue the signal), as in tests/test_ray.py.
    app["args"]["prefill"]["engine"]["max_num_batched_tokens"] = 64
    for dep in app["deployments"]:
        if dep["name"] == "Router":
            dep["num_replicas"] = 2
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    from ray_hosts import ray_two_hosts

    tmp = tmp_path_factory.mktemp("two-host-ray")
    with ray_two_hosts(HEAD, WORKER) as c:
        config = two_host_config(tiny_llama, tmp)
        r = c.run(c.a, "-m", "pdserve", "serve", "--config", config, "--address", c.address)
        print(r.stdout)
        c.serve_output = r.stdout
        c.config = yaml.safe_load(open(config))
        c.wait_until(lambda s: len(s["registry"].get("router", [])) == 2, "both routers to announce themselves")
        yield c


def routers(c) -> list[str]:
    return c.status()["registry"]["router"]


def test_pools_land_on_their_hosts_and_the_kv_crosses_over_tcp(cluster, tiny_llama):
    c = cluster
    view = c.status()["registry"]
    assert all(a.startswith(c.ip_a + ":") for a in view["router"] + view["prefill"]), view
    assert view["decode"] and all(a.startswith(c.ip_b + ":") for a in view["decode"]), view
    # `pdserve serve` printed each router replica's own port
    assert all(r in c.serve_output for r in view["router"]), c.serve_output
    expected = engine_alone(tiny_llama, PROMPTS, **GREEDY)
    for router in view["router"]:  # each router replica's own port, from host B
        results = c.client("generate", router, json.dumps(PROMPTS), str(MAX_TOKENS), ns=c.b)
        assert [r["ids"] for r in results] == expected
        for r in results:
            t = r["timings"]
            # across hosts: the TCP plane, layer by layer (kv_layerwise auto), never shm
            assert t["kv_transport"] == "tcp-layerwise", t
            assert t["prefill_node"].startswith(c.ip_a) and t["decode_node"].startswith(c.ip_b), t
            assert int(t["kv_bytes"]) > 0
    # through Serve's gRPC proxy on host B (a proxy on every Ray node)
    proxy = f"{c.ip_b}:{c.config['grpc_options']['port']}"
    streamed = c.client("streams", proxy, json.dumps(PROMPTS), str(MAX_TOKENS), "pdserve", ns=c.b)
    assert [s["tokens"] for s in streamed] == expected and {s["ended"] for s in streamed} == {"OK"}


def test_a_follow_up_through_the_other_router_reuses_the_cached_history(cluster, tiny_llama):
    """A prompt sent through one router replica, its follow-up through the other: the prefix
    cache serves it across routers (one tenant: no salt differs) and the tokens hold. That each
    router routes by the nodes' cache reports, not its own traffic, is tests/test_cluster.py's
    test_a_second_router_* (several nodes to choose among)."""
    c = cluster
    first, second = routers(c)
    history = [(j * 13) % 290 + 3 for j in range(48)]
    follow_up = history + [7, 8, 9, 10]
    c.client("generate", first, json.dumps([history]), str(MAX_TOKENS))
    (r,) = c.client("generate", second, json.dumps([follow_up]), str(MAX_TOKENS))
    assert r["ids"] == engine_alone(tiny_llama, [follow_up], **GREEDY)[0]
    assert int(r["timings"].get("cached_tokens", 0)) >= 44, r["timings"]  # 48 tokens less a partial block


def test_a_router_replica_killed_the_other_and_the_proxies_keep_serving(cluster, tiny_llama):
    c = cluster
    before = routers(c)
    victim = c.client("kill-router", c.address)
    expected = engine_alone(tiny_llama, PROMPTS[:1], **GREEDY)
    proxy = f"{c.ip_a}:{c.config['grpc_options']['port']}"
    # Straight away: through Serve's proxy (it routes to the live replica; a request it sent to
    # the killed one before Serve noticed fails, and the client retries it once) ...
    via_proxy = c.client("streams", proxy, json.dumps(PROMPTS[:1]), str(MAX_TOKENS), "pdserve", ns=c.b)
    if via_proxy[0]["ended"] != "OK":
        via_proxy = c.client("streams", proxy, json.dumps(PROMPTS[:1]), str(MAX_TOKENS), "pdserve", ns=c.b)
    assert [s["tokens"] for s in via_proxy] == expected, (victim, via_proxy)
    # ... and on the routers' own ports: a client given both (gRPC's `ipv4:A,B` target) fails
    # over to the live one; a stream that was on the killed one ends UNAVAILABLE and is retried
    # (docs/ray_multi_host.md).
    both = "ipv4:" + ",".join(before)
    assert [x["ids"] for x in c.client("generate", both, json.dumps(PROMPTS[:1]), str(MAX_TOKENS), ns=c.b)] == expected
    # Serve replaces the killed replica: two routers again, on the head. The killed one never
    # deregistered, so its entry stays until it expires (serving/registry.py, EXPIRE_S), and the new
    # one may bind the same port (the config's): back means two entries and each of them answers.
    c.wait_until(
        lambda s: (
            s["replicas"].get("Router") == 2
            and len(s["registry"].get("router", [])) == 2
            and all(_serves(c, r) for r in s["registry"]["router"])
        ),
        "two routers that answer",
    )
    for router in routers(c):
        assert [x["ids"] for x in c.client("generate", router, json.dumps(PROMPTS[:1]), str(MAX_TOKENS))] == expected


def _left_over(c) -> dict:
    """Each node's leases and blocks in use, once it is idle (all should be 0)."""
    return {
        node: {"leases": load["num_kv_leases"], "blocks": load["num_total_blocks"] - load["num_free_blocks"]}
        for node, load in c.client("loads", c.address).items()
    }


def _nothing_left(c) -> dict:
    began = time.time()
    while True:
        left = _left_over(c)
        if all(v == {"leases": 0, "blocks": 0} for v in left.values()) or time.time() > began + 120:
            return left
        time.sleep(2)


def _grows(c, tmp_path, prompt, max_tokens: int, pool: str) -> dict:
    """Twelve clients from host B send the prompt in a loop until `pool` has two replicas; every
    request must succeed. Returns the status that showed it."""
    stop = tmp_path / f"stop-{pool}"
    load = c.spawn(
        c.b, "tests/host_client.py", "load", routers(c)[0], json.dumps(prompt), str(max_tokens), "12", str(stop)
    )
    try:
        return c.wait_until(lambda s: s["replicas"].get(pool, 0) >= 2, f"{pool} to grow under its load")
    finally:
        stop.touch()
        out, err = load.communicate(timeout=600)
        result = answer(out) if load.returncode == 0 else err[-2000:]
        assert load.returncode == 0 and result["done"] > 0 and not result["errors"], result


def test_each_pool_grows_on_its_own_host_and_drains_down(cluster, tmp_path):
    """A prefill-heavy load grows Prefill (on host A) and not Decode; a decode-heavy one Decode
    (on host B) and not Prefill; each scale-down drains: no request fails, no lease or block is
    left."""
    c = cluster
    long_prompt = [(i * 37) % 300 + 1 for i in range(900)]  # prefilled in chunks of 64 tokens
    s = _grows(c, tmp_path, long_prompt, 1, "Prefill")
    assert s["replicas"]["Decode"] == 1 and len(s["registry"].get("prefill", [])) >= 1, s
    c.wait_until(lambda s: len(s["registry"].get("prefill", [])) == 2, "the new prefill replica to announce itself")
    assert all(a.startswith(c.ip_a + ":") for a in c.status()["registry"]["prefill"])
    c.wait_until(lambda s: s["replicas"].get("Prefill") == 1, "Prefill back to one")
    s = _grows(c, tmp_path, PROMPTS[0], 100, "Decode")  # 100 slow messages: about 20 s a request
    assert s["replicas"]["Prefill"] == 1, s
    c.wait_until(lambda s: len(s["registry"].get("decode", [])) == 2, "the new decode replica to announce itself")
    assert all(a.startswith(c.ip_b + ":") for a in c.status()["registry"]["decode"])
    c.wait_until(lambda s: s["replicas"].get("Decode") == 1, "Decode back to one")
    assert all(v == {"leases": 0, "blocks": 0} for v in _nothing_left(c).values()), _left_over(c)


def _streams_across_a_loss(c, lose, prompts, max_tokens: int) -> tuple[list[dict], float]:
    """Starts the streams from host A, loses host B once each has had a few messages, and returns
    every stream's record and the moment of the loss."""
    router = routers(c)[0]
    streams = c.spawn(c.a, "tests/host_client.py", "streams", router, json.dumps(prompts), str(max_tokens))
    time.sleep(8 * DELAY_MESSAGE_S + 15)  # streams admitted and decoding (slow messages)
    lost_at = time.time()
    lose()
    out, err = streams.communicate(timeout=LOST_HOST_BOUND_S + 600)  # a guard: the bound is asserted below
    records = answer(out)
    return records, lost_at


def _check_streams_ended(records, lost_at: float) -> None:
    for r in records:
        assert r["ended"] == "OK" or r["ended"].startswith("UNAVAILABLE"), r["ended"]
        assert r["arrivals"][-1] - lost_at < LOST_HOST_BOUND_S, (r["ended"], r["arrivals"][-1] - lost_at)
    cut = [r for r in records if r["ended"] != "OK"]
    assert cut, "no stream was in flight when the host went"
    assert all("decode" in r["ended"] for r in cut), [r["ended"] for r in cut]


def _host_b_back(c) -> None:
    """The decode host returns (its Ray node started again): Serve brings the pool back there.
    A lost node's entry stays in the registry up to EXPIRE_S, at an address the new replica may
    bind again (its preferred port): back means every node listed answers."""
    c.hosts[1].kill()  # what is left of it after a cut link (its raylet learns it was declared dead)
    c.hosts[1].start()
    c.wait_until(
        lambda s: (
            s["replicas"].get("Decode", 0) >= 1
            and s["registry"].get("decode", [])
            and all(a.startswith(c.ip_b) for a in s["registry"].get("decode", []))
            and c.run(c.a, "tests/host_client.py", "loads", c.address, check=False).returncode == 0
        ),
        "Decode back on host B",
    )
    router = routers(c)[0]
    c.wait_until(lambda s: _serves(c, router), "requests served again")


def _serves(c, router: str) -> bool:
    r = c.run(c.a, "tests/host_client.py", "generate", router, json.dumps(PROMPTS[:1]), "2", check=False)
    return r.returncode == 0


def test_the_decode_host_killed_mid_stream(cluster, tiny_llama):
    """SIGKILL of every process of host B (raylet, workers, the decode replica): the streams on it
    end UNAVAILABLE naming the decode node within the bound (no decode replica is left to migrate
    to), nothing hangs, the prefill node holds no lease; Serve brings Decode back with the host."""
    c = cluster
    prompts = [[(i * 11 + j) % 250 + 4 for j in range(20)] for i in range(6)]
    records, lost_at = _streams_across_a_loss(c, c.hosts[1].kill, prompts, 200)
    _check_streams_ended(records, lost_at)
    print("gaps:", [round(r["arrivals"][-1] - lost_at, 1) for r in records])
    _host_b_back(c)
    assert all(v == {"leases": 0, "blocks": 0} for v in _nothing_left(c).values()), _left_over(c)
    expected = engine_alone(tiny_llama, PROMPTS, **GREEDY)
    assert [r["ids"] for r in c.client("generate", routers(c)[0], json.dumps(PROMPTS), str(MAX_TOKENS))] == expected


def test_the_link_to_the_decode_host_cut_mid_stream(cluster, tiny_llama):
    """The veth pair down (no socket closes: packets vanish): keepalive ends the streams within
    the bound; the link back and host B's Ray node restarted, the cluster serves again."""
    c = cluster
    prompts = [[(i * 3 + j) % 260 + 6 for j in range(20)] for i in range(4)]
    try:
        records, lost_at = _streams_across_a_loss(c, lambda: c.set_link(False), prompts, 200)
    finally:
        c.set_link(True)
    _check_streams_ended(records, lost_at)
    print("gaps:", [round(r["arrivals"][-1] - lost_at, 1) for r in records])
    _host_b_back(c)
    assert all(v == {"leases": 0, "blocks": 0} for v in _nothing_left(c).values()), _left_over(c)
