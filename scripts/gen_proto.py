"""Regenerates pdserve_api/ from proto/pdserve_api/*.proto (run after editing a .proto).

python scripts/gen_proto.py            # write into pdserve_api/
python scripts/gen_proto.py --out DIR  # write elsewhere (the staleness test compares)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.glob("pdserve_api/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out / "pdserve_api").glob("*_pb2*.py*"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT)
    args = ap.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
