"""The house's shape, checked: the layers' order (pyproject.toml [tool.importlinter], run by
import-linter: the command, then the router and the nodes, then the serving layer, the KV
transport, the engine; no import cycle inside a package), short functions on the request path,
and ruff's lint and format clean."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "pdserve_api", "kvtransfer", "serving", "router", "prefill_node", "decode_node", "pdserve")
# A request's way through the code: no function here may grow past MAX_LINES.
REQUEST_PATH = (
    "router/server.py",
    "router/request.py",
    "router/frontend.py",
    "router/pool.py",
    "prefill_node/server.py",
    "decode_node/server.py",
    "serving/node.py",
    "engine/llm_engine.py",
    "engine/scheduler.py",
    "engine/async_engine.py",
    "kvtransfer/receiver.py",
    "kvtransfer/sender.py",
    "kvtransfer/shm.py",
    "kvtransfer/tcp.py",
    "kvtransfer/grpc_stream.py",
)
MAX_LINES = 60


def tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    assert path, f"{name} is missing: make install (the test extra) installs it"
    return path


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([tool("lint-imports")], cwd=root, capture_output=True, text=True, timeout=300, env=env)


def test_the_import_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout and r.stdout.count(" KEPT") >= 4, r.stdout


def test_an_import_from_a_lower_layer_breaks_them(tmp_path):
    """The check can fail: a copy of the tree whose engine imports the serving layer is refused,
    and the report names the import."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "engine" / "config.py", "a") as f:
        f.write("\nimport serving.options  # noqa\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout
    assert "engine.config -> serving.options" in r.stdout, r.stdout


def test_no_function_on_the_request_path_is_long():
    long = []
    for name in REQUEST_PATH:
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert not long, long


def test_ruff_lint_and_format_are_clean():
    ruff = tool("ruff")
    lint = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run([ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_the_installed_command_and_every_package_work_outside_the_checkout(tmp_path):
    """`make install` installs every package (a package missing from pyproject's list imports
    only from the checkout's root: the README's `make demo` failed with `No module named
    'serving'`)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    imports = "; ".join(f"import {p}" for p in PACKAGES)
    r = subprocess.run([sys.executable, "-c", imports], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([tool("pdserve"), "serve", "--help"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "--address" in r.stdout, r.stderr[-2000:]
