"""The C++ kernels' build survives a build that was killed: torch's `lock` file left behind made
every later node start wait forever (engine/cpu_kernels.py guards it with an flock)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from engine import cpu_kernels
from engine.hardware import cpu_features
flags = cpu_features().kernel_flags
if sys.argv[1] == "stale":
    (cpu_kernels.build_directory(flags) / "lock").touch()  # what a build killed mid-way leaves
print(cpu_kernels.load(), sorted(p.name for p in cpu_kernels.build_directory(flags).iterdir()))
"""


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the engine uses plain torch")
def test_a_stale_build_lock_does_not_hang_the_next_start(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    # A hang would be forever; 600 s is a guard for a slow, busy machine (a build takes ~10-30 s).
    first = subprocess.run(
        [sys.executable, "-c", SCRIPT, "stale"], env=env, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("True ") and "'lock'" not in first.stdout, first.stdout
    assert "removing a stale build lock" in first.stderr
    again = subprocess.run(
        [sys.executable, "-c", SCRIPT, "fresh"], env=env, capture_output=True, text=True, timeout=600
    )
    assert again.stdout.startswith("True ") and "stale" not in again.stderr, again.stderr  # cached, not rebuilt
