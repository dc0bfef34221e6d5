"""Two hosts on one machine (test and benchmark support): Linux network namespaces joined by a
veth pair, optionally rate limited with tc, for the tests and benchmarks that must move KV over a
network (no shared memory: each process started here gets a private /dev/shm). Needs root and
iproute2."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager

from serving.launcher import ServerProcess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def why_no_namespaces() -> str | None:
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
                subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        "4mb",
                        "latency",
                        "50ms",
                    ],
                    check=True,
                    capture_output=True,
                )
        yield a, b, f"{net}.1", f"{net}.2"
    finally:
        _ip("netns", "del", a)  # takes the veth pair with it
        _ip("netns", "del", b)


def set_link(ns: str, up: bool) -> None:
    """Takes namespace ns's veth end down (packets to and from it vanish; no socket is closed, as
    when a cable is pulled) or up again."""
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "type", "veth"], capture_output=True, text=True)
    dev = out.stdout.split(":")[1].strip().split("@")[0]
    _ip("-n", ns, "link", "set", dev, "up" if up else "down")


def host_prefix(ns: str) -> list[str]:
    """A command line's prefix that runs it in namespace ns with a /dev/shm of its own (another
    host's, as far as shared memory goes)."""
    script = 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"'
    return ["ip", "netns", "exec", ns, "unshare", "--mount", "sh", "-c", script, "sh"]


def in_namespace(ns: str, *args: str) -> ServerProcess:
    """A server process (`python *args`) in namespace ns, with a private /dev/shm; stopped by its
    PID (serving/launcher.py)."""
    return ServerProcess(list(args), prefix=host_prefix(ns), stderr=subprocess.PIPE)
