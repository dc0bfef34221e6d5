"""The layers' order (pyproject.toml [tool.importlinter]): engine at the bottom with no gRPC or Ray,
kvtransfer below the nodes and the router, which never import one another. A broken contract
prints the import chain that breaks it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is missing: make install (the test extra) installs it"
    r = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout and r.stdout.count(" KEPT") >= 5, r.stdout
