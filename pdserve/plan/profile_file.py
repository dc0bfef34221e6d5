"""The profile file `pdserve plan profile` writes and the simulator and the planner's autoscaling
policy read: JSON, owner-only. Light (no torch): Serve's controller loads it."""

from __future__ import annotations

import json
import os
from pathlib import Path

VERSION = 2


def write(result: dict, path: str | Path) -> None:
    """Owner-only, replaced whole."""
    tmp = Path(f"{path}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def load(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: a profile of version {data.get('version')!r}; this pdserve reads {VERSION}")
    return data
