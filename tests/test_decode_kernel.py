"""The paged decode attention kernels against attention written out in torch: the C++ CPU kernel
(engine/csrc/paged_attention.cpp) and the Triton kernel for CUDA (engine/paged_decode_triton.py; on a GPU
where there is one, else in Triton's interpreter on the CPU where Triton is installed), over what
varies in the field: dtypes, head sizes, GQA group sizes, block sizes, contexts that end
mid-block, sliding windows, scattered block tables, and a batch split over threads by sequence
and by KV head."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels, cuda_kernels

# Where each kernel runs: the C++ one on the CPU with 1 or 2 threads; the Triton one on the GPU.
KERNELS = [
    pytest.param(
        "cpu", 1, marks=pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels do not build here")
    ),
    pytest.param(
        "cpu", 2, marks=pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels do not build here")
    ),
    pytest.param(
        "triton",
        1,
        marks=pytest.mark.skipif(not cuda_kernels.available(), reason="Triton is not installed"),
    ),
]
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton's interpreter (conftest.py)


CASES = [  # dtype, head_dim, heads, kv_heads, block_size, context lengths, window, softcap
    (torch.float32, 64, 9, 3, 16, [1, 15, 16, 17, 650], 0, 0.0),
    (torch.bfloat16, 64, 9, 3, 16, [1, 33, 650], 0, 0.0),
    (torch.float16, 64, 8, 8, 16, [5, 100], 0, 0.0),
    (torch.float32, 128, 32, 8, 32, [300, 31, 2], 0, 0.0),
    (torch.bfloat16, 128, 4, 1, 8, [129, 64], 0, 0.0),
    (torch.float32, 16, 4, 2, 1, [7, 3], 0, 0.0),
    (torch.float32, 80, 10, 5, 4, [50, 51], 0, 0.0),
    (torch.float32, 256, 2, 2, 16, [40], 0, 0.0),
    (torch.float32, 64, 6, 2, 16, [200, 9, 64], 24, 0.0),
    (torch.bfloat16, 32, 8, 4, 64, [130, 1], 0, 0.0),
    (torch.float32, 64, 6, 2, 16, [200, 9, 64], 24, 2.0),  # Gemma 2's soft cap (small, so that it bites)
    (torch.bfloat16, 256, 8, 4, 16, [300, 1], 0, 3.0),
]


@pytest.mark.parametrize("kernel,threads", KERNELS)
@pytest.mark.parametrize("dtype,head_dim,heads,kv_heads,block_size,lens,window,softcap", CASES)
def test_decode_kernel_matches_torch(
    dtype, head_dim, heads, kv_heads, block_size, lens, window, softcap, kernel, threads
):
    if kernel == "triton" and softcap:
        pytest.skip("the Triton kernel has no soft cap (engines with one decode through SDPA on CUDA)")
    g = torch.Generator().manual_seed(head_dim + block_size + len(lens))
    widths = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=g)  # scattered blocks, not in order
    tables, used = [], 0
    for w in widths:
        tables.append(perm[used : used + w].tolist() + [0] * (max(widths) - w))
        used += w
    block_tables = torch.tensor(tables, dtype=torch.long)
    context_lens = torch.tensor(lens, dtype=torch.long)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    # q as the model passes it: a strided view of the fused qkv rows
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(len(lens), heads, head_dim)
    out = torch.empty(len(lens), heads, head_dim, dtype=dtype)
    expected = cuda_kernels.reference_attention(
        q, k_cache, v_cache, block_tables, context_lens, block_size, window, softcap
    )
    args = (q, k_cache, v_cache, block_tables, context_lens)
    if kernel == "triton":
        args = tuple(a.to(TRITON_DEVICE) for a in args)
        out = out.to(TRITON_DEVICE)
        cuda_kernels.paged_decode_attention(out, *args, block_size, head_dim**-0.5, window)
        out = out.cpu()
    else:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            torch.ops.pdserve.paged_decode_attention(out, *args, block_size, head_dim**-0.5, window, softcap)
        finally:
            torch.set_num_threads(before)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels do not build here")
def test_head_sizes_outside_the_kernel_are_refused_by_name():
    assert cpu_kernels.decode_attention_fits(64) and cpu_kernels.decode_attention_fits(256)
    assert not cpu_kernels.decode_attention_fits(72) and not cpu_kernels.decode_attention_fits(512)
    q = torch.zeros(1, 2, 12)
    cache = torch.zeros(4, 2, 12)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of"):
        torch.ops.pdserve.paged_decode_attention(
            torch.empty_like(q),
            q,
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            4,
            1.0,
            0,
            0.0,
        )


HOPPER_BUILD = """
import inspect, subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine import paged_decode_triton as kernel

