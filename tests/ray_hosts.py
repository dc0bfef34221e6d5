"""A Ray cluster of two hosts on one machine (test and benchmark support): a head and a worker in
two Linux network namespaces joined by a veth pair (tests/netns.py), each host with a /dev/shm of
its own, each started with `ray start` as an operator would, declaring its own resources. What
talks to the cluster (`pdserve serve --address`, clients, status) runs inside a namespace too
(tests/host_client.py). A host is lost by SIGKILL of every process in its namespace (its raylet,
its workers, `ray start`), by PID; its link by taking the veth down."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from host_client import answer
from netns import host_prefix, set_link, two_hosts

GCS_PORT = 6379
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Waits that guard against a hang, not speed checks: on two busy cores a Ray node or a replica
# (a Python worker importing torch and Ray, then the engine) takes minutes to start.
HANG_S = 600.0


def _env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


class RayHost:
    """One Ray node: `ray start --block` in namespace `ns` with a private /dev/shm."""

    def __init__(self, ns: str, ip: str, temp_dir: str, resources: dict, head: str | None = None):
        self.ns, self.ip, self.resources, self.head = ns, ip, resources, head
        self.temp_dir = temp_dir
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--block",
            "--node-ip-address",
            self.ip,
            "--num-cpus",
            "2",
            "--resources",
            json.dumps(self.resources),
            "--object-store-memory",
            str(256 << 20),
            "--disable-usage-stats",
            "--temp-dir",
            self.temp_dir,
        ]
        if self.head is None:
            args += ["--head", "--port", str(GCS_PORT), "--include-dashboard", "false"]
        else:
            args += ["--address", self.head]
        log = open(Path(self.temp_dir).with_suffix(".log"), "ab")
        self.proc = subprocess.Popen(
            host_prefix(self.ns) + args, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT
        )
        log.close()

    def pids(self) -> list[int]:
        """Every process in this host's namespace (raylet, GCS, workers, replicas, clients)."""
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill(self) -> None:
        """The host lost: SIGKILL to every process in its namespace, by PID."""
        for _ in range(5):  # a dying raylet may have just forked a worker
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        if self.proc is not None:
            self.proc.wait(timeout=60)


class RayTwoHosts:
    """The cluster: host A is the head (router, prefill), host B a worker (decode)."""

    def __init__(self, a: str, b: str, ip_a: str, ip_b: str, temp_dir: str):
        self.a, self.b, self.ip_a, self.ip_b, self.temp_dir = a, b, ip_a, ip_b, temp_dir
        self.address = f"{ip_a}:{GCS_PORT}"
        self.hosts: list[RayHost] = []

    def add_host(self, ns: str, ip: str, resources: dict, name: str) -> RayHost:
        host = RayHost(ns, ip, f"{self.temp_dir}/{name}", resources, None if ns == self.a else self.address)
        host.start()
        self.hosts.append(host)
        return host

    def run(self, ns: str, *args: str, timeout: float = HANG_S, check: bool = True) -> subprocess.CompletedProcess:
        """`python *args` in namespace ns (a client, `-m pdserve serve --address ...`)."""
        r = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_env(),
            cwd=ROOT,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"{args[:3]} in {ns} exited {r.returncode}: {r.stderr[-3000:]}\n{self.logs()}")
        return r

    def spawn(self, ns: str, *args: str) -> subprocess.Popen:
        """`python *args` in namespace ns, in the background (its output piped)."""
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=ROOT,
        )

    def client(self, *args: str, ns: str | None = None, timeout: float = HANG_S):
        """tests/host_client.py's JSON answer, run on host A (or ns)."""
        r = self.run(ns or self.a, str(HERE / "host_client.py"), *args, timeout=timeout)
        return answer(r.stdout)

    def status(self) -> dict:
        """{"replicas": {deployment: running}, "registry": {role: [address]}, "nodes": alive IPs};
        while the cluster cannot answer (a registry restarting, a node just lost), empty ones and
        the error."""
        r = self.run(self.a, str(HERE / "host_client.py"), "status", self.address, check=False, timeout=300)
        if r.returncode != 0:
            return {"replicas": {}, "registry": {}, "nodes": [], "error": r.stderr[-500:]}
        return answer(r.stdout)

    def wait_until(self, predicate, what: str, timeout_s: float = HANG_S, interval_s: float = 2.0) -> dict:
        """Polls status() until predicate(status) holds; returns that status. A timeout names `what`
        and the last status seen."""
        began, last = time.time(), None
        while time.time() < began + timeout_s:
            last = self.status()
            if predicate(last):
                print(f"waited {time.time() - began:.1f} s for {what}: {last}")
                return last
            time.sleep(interval_s)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last seen: {last}\n{self.logs()}")

    def set_link(self, up: bool) -> None:
        """The veth pair between the hosts up or down (down: packets vanish, no socket closes)."""
        set_link(self.a, up)
        set_link(self.b, up)

    def wait_for_nodes(self, n: int) -> None:
        """Until n Ray nodes are alive (a raylet registers within a minute or two on busy cores)."""
        began = time.time()
        while time.time() < began + HANG_S:
            for host in self.hosts:  # a raylet that missed Ray's registration window exits: again
                if host.proc.poll() is not None:
                    print(f"ray start on {host.ns} exited ({host.proc.returncode}); starting it again\n{self.logs()}")
                    host.kill()
                    host.start()
            r = self.run(self.a, str(HERE / "host_client.py"), "nodes", self.address, check=False, timeout=120)
            if r.returncode == 0 and len(answer(r.stdout)) >= n:
                print(f"waited {time.time() - began:.1f} s for {n} Ray node(s)")
                return
            time.sleep(2)
        raise AssertionError(f"{n} Ray nodes did not join in {HANG_S} s\n{self.logs()}")

    def logs(self, lines: int = 30) -> str:
        """The tails of the hosts' `ray start` logs and of the Serve replicas' logs (for failures)."""
        out = []
        for path in sorted(Path(self.temp_dir).glob("*.log")) + sorted(
            Path(self.temp_dir).glob("*/session_latest/logs/serve/replica_*.log")
        ):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(out)


@contextmanager
def ray_two_hosts(head_resources: dict, worker_resources: dict | None):
    """Yields a RayTwoHosts with its head (and its worker, unless worker_resources is None: then
    one host holds everything) started and joined; everything is stopped by PID at the end."""
    temp_dir = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")  # short: Ray's socket paths must fit AF_UNIX
    os.chmod(temp_dir, 0o700)
    try:
        with two_hosts() as (a, b, ip_a, ip_b):
            cluster = RayTwoHosts(a, b, ip_a, ip_b, temp_dir)
            try:
                cluster.add_host(a, ip_a, head_resources, "head")
                cluster.wait_for_nodes(1)
                if worker_resources is not None:
                    cluster.add_host(b, ip_b, worker_resources, "worker")
                    cluster.wait_for_nodes(2)
                yield cluster
            finally:
                for host in reversed(cluster.hosts):
                    host.kill()  # a test cluster: nothing to keep
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
