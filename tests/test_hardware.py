"""The CPU class, dtype `auto` and the guarded fast paths (engine/hardware.py), checked in fresh
processes so that each sees its own environment: the machine as it is, and the same machine told
to act as an AVX2-only CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AVX2 = {"PDSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
AS_IS = ("PDSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
x86_only = pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86 CPU classes")

PROBE = """
import json, logging, sys, torch
logging.basicConfig(level=logging.INFO)
from engine.hardware import can_prepack, cpu_features, resolve_dtype
from engine import LLMEngine, EngineConfig
cpu = cpu_features()
out = {"isa": cpu.isa, "native_bf16": cpu.native_bf16, "flags": cpu.kernel_flags,
       "auto": str(resolve_dtype("auto", torch.device("cpu"))),
       "prepack_bf16": can_prepack(torch.bfloat16), "prepack_fp32": can_prepack(torch.float32)}
if len(sys.argv) > 1:
    for dtype, kernel in (("auto", "auto"), ("bfloat16", "auto"), ("auto", "onednn"), ("bfloat16", "onednn")):
        e = LLMEngine(EngineConfig(model=sys.argv[1], dtype=dtype, device="cpu", num_kv_blocks=32, block_size=4,
                                   linear_kernel=kernel))
        from engine import SamplingParams
        e.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while e.has_unfinished():
            e.step()
        qkv = e.runner.model.w.layers[0].qkv
        out[f"{dtype} {kernel}"] = {"dtype": str(e.dtype), "packed": qkv.packed is not None,
                      "ordered": qkv.panels is not None, "weight_kept": qkv.weight is not None,
                      "kernels": e.runner.use_cpu_kernels}
print(json.dumps(out))
"""


def probe(env: dict, *args: str) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in AS_IS} | env
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=full, cwd=ROOT, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"stderr": r.stderr}


@x86_only
def test_acting_as_avx2_picks_fp32_and_skips_bf16_prepack():
    got = probe(AVX2)
    assert got["isa"] == "avx2" and not got["native_bf16"]
    assert got["auto"] == "torch.float32"
    assert not got["prepack_bf16"] and got["prepack_fp32"]
    assert "-mavx2" in got["flags"] and not any(f.startswith("-mavx512") for f in got["flags"])


@x86_only
def test_acting_as_avx2_runs_both_dtypes(tiny_llama):
    got = probe(AVX2, str(tiny_llama))
    # auto: the ordered kernel's panels in either dtype, the only copy of the weight
    for dtype in ("auto", "bfloat16"):
        assert got[f"{dtype} auto"]["ordered"] and not got[f"{dtype} auto"]["weight_kept"]
    assert got["auto auto"]["dtype"] == "torch.float32" and got["bfloat16 auto"]["dtype"] == "torch.bfloat16"
    assert "linears: the ordered kernel (torch.float32, CPU class avx2, linear_kernel auto)" in got["stderr"]
    # onednn: its prepacked fp32 weight alone; in bf16, which it cannot run here, F.linear's
    assert got["auto onednn"]["packed"] and not got["auto onednn"]["weight_kept"]
    assert not got["bfloat16 onednn"]["packed"] and got["bfloat16 onednn"]["weight_kept"]
    assert "without native bfloat16" in got["stderr"] and "emulated" in got["stderr"]


@x86_only
def test_auto_runs_the_ordered_linears_where_they_measured_faster(tiny_llama):
    """This machine's class and dtype decide (engine/hardware.py ORDERED_LINEARS); onednn overrides."""
    from engine.hardware import ORDERED_LINEARS

    got = probe({}, str(tiny_llama))
    for dtype in ("auto", "bfloat16"):
        expected = any(got[f"{dtype} auto"]["dtype"] == str(d) for d in ORDERED_LINEARS.get(got["isa"], ()))
        assert got[f"{dtype} auto"]["ordered"] == expected, (got["isa"], dtype)
        assert not got[f"{dtype} onednn"]["ordered"]


def cpuinfo_class() -> str | None:
    """The x86 class /proc/cpuinfo's flags describe (independent of torch, which the engine asks)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    flags = set(line.split(":", 1)[1].split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "amx" if "amx_tile" in flags else "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "generic"


@x86_only
def test_the_machine_as_it_is():
    """The class the engine finds is the one the CPU's flags name, and `auto` follows it."""
    got, expected = probe({}), cpuinfo_class()
    if expected is None:
        pytest.skip("no /proc/cpuinfo flags to check against")
    assert got["isa"] == expected
    native = expected in ("amx", "avx512_bf16")
    assert got["native_bf16"] == native and got["prepack_bf16"] == native
    assert got["auto"] == ("torch.bfloat16" if native else "torch.float32")


@x86_only
def test_the_override_lowers_the_class_never_raises_it():
    real = probe({})["isa"]
    assert probe({"PDSERVE_CPU_ISA": "amx"})["isa"] == real
    generic = probe({"PDSERVE_CPU_ISA": "generic"})
    assert generic["isa"] == "generic" and generic["flags"] == [] and generic["auto"] == "torch.float32"


def test_a_bad_override_names_the_variable():
    full = os.environ | {"PDSERVE_CPU_ISA": "avx9000"}
    r = subprocess.run(
        [sys.executable, "-c", "from engine.hardware import cpu_features; cpu_features()"],
        capture_output=True,
        text=True,
        env=full,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode != 0 and "PDSERVE_CPU_ISA must be one of" in r.stderr and "avx9000" in r.stderr


def test_auto_is_logged_once_with_its_reason():
    """In a fresh process (an earlier test's engine may have logged it already in this one)."""
    script = (
        "import logging, torch; logging.basicConfig(level=logging.INFO)\n"
        "from engine.hardware import cpu_features, resolve_dtype\n"
        "for _ in range(3): resolve_dtype('auto', torch.device('cpu'))\n"
        "print(cpu_features().isa)"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "dtype auto" in line]
    assert len(lines) == 1 and f"CPU class {r.stdout.strip()}" in lines[0], r.stderr


def test_a_failed_kernel_build_falls_back_one_class_at_a_time():
    """A compiler without -mavx512bf16 still builds the AVX-512 kernels, not plain C++."""
    from engine.hardware import KERNEL_FLAGS, CpuFeatures

    amx = CpuFeatures("x86_64", "amx", True, True, "test").kernel_flag_choices
    assert amx == [KERNEL_FLAGS["amx"], KERNEL_FLAGS["avx512"], KERNEL_FLAGS["avx2"], []]
    assert "-mavx512bf16" in amx[0] and "-mavx512bf16" not in amx[1]
    assert CpuFeatures("aarch64", "neon", False, False, "test").kernel_flag_choices == [KERNEL_FLAGS["neon"], []]
    assert CpuFeatures("x86_64", "generic", False, False, "test").kernel_flag_choices == [[]]
