"""Two hosts for real: the prefill node and the decode node in two Linux network namespaces joined
by a veth pair (optionally rate-limited with tc), the decode side with its own /dev/shm, so that
the KV can only move over the network. Greedy requests end to end with the tcp transport must
equal the engine alone. Skipped, with the reason, where namespaces cannot be made (not root, no
iproute2, no CAP_NET_ADMIN)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import engine_alone
from netns import in_namespace, two_hosts, why_no_namespaces

NODE_FLAGS = ["--dtype", "float32", "--kv-cache-gb", "0.02", "--block-size", "4", "--num-threads", "1"]
PROMPTS = [[(i * 37 + j * 11) % 300 + 1 for j in range(10 + 40 * i)] for i in range(3)]
MAX_TOKENS = 12
WHY = why_no_namespaces()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.mark.parametrize(
    "rate, layerwise",
    [(None, "off"), ("10gbit", "off"), ("10gbit", "on")],
    ids=["veth", "veth-10gbit", "veth-10gbit-layerwise"],
)
def test_greedy_requests_across_two_hosts_over_tcp(tiny_llama, rate, layerwise):
    expected = engine_alone(tiny_llama, PROMPTS, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with two_hosts(rate) as (a, b, addr_a, addr_b):
        procs = []
        try:
            prefill = in_namespace(a, "-m", "prefill_node", "--host", addr_a, "--model", str(tiny_llama), *NODE_FLAGS)
            procs.append(prefill)
            decode = in_namespace(b, "-m", "decode_node", "--host", addr_b, "--model", str(tiny_llama), *NODE_FLAGS)
            procs.append(decode)
            p_addr, d_addr = prefill.wait_ready(), decode.wait_ready()
            router = in_namespace(
                b,
                "-m",
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--model",
                str(tiny_llama),
                "--prefill",
                p_addr,
                "--decode",
                d_addr,
                "--kv-layerwise",
                layerwise,
                "--local-prefill",
                "off",
            )  # the KV must cross the link
            procs.append(router)
            r_addr = router.wait_ready()
            client = (
                "import json, sys\nfrom router.client import Client\n"
                "with Client(sys.argv[1]) as c:\n"
                "    for p in json.loads(sys.argv[2]):\n"
                f"        r = c.generate(p, max_tokens={MAX_TOKENS}, temperature=0, ignore_eos=True)\n"
                "        print(json.dumps({'ids': r.token_ids, 'transport': r.timings['kv_transport']}))\n"
            )
            r = subprocess.run(
                ["ip", "netns", "exec", b, sys.executable, "-c", client, r_addr, json.dumps(PROMPTS)],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=os.getcwd(),
            )
            assert r.returncode == 0, r.stderr[-3000:]
            results = [json.loads(line) for line in r.stdout.splitlines()]
            assert [x["ids"] for x in results] == expected
            # no shared memory between the hosts
            assert {x["transport"] for x in results} == {"tcp-layerwise" if layerwise == "on" else "tcp"}
        finally:
            for proc in reversed(procs):
                proc.stop()
