"""What this machine can do fast, asked once, and the choices that follow from it: the device,
the dtype `auto` resolves to, whether oneDNN may prepack a linear's weight, and the instruction
set the C++ kernels are built for.

The CPU class comes from what torch and oneDNN report at run time (so ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA are honoured), with /proc/cpuinfo only as a fallback, never from the machine
the code was written on. PDSERVE_CPU_ISA=avx2 (or generic, avx512, ...) makes the engine act as a
lesser CPU class than the one it runs on, so a developer on an AVX-512 or AMX machine can run the
AVX2 path; it can lower the class, never raise it.

| class        | CPUs                                   | dtype auto | linears (auto)          | kernels built with |
| ------------ | -------------------------------------- | ---------- | ----------------------- | ------------------ |
| amx          | Xeon Sapphire Rapids and later         | bfloat16   | oneDNN, prepacked       | AVX-512 + BF16     |
| avx512_bf16  | Xeon Cooper Lake, AMD Zen 4 and later  | bfloat16   | bf16: ordered; fp32: oneDNN | AVX-512 + BF16 |
| avx512       | Xeon Skylake-SP .. Ice Lake            | float32    | oneDNN, prepacked       | AVX-512            |
| avx2         | AMD Zen 1-3, Intel client CPUs, ...    | float32    | ordered                 | AVX2 + FMA         |
| neon         | aarch64 (Graviton, Ampere, Apple, ...) | float32 *  | oneDNN where it can     | -mcpu=native       |
| generic      | anything else                          | float32    | oneDNN where it can     | plain C++          |

(*) bfloat16 where the core has the bf16 extension and oneDNN supports it (Graviton 3 and later).

"ordered" is engine/csrc/ordered_linear.cpp, deterministic mode's kernel, built for the class's
own flags (not a lesser build it fell back to): for these classes and dtypes it measured
1.48-1.75x oneDNN's prepacked weights on a lone stream, 1.00-1.06x on a full batch and 0.94-1.00x
on a prefill (docs/benchmarks.md#engine, "Linears"). fp32 on AVX-512 measured both ahead and behind
oneDNN's (0.85-0.89x at 64-1,024 rows with two threads), AMX runs tile instructions the kernel
does not, and Arm is unmeasured: those keep oneDNN.

Deterministic mode needs batch-invariant linears: the ordered kernel, or on AMX oneDNN called on
fixed chunks of rows (engine/linear.py onednn_chunks), which keeps the AMX tiles: on a 2-core AMX
Xeon oneDNN's tiles ran a 32-row batch 2.1x the ordered kernel's tokens/s (issue 64); on
AVX512_BF16 the chunks measured slower than the ordered kernel at every row count, so the mode
keeps it there (docs/benchmarks.md#deterministic).
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ISA_ENV = "PDSERVE_CPU_ISA"
X86_CLASSES = ("generic", "avx2", "avx512", "avx512_bf16", "amx")  # ascending
ARM_CLASSES = ("generic", "neon")
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"]
_AVX512_BF16 = _AVX512 + ["-mavx512bf16"]
# linear_kernel auto -> the ordered kernel, per class and dtype (where it measured faster; above)
ORDERED_LINEARS = {"avx2": (torch.float32, torch.bfloat16), "avx512_bf16": (torch.bfloat16,)}
KERNEL_FLAGS = {
    "amx": _AVX512_BF16,
    "avx512_bf16": _AVX512_BF16,
    "avx512": _AVX512,
    "avx2": _AVX2,
    "neon": ["-mcpu=native"],
    "generic": [],
}


@dataclass(frozen=True)
class CpuFeatures:
    arch: str  # platform.machine(): x86_64, aarch64, ...
    isa: str  # the class above
    native_bf16: bool  # bf16 matmuls run in hardware (AMX, AVX512_BF16, Arm's bf16)
    onednn_bf16: bool  # oneDNN's bf16 kernels may be used (prepack)
    reason: str  # how the class was decided, for logs

    @property
    def kernel_flags(self) -> list[str]:
        return KERNEL_FLAGS[self.isa]

    @property
    def kernel_flag_choices(self) -> list[list[str]]:
        """This class's flags, then each lesser class's (a compiler may lack the newest ISA's)."""
        classes = X86_CLASSES if self.isa in X86_CLASSES else ARM_CLASSES
        choices = []
        for isa in reversed(classes[: classes.index(self.isa) + 1]):
            if KERNEL_FLAGS[isa] not in choices:
                choices.append(KERNEL_FLAGS[isa])
        return choices


def _cpuinfo(*keys: str) -> str:
    """The first /proc/cpuinfo line's value for any of these keys ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(keys):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _proc_flags() -> set[str]:
    return set(_cpuinfo("flags", "Features").split())


@cache
def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD, an Arm implementer's id: two vendors' instructions of one
    class may round alike or not (deterministic mode's numerics name it)."""
    return _cpuinfo("vendor_id", "CPU implementer") or platform.processor() or "unknown"


def _x86_class() -> tuple[str, str]:
    """The class torch and oneDNN will actually run, and how that was decided."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()  # honours ATEN_CPU_CAPABILITY
        amx, bf16 = torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_bf16_supported()
        source = f"torch reports {capability}"
    except (AttributeError, RuntimeError):  # an older or unusual torch: read the flags ourselves
        flags = _proc_flags()
        capability = (
            "AVX512"
            if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
            else "AVX2"
            if {"avx2", "fma"} <= flags
            else "DEFAULT"
        )
        amx, bf16 = "amx_tile" in flags, "avx512_bf16" in flags
        source = f"/proc/cpuinfo says {capability}"
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if capability == "AVX512":
        if amx and onednn_bf16:
            return "amx", source + " with AMX"
        if bf16 and onednn_bf16:
            return "avx512_bf16", source + " with AVX512_BF16"
        return "avx512", source
    if capability == "AVX2":
        return "avx2", source
    return "generic", source


@cache
def cpu_features() -> CpuFeatures:
    arch = platform.machine().lower()
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if arch in ("x86_64", "amd64"):
        classes = X86_CLASSES
        isa, reason = _x86_class()
    elif arch in ("aarch64", "arm64"):
        classes = ARM_CLASSES
        isa, reason = "neon", "aarch64"
    else:
        classes = ("generic",)
        isa, reason = "generic", f"{arch or 'unknown'} CPU"
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if wanted:
        if wanted not in classes:
            raise ValueError(f"{ISA_ENV} must be one of {classes} on this {arch} CPU, got {wanted!r}")
        if classes.index(wanted) < classes.index(isa):
            isa, reason = wanted, f"{ISA_ENV}={wanted} (the CPU is {isa}: {reason})"
    if isa in ("amx", "avx512_bf16"):
        native = True
    elif isa == "neon":
        native = onednn_bf16 and "bf16" in _proc_flags()
    else:
        native = False
    # Acting as a class below AVX-512 on x86 means acting without oneDNN's bf16 kernels too.
    if arch in ("x86_64", "amd64") and classes.index(isa) < classes.index("avx512"):
        onednn_bf16 = False
    return CpuFeatures(arch, isa, native, onednn_bf16, reason)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_logged: set[tuple] = set()


def _log_once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The one place that decides the compute dtype. `auto` is what is fast and supported on the
    device: bf16 on CUDA (fp16 on GPUs before Ampere) and on CPUs with native bf16, fp32 on
    other CPUs. An explicit dtype is honoured, with a warning when this CPU runs it slowly."""
    if device.type == "cuda":
        if dtype == "auto":
            chosen = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            _log_once(logging.INFO, f"dtype auto -> {_name(chosen)} on {torch.cuda.get_device_name(device)}")
            return chosen
        return _DTYPES[dtype]
    cpu = cpu_features()
    if dtype == "auto":
        chosen = torch.bfloat16 if cpu.native_bf16 else torch.float32
        why = (
            "native bf16 matmuls"
            if cpu.native_bf16
            else "no native bf16 on this CPU, where bf16 matmuls are emulated and slower"
        )
        _log_once(logging.INFO, f"dtype auto -> {_name(chosen)}: CPU class {cpu.isa} ({cpu.reason}); {why}")
        return chosen
    chosen = _DTYPES[dtype]
    if chosen != torch.float32 and not cpu.native_bf16:
        _log_once(
            logging.WARNING,
            f"dtype {dtype} on a CPU of class {cpu.isa} without native {dtype} ({cpu.reason}): it runs, "
            f"emulated (its matmuls convert each value to float32): slower than float32 on full batches, several "
            f"times where the linears run F.linear (--linear-kernel onednn, or no C++ kernels); --dtype auto picks "
            f"float32 here",
        )
    return chosen


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@cache
def can_prepack(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear (engine/linear.py) works for this dtype on this CPU:
    asked of oneDNN, then tried once on a small matrix and checked against F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    cpu = cpu_features()
    if dtype == torch.bfloat16 and not cpu.onednn_bf16:
        return False
    if dtype == torch.float16 and not (cpu.onednn_bf16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 64, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        ok = torch.allclose(got.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
    except RuntimeError as e:
        _log_once(logging.INFO, f"oneDNN prepack unavailable for {_name(dtype)}, using F.linear: {e}")
        return False
    if not ok:
        _log_once(logging.WARNING, f"oneDNN prepack for {_name(dtype)} disagrees with F.linear; using F.linear")
    return ok
