"""Builds (once, cached by torch) and loads the engine's C++ CPU kernels.

Compiled on the machine that runs them, for the instruction set of its CPU class
(engine/hardware.py: AVX2+FMA, AVX-512, AVX-512 with BF16, aarch64's own), so a build never uses
an instruction the CPU lacks, and acting as a lesser class (PDSERVE_CPU_ISA=avx2) builds and runs
the AVX2 code. If that build fails (a compiler without the newest ISA's flags), each lesser
class's is tried, down to plain C++; without a compiler, or if all fail, `load()` returns False
and the engine uses plain torch instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from functools import cache
from pathlib import Path

import torch

from engine.hardware import cpu_features

log = logging.getLogger(__name__)
SOURCES = [str(p) for p in sorted((Path(__file__).parent / "csrc").glob("*.cpp"))]
# What the kernels compute (deterministic mode's numerics name it: two versions of a kernel may sum
# in two orders).
_CSRC = Path(__file__).parent / "csrc"
SOURCE_DIGEST = hashlib.sha1(
    b"".join(p.read_bytes() for p in sorted([*_CSRC.glob("*.cpp"), *_CSRC.glob("*.h")]))
).hexdigest()[:12]
OPS = (
    "paged_decode_attention",
    "add_rms_norm",
    "rope",
    "silu_mul",
    "ordered_linear",
    "ordered_linear_pack",
    "quant_linear",
    "quant_linear_pack",
)
# -ffast-math lets the dot-product reductions vectorize (reassociation) and lets expf use glibc's
# vector variants; the kernel keeps every value finite (its running max starts at -FLT_MAX).
BASE_FLAGS = ["-O3", "-ffast-math", "-fopenmp"]


def _name(isa_flags: list[str]) -> str:
    return f"pdserve_cpu_kernels_{hashlib.sha1(' '.join(isa_flags).encode()).hexdigest()[:8]}"


def build_directory(isa_flags: list[str]) -> Path:
    """Where torch builds (and caches) the kernels for these flags (TORCH_EXTENSIONS_DIR honoured)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(_name(isa_flags), False))


def _build(isa_flags: list[str]) -> None:
    from torch.utils.cpp_extension import load as build

    directory = build_directory(isa_flags)
    # torch marks a build in progress with a file, `lock`, and every other process waits for it
    # to go away; a process killed mid-build (Ctrl-C on a first start, a replica stopped while
    # starting) leaves it, and each later start then waits forever. An flock ends with its
    # holder: whoever holds it builds, so whoever gets it and still finds `lock` knows it is stale.
    fd = os.open(directory / "pdserve.flock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if (directory / "lock").exists():
            log.warning("pdserve CPU kernels: removing a stale build lock left by a killed build (%s)", directory)
            (directory / "lock").unlink(missing_ok=True)
        build(
            name=_name(isa_flags),
            sources=SOURCES,
            extra_cflags=BASE_FLAGS + isa_flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    finally:
        os.close(fd)  # releases the flock


BUILT: list[str] = []  # the flags of the build load() loaded ([""]: plain C++)


@cache
def load() -> bool:
    if os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1":
        return False
    cpu = cpu_features()
    for flags in cpu.kernel_flag_choices:
        try:
            _build(flags)
        except Exception as e:  # no compiler, no headers, an ISA flag the compiler lacks
            log.warning(
                "pdserve CPU kernels: build for %s failed (%s)",
                flags or "plain C++",
                str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__,
            )
            continue
        if all(hasattr(torch.ops.pdserve, op) for op in OPS):
            BUILT.append(" ".join(flags) or "plain C++")
            log.info("pdserve CPU kernels built for %s (%s)", cpu.isa, BUILT[0])
            return True
    log.warning("pdserve CPU kernels unavailable, using plain torch attention and elementwise ops")
    return False


def decode_attention_fits(head_dim: int) -> bool:
    """The C++ decode attention takes head sizes in whole vectors (16 floats covers every CPU
    class), up to 256; other sizes attend in plain torch."""
    return head_dim % 16 == 0 and head_dim <= 256
