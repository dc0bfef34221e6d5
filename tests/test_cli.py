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
