"""`make test` (scripts/test.sh) runs both passes to the end: a red first pass does not hide the
AVX2-only pass, both summaries come last, and the exit status is non-zero if either failed."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fake_python(tmp_path: Path, first_exit: int, second_exit: int) -> Path:
    """A stand-in for `python -m pytest`: prints a summary line and exits with the pass's status
    (the first call is the whole suite, the second the AVX2-only pass, told apart by its env)."""
    script = tmp_path / "python"
    script.write_text(f"""#!/usr/bin/env bash
if [ "${{PDSERVE_CPU_ISA:-}}" = avx2 ]; then
  echo "avx2 args: $*"; echo "7 passed, {second_exit} failed in 1.00s"; exit {second_exit}
fi
echo "all args: $*"; echo "300 passed, {first_exit} failed in 2.00s"; exit {first_exit}
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def run(tmp_path: Path, first_exit: int, second_exit: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(fake_python(tmp_path, first_exit, second_exit))}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh"), "-k", "x"], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_red_first_pass_still_runs_the_avx2_pass_and_fails_at_the_end(tmp_path):
    out = run(tmp_path, 1, 0)
    assert out.returncode != 0
    assert "avx2 args: -m pytest -q -m not ray tests/test_hardware.py" in out.stdout
    summary = out.stdout.split("== make test: both passes ==")[1]
    assert "all tests (exit 1): 300 passed, 1 failed" in summary
    assert "as an AVX2-only CPU (exit 0): 7 passed, 0 failed" in summary


def test_a_red_second_pass_fails_and_green_both_pass(tmp_path):
    assert run(tmp_path, 0, 1).returncode != 0
    green = run(tmp_path, 0, 0)
    assert green.returncode == 0 and "-k x" in green.stdout