fn = kernel.paged_decode_kernel
names = list(inspect.signature(fn.fn).parameters)
for case in sys.argv[1:]:
    dtype, group, head_dim = case.split(",")
    constexprs = {"GROUP": int(group), "GROUP_PAD": 16, "HEAD_DIM": int(head_dim), "DIM_PAD": int(head_dim)}
    constexprs["TILE"] = kernel.TILE
    signature = {n: "constexpr" for n in constexprs}
    signature.update({n: "*" + dtype for n in ("out_ptr", "q_ptr", "k_ptr", "v_ptr")})
    signature.update({n: "*i64" for n in ("block_table_ptr", "context_lens_ptr")})
    signature.update({n: "i32" for n in names if n.startswith("stride") or n in ("window", "block_size")})
    signature["scale"] = "fp32"
    assert set(signature) == set(names), set(names) ^ set(signature)
    # as Triton specializes a launch: 16-byte aligned pointers, and the strides that are multiples
    # of 16 at these shapes (not the block table's, whose width varies)
    aligned = [n for n in names if n.endswith("_ptr") or (n.startswith("stride") and n != "stride_bt")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": kernel.NUM_WARPS, "enable_fp_fusion": True},
    )
    tools = Path(triton.__file__).parent / "backends/nvidia/bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:  # owner-only
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f.name], capture_output=True, check=True)
    usage = usage.stdout.decode()
    print(case, next(x for x in usage.splitlines() if "REG:" in x).strip())
"""


@pytest.mark.skipif(not cuda_kernels.available(), reason="Triton is not installed")
def test_the_triton_kernel_builds_for_hopper_without_spilling():
    """Built for an H100/H200 (sm_90) by Triton's own compiler and ptxas, no GPU needed (in a
    process of its own, out of the interpreter): the kernel compiles at the default model's and
    Llama-3-8B's shapes in bf16 and fp32, specialized as a launch is, and its tiles stay in
    registers (nothing spilled to local memory; larger tiles or fewer warps spilled in bf16),
    which is what chose paged_decode_triton's TILE and NUM_WARPS."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cases = ["bf16,3,64", "fp32,3,64", "bf16,4,128", "fp32,4,128"]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run(
        [sys.executable, "-c", HOPPER_BUILD, *cases],
        cwd=Path(__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert [x.split()[0] for x in lines] == cases
    assert all(" STACK:0 " in x for x in lines), lines  # nothing spilled to local memory


def test_an_engine_imports_no_triton():
    """Triton is imported on a CUDA engine's first kernel launch, not by importing the engine (it
    costs a CPU process a quarter of a second where it is installed)."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, engine.llm_engine, engine.attention; assert 'triton' not in sys.modules, 'triton imported'"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.skipif(not cuda_kernels.available(), reason="Triton is not installed")
def test_a_cuda_engine_checks_the_kernel_once_and_says_why_it_falls_back(monkeypatch):
    """cuda_kernels.why_not: what a CUDA engine asks as it starts (engine/model_runner.py), on the
    GPU where there is one, else on CPU tensors in Triton's interpreter. None where the kernel
    agrees with torch; else a reason naming what failed, and the engine decodes through SDPA."""
    shape = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    cpu = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert cuda_kernels.why_not(cpu, torch.bfloat16, **shape) is None
    assert cuda_kernels.why_not(cpu, torch.float32, num_heads=4, num_kv_heads=2, head_dim=16, block_size=1) is None

    def wrong(out, *args):
        out.zero_()

    def broken(out, *args):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(cuda_kernels, "paged_decode_attention", wrong)
    assert "differs from torch's attention" in cuda_kernels.why_not(cpu, torch.bfloat16, **shape)
    monkeypatch.setattr(cuda_kernels, "paged_decode_attention", broken)
    assert cuda_kernels.why_not(cpu, torch.bfloat16, **shape) == (
        "its launch failed: RuntimeError: Failed to find C compiler"
    )
    monkeypatch.setattr(cuda_kernels, "available", lambda: False)
    assert cuda_kernels.why_not(cpu, torch.bfloat16, **shape) == "Triton is not installed"
