"""Builds (once, cached by torch) and loads the engine's C++ CPU kernels.

Compiled on the machine that runs them, for its own instruction set. Without a compiler, or if
the build fails, `load()` returns False and the engine uses its plain-torch attention instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [str(p) for p in sorted((Path(__file__).parent / "csrc").glob("*.cpp"))]
# -ffast-math lets the dot-product reductions vectorize (reassociation) and lets expf use glibc's
# vector variants; the kernel keeps every value finite (its running max starts at -FLT_MAX).
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]


def _cpu_tag() -> str:
    """Binaries built with -march=native must not be reused on another CPU model."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@cache
def load() -> bool:
    if os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1":
        return False
    try:
        from torch.utils.cpp_extension import load as build

        build(name=f"pdserve_cpu_kernels_{_cpu_tag()}", sources=SOURCES, extra_cflags=CFLAGS,
              extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        return all(hasattr(torch.ops.pdserve, op) for op in ("paged_decode_attention", "add_rms_norm", "rope",
                                                             "silu_mul"))
    except Exception as e:  # no compiler, no headers: fall back to the torch path
        log.warning("pdserve CPU kernels unavailable, using plain torch attention: %s", e)
        return False
