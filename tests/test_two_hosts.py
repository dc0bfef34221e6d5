"""Two hosts for real: the prefill node and the decode node in two Linux network namespaces joined
by a veth pair (optionally rate-limited with tc), the decode side with its own /dev/shm, so that
the KV can only move over the network. Greedy requests end to end with the tcp transport must
equal the engine alone. Skipped, with the reason, where namespaces cannot be made (not root, no
iproute2, no CAP_NET_ADMIN)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from contextlib import contextmanager

import pytest
from conftest import make_engine, run_to_completion

from engine import SamplingParams

NODE_FLAGS = ["--dtype", "float32", "--kv-cache-gb", "0.02", "--block-size", "4", "--num-threads", "1"]
PROMPTS = [[(i * 37 + j * 11) % 300 + 1 for j in range(10 + 40 * i)] for i in range(3)]
MAX_TOKENS = 12


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "needs iproute2 (ip) and util-linux (unshare)"
    name = f"pdprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


WHY = _why_no_namespaces()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@contextmanager
def two_hosts(rate: str | None = None):
    """Namespaces A (10.213.X.1) and B (10.213.X.2) on a veth pair; yields (A, B, addr A, addr B)."""
    tag = uuid.uuid4().hex[:6]
    a, b, va, vb = f"pdA{tag}", f"pdB{tag}", f"pva{tag}", f"pvb{tag}"
    net = f"10.213.{int(tag, 16) % 250 + 1}"
    _ip("netns", "add", a)
    _ip("netns", "add", b)
    try:
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, f"{net}.1"), (b, vb, f"{net}.2")):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if rate:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                                rate, "burst", "4mb", "latency", "50ms"], check=True, capture_output=True)
        yield a, b, f"{net}.1", f"{net}.2"
    finally:
        _ip("netns", "del", a)  # takes the veth pair with it
        _ip("netns", "del", b)


class InNamespace:
    """A python -m process in a namespace, with a private /dev/shm; stopped by its PID."""

    def __init__(self, ns: str, *args: str):
        script = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "sh", "-c", script, "sh",
                                      sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def ready(self) -> str:
        for line in self.proc.stdout:
            if line.startswith("READY "):
                return line.split()[1]
        raise RuntimeError(f"did not start: {self.proc.stderr.read()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def engine_alone(model) -> list[list[int]]:
    engine = make_engine(model)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    outs = run_to_completion(engine)
    return [outs[str(i)].token_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize("rate", [None, "10gbit"], ids=["veth", "veth-10gbit"])
def test_greedy_requests_across_two_hosts_over_tcp(tiny_llama, rate):
    expected = engine_alone(tiny_llama)
    with two_hosts(rate) as (a, b, addr_a, addr_b):
        procs = []
        try:
            prefill = InNamespace(a, "-m", "prefill_node", "--host", addr_a, "--model", str(tiny_llama), *NODE_FLAGS)
            procs.append(prefill)
            decode = InNamespace(b, "-m", "decode_node", "--host", addr_b, "--model", str(tiny_llama), *NODE_FLAGS)
            procs.append(decode)
            p_addr, d_addr = prefill.ready(), decode.ready()
            router = InNamespace(b, "-m", "router", "--host", "127.0.0.1", "--port", "0", "--model",
                                 str(tiny_llama), "--prefill", p_addr, "--decode", d_addr)
            procs.append(router)
            r_addr = router.ready()
            client = ("import json, sys\nfrom router.client import Client\n"
                      "with Client(sys.argv[1]) as c:\n"
                      "    for p in json.loads(sys.argv[2]):\n"
                      f"        r = c.generate(p, max_tokens={MAX_TOKENS}, temperature=0, ignore_eos=True)\n"
                      "        print(json.dumps({'ids': r.token_ids, 'transport': r.timings['kv_transport']}))\n")
            r = subprocess.run(["ip", "netns", "exec", b, sys.executable, "-c", client, r_addr, json.dumps(PROMPTS)],
                               capture_output=True, text=True, timeout=300, cwd=os.getcwd())
            assert r.returncode == 0, r.stderr[-3000:]
            results = [json.loads(line) for line in r.stdout.splitlines()]
            assert [x["ids"] for x in results] == expected
            assert {x["transport"] for x in results} == {"tcp"}  # no shared memory between the hosts
        finally:
            for proc in reversed(procs):
                proc.stop()
