"""Writes deploy/serve_config.yaml, verbatim, into the RayService's serveConfigV2.

python scripts/sync_k8s.py          # rewrite deploy/k8s/base/rayservice.yaml
python scripts/sync_k8s.py --check  # exit 1 if they differ (tests/test_k8s.py does the same)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
RAYSERVICE = ROOT / "deploy" / "k8s" / "base" / "rayservice.yaml"
KEY = "  serveConfigV2: |\n"


def synced() -> str:
    text = RAYSERVICE.read_text()
    head, rest = text.split(KEY, 1)
    lines = rest.splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("    "))
    block = "".join(("    " + line) if line.strip() else "\n" for line in SERVE_CONFIG.read_text().splitlines(True))
    return head + KEY + block + "".join(lines[end:])


def main() -> int:
    text = synced()
    if "--check" in sys.argv:
        return 0 if text == RAYSERVICE.read_text() else 1
    RAYSERVICE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
