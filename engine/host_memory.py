"""A CPU engine's step buffers reused, not page-faulted in again every step.

glibc's malloc serves each request over 32 MiB (its largest mmap threshold) with a fresh mmap and
hands it back to the kernel on free, so the next step's buffer of that size is touched page by
page again (~2 GB/s here). A step's activations pass that size soon: one thread, fp32, the default
model, a prefill step of 6 x 600 tokens made 324,000-364,000 minor page faults (its MLP's 42 MiB
gate-up output, in each of 30 layers) and took 1.11x the time it takes without them (median of
three pairs; docs/benchmarks.md at 0f5299a, "Prefill steps over 32 MiB of activations").

keep_freed_buffers() has malloc take every request from its heaps and keep what is freed there for
the next one: the process's resident memory stays at its peak instead of falling back between
steps. Only glibc has these knobs (mallopt); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import platform
from functools import cache

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_MAX = -4
KEEP_BYTES = (1 << 31) - 1  # free memory at a heap's top kept up to this (mallopt takes an int)


@cache
def keep_freed_buffers() -> bool:
    """No more mmap'd chunks, and no heap trimmed back to the kernel, in this process from now on
    (allocations made before keep theirs). Whether it took (False off glibc)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
