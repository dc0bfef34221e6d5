"""The committed generated code is what the .proto sources generate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "pdserve_api").glob("*_pb2*.py*")}
    committed = {p.name: p.read_bytes() for p in (ROOT / "pdserve_api").glob("*_pb2*.py*")}
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code, run scripts/gen_proto.py: {stale}"


def test_generated_package_is_not_named_proto():
    import pdserve_api.generate_pb2 as g
    import proto  # proto-plus, pulled in by ray[serve]

    assert "proto-plus" in (proto.__doc__ or "") or hasattr(proto, "Message")
    assert g.DESCRIPTOR.package == "pdserve.v1"
