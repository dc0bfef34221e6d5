"""The pdserve command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=300)


def test_generate_offline_prints_the_answer(tiny_llama):
    r = run("generate-offline", "Hello world", "--model", str(tiny_llama), "--max-tokens", "5", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "5 generated tokens" in r.stderr and "finish: length" in r.stderr


def test_generate_offline_reports_bad_input():
    r = run("generate-offline", "Hello", "--model", "nope")
    assert r.returncode == 2
    assert "unknown model name or path 'nope'" in r.stderr


def test_up_then_generate_streams_and_stops_cleanly(tiny_llama):
    """`pdserve up` starts real node processes; `pdserve generate` asks it; SIGTERM stops them all."""
    import json
    import signal
    import threading
    from pathlib import Path

    import psutil

    from conftest import make_engine, run_to_completion
    from engine import SamplingParams

    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--model", str(tiny_llama), "--port", "0",
                           "--dtype", "float32", "--kv-cache-gb", "0.01", "--block-size", "4", "--num-threads", "1"],
                          stderr=subprocess.PIPE, text=True)
    try:
        address = None
        for line in up.stderr:
            if line.startswith("pdserve up: router on "):
                address = line.split()[4]
                break
        assert address, "pdserve up did not come up"
        threading.Thread(target=up.stderr.read, daemon=True).start()  # keep the pipe drained
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) == 2
        r = run("generate", "--addr", address, "--json", "--raw", "--max-tokens", "8", "--temperature", "0",
                "Hello world")
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout.strip().splitlines()[-1])
        engine = make_engine(tiny_llama)
        engine.add_request("x", "Hello world", SamplingParams(max_tokens=8, temperature=0))
        assert result["token_ids"] == run_to_completion(engine)["x"].token_ids
        assert result["usage"]["completion_tokens"] == len(result["token_ids"])
        assert result["timings"]["kv_transport"] == "shm"  # two processes, one host: the one-sided read
        bad = run("generate", "--addr", address, "--max-tokens", "0", "hi")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    pids = {str(c.pid) for c in children}
    assert not [p for p in Path("/dev/shm").glob("pdserve-kv-*") if p.name.split("-")[2] in pids]
