"""The Ray dashboard as `pdserve serve` tells a user to reach it: on a cluster with Ray's token
authentication (on by default for a new local cluster), the steps it prints (browser sign-in and a
curl command) reach the dashboard's Serve applications API; without the token it is 401."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from ray_cluster import HANG_S, tiny_config

from pdserve import ray_serve

ROOT = Path(__file__).resolve().parents[1]
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "PDSERVE_MODEL")


def test_the_lines_name_the_token_source_and_never_the_token(tmp_path, monkeypatch):
    for name in AUTH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    url = "http://127.0.0.1:8265"
    off = ray_serve.dashboard_lines(url, "disabled")
    assert off[0].startswith(f"pdserve serve: Ray dashboard at {url} ")
    assert off[-1].strip() == f"curl {url}/api/serve/applications/" and "off" in off[1]

    token = ray_serve.ensure_private_token()
    assert token == tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    assert ray_serve.ensure_private_token() is None  # one there already: left alone
    on = "\n".join(ray_serve.dashboard_lines(url, "token"))
    assert token.read_text() not in on and "~/.ray/auth_token" in on and "others can read it" not in on
    assert f'curl -H "Authorization: Bearer $(cat ~/.ray/auth_token)" {url}/api/serve/applications/' in on
    token.chmod(0o644)
    assert "others can read it: chmod 600 ~/.ray/auth_token" in "\n".join(ray_serve.dashboard_lines(url, "token"))

    monkeypatch.setenv("RAY_AUTH_TOKEN", "abc123")
    on = "\n".join(ray_serve.dashboard_lines(url, "token"))
    assert "abc123" not in on and '-H "Authorization: Bearer $RAY_AUTH_TOKEN"' in on
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    token.unlink()
    assert ray_serve.ensure_private_token() is None and not token.exists()


class Output:
    """A process's stdout, line by line, read on a thread so a wait can time out."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.ended = False
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def drain(self, timeout_s: float) -> None:
        """The rest of the output, once the process ended."""
        try:
            while not self.ended:
                line = self._queue.get(timeout=timeout_s)
                self.ended = line is None
                self.lines += [line] if line is not None else []
        except queue.Empty:
            pass

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        give_up = time.time() + timeout_s
        for line in self.lines:
            if m := re.search(pattern, line):
                return m
        while not self.ended and time.time() < give_up:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                self.ended = True
                break
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r} after {timeout_s:.0f} s; output:\n" + "\n".join(self.lines))


def _get(url: str, **headers) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _stop(proc: subprocess.Popen, ray_tmp: str) -> None:
    """SIGINT (what Ctrl-C sends: `pdserve serve` stops Serve and its cluster), then, by PID, every
    process it started and any left with the private temp dir on its command line or environment."""
    import psutil

    def ours() -> list[psutil.Process]:
        found = {}
        try:
            for p in psutil.Process(proc.pid).children(recursive=True):
                found[p.pid] = p
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter(["cmdline", "environ"]):  # Ray's agents rename themselves
            if ray_tmp in " ".join(p.info["cmdline"] or ()) or (p.info["environ"] or {}).get("RAY_TMPDIR") == ray_tmp:
                found[p.pid] = p
        return list(found.values())

    started = ours()
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    left = [p for p in started + ours() if p.is_running()]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=30)
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.ray
def test_pdserve_serve_prints_the_dashboard_steps_and_they_reach_the_serve_api(tiny_llama, tmp_path):
    home = tmp_path / "home"  # Ray's ~/.ray/auth_token goes here, not in the real home
    home.mkdir()
    ray_tmp = f"/tmp/pdsd-{os.getpid()}"  # short: Ray's AF_UNIX socket paths live under it
    config = tiny_config(tiny_llama)
    config["http_options"]["host"] = "127.0.0.1"
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in AUTH_ENV}  # Ray's default: token auth on
    bin_dir = str(Path(sys.executable).parent)  # `ray get-auth-token`, as the user's venv has it
    env.update(
        HOME=str(home), RAY_TMPDIR=ray_tmp, PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONUNBUFFERED="1"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "serve", "--config", str(config_path), "--timeout", str(HANG_S)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = Output(proc)
    try:
        out.wait_for(r"^pdserve serve: application 'pdserve' is RUNNING", HANG_S + 300)
        url = out.wait_for(r"^pdserve serve: Ray dashboard at (http://\S+) ", 120).group(1)
        sign_in = out.wait_for(r"^  token authentication is on: .*`(ray get-auth-token)`", 60)
        curl = out.wait_for(r"^  (curl .*)$", 60).group(1)

        token_file = home / ".ray" / "auth_token"
        token = token_file.read_text().strip()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600  # pdserve made it owner-only
        assert token and token not in "\n".join(out.lines)  # never printed
        assert "~/.ray/auth_token" in sign_in.group(0)
        out.wait_for(r"^pdserve serve: created the Ray auth token in ~/.ray/auth_token \(owner-only\)", 1)

        api = f"{url}/api/serve/applications/"
        status, body = _get(api)
        assert (status, body) == (401, "Unauthorized: Missing authentication token")
        assert _get(api, Authorization="Bearer " + "0" * 64)[0] == 403

        # The shell step, as printed (plus curl's own flags to show the status).
        shell = subprocess.run(
            ["bash", "-c", f"{curl} -sS -w '\\n%{{http_code}}'"],
            env=env,
            cwd=home,
            capture_output=True,
            text=True,
            timeout=120,
        )
        body, _, code = shell.stdout.rpartition("\n")
        assert code == "200", shell
        apps = json.loads(body)["applications"]
        assert apps["pdserve"]["status"] == "RUNNING"

        # The browser step: the command the line names prints the token; the page posts it to
        # /api/authenticate (the dashboard's "Authentication Token Required" dialog), which sets
        # a cookie that then opens the API.
        printed = subprocess.run(
            ["bash", "-c", sign_in.group(1)], env=env, cwd=home, capture_output=True, text=True, timeout=120
        )
        assert printed.stdout.strip() == token, printed.stderr
        import requests

        browser = requests.Session()
        browser.trust_env = False
        browser.headers["User-Agent"] = "Mozilla/5.0"
        assert browser.get(f"{url}/", timeout=60).status_code == 200  # the page itself is public
        assert browser.get(api, timeout=60).status_code == 401
        auth = browser.post(
            f"{url}/api/authenticate", headers={"Authorization": f"Bearer {printed.stdout.strip()}"}, timeout=60
        )
        assert auth.status_code == 200 and "ray-authentication-token" in browser.cookies
        signed_in = browser.get(api, timeout=60)
        assert signed_in.status_code == 200 and "pdserve" in signed_in.json()["applications"]
    finally:
        _stop(proc, ray_tmp)
        out.drain(10)
        print(*out.lines, sep="\n")  # pytest shows it where the test fails
    assert proc.returncode == 0, "\n".join(out.lines)
