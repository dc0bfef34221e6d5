"""y = x @ W.T + b, the weight packed once: for engine/csrc/ordered_linear.cpp, or for oneDNN.

On a CPU the weight is reordered once into oneDNN's blocked layout, the one its kernels for this
CPU want (AMX or AVX-512 for bf16, AVX2 or AVX-512 for fp32), and only that copy is kept, not
the checkpoint's layout beside it. Measured at decode batch sizes:
bf16 25-45% faster than F.linear, fp32 1.6x faster at 64 rows on AVX2. Where oneDNN cannot
(bf16 on a CPU without native bf16, fp16 on most CPUs, CUDA) it is plain F.linear;
engine/hardware.py decides.

With quantization int8 or int4 the weight is kept as codes of that many bits, asymmetric in groups
of GROUP along k (a fp32 scale and zero a group and output channel), in the quantized kernel's
panels (engine/csrc/ordered_linear.cpp): a step reads a byte (int8) or half a byte (int4) a weight
and a quarter of a byte for the scales and zeros (8 bytes a group of 32); the kernel turns them into the model dtype's
arithmetic in registers (bf16 pairs where the CPU has AVX512_BF16) and sums each output in k order
like the ordered kernel.

With kernel `ordered` the weight is packed instead for engine/csrc/ordered_linear.cpp, whose every
output is summed in k order whatever else is in the batch (a BLAS picks its blocking, and the order
of a row's sums, by the shape it is given): what deterministic mode needs, and the faster kernel by
default where engine/hardware.py says it measured so.

With `onednn_chunks` oneDNN's prepacked kernel is only ever called on CHUNK_ROWS rows, the last
chunk padded with zero rows: one shape, so one blocking and one order of every row's sums, and a
row's bits do not depend on the other rows or on its place in the chunk (tests/test_deterministic.py
checks both, and the engine checks them again at load on the CPU it runs on). The batch-invariant
kernel that keeps oneDNN's AMX tiles, at the cost of a chunk's work for fewer rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.hardware import can_prepack

PACK_FOR_BATCH = 64  # oneDNN's hint for the row count; any count works
GROUP = 32  # k a quantized group spans (engine/csrc/ordered_linear.cpp GROUP): a GGUF block's
BITS = {"int8": 8, "int4": 4}  # the quantizations' code sizes
CHUNK_ROWS = 32  # the one row count onednn_chunks calls oneDNN with: two AMX tiles of 16 rows


class Linear:
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        kernel: str = "onednn",
        quantization: str = "none",
    ):
        """kernel: onednn (F.linear where oneDNN cannot prepack), ordered or onednn_chunks, as
        EngineConfig.linear_kernel resolves (engine/model_runner.py); a quantization runs its own."""
        self.weight = weight  # [out, in]
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.dtype = weight.dtype  # the dtype the packed layouts take
        self.packed = self.panels = self.scales = self.zeros = None
        self.bits = BITS.get(quantization)
        self.chunk_rows = 0
        # The packed layout holds the weight: the engine keeps that copy only.
        if self.bits:
            self._pack_codes(*quantize_groups(weight, self.bits))
        elif kernel == "ordered":
            self.panels = torch.ops.pdserve.ordered_linear_pack(weight.contiguous())
            self.weight = None
        elif weight.device.type == "cpu" and can_prepack(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_BATCH)
            self.chunk_rows = CHUNK_ROWS if kernel == "onednn_chunks" else 0
            self.weight = None
        elif kernel == "onednn_chunks":
            raise ValueError(
                f"linear_kernel onednn_chunks: oneDNN cannot prepack {weight.dtype} on this {weight.device}"
            )

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        quantization: str,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> Linear:
        """A quantized linear from codes already made (a GGUF file's own blocks, engine/gguf_blocks.py)."""
        self = cls.__new__(cls)
        self.out_features, self.in_features = codes.shape
        self.bias, self.dtype, self.packed, self.bits, self.chunk_rows = bias, dtype, None, BITS[quantization], 0
        self._pack_codes(codes, scales, zeros)
        return self

    def _pack_codes(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        self.panels, self.scales, self.zeros = torch.ops.pdserve.quant_linear_pack(
            codes, scales, zeros, self.bits, self.dtype
        )
        self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            if x.shape[-1] != self.in_features:  # the panels' padding would hide a K off by one
                raise ValueError(f"linear: input of {x.shape[-1]} features, the weight takes {self.in_features}")
            if x.dtype != self.dtype:  # the panels were laid out for one dtype's arithmetic
                raise ValueError(f"linear: input in {x.dtype}, the weight was packed for {self.dtype}")
            if self.bits:
                return torch.ops.pdserve.quant_linear(
                    x.contiguous(), self.panels, self.scales, self.zeros, self.bias, self.bits, self.out_features
                )
            return torch.ops.pdserve.ordered_linear(x.contiguous(), self.panels, self.bias, self.out_features)
        if self.chunk_rows:
            return self._in_chunks(x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _in_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN on CHUNK_ROWS rows a call, whatever the batch: x [M, K] padded to whole chunks."""
        lead, c = x.shape[:-1], self.chunk_rows
        x = x.reshape(-1, self.in_features)
        rows = x.shape[0]
        if rows % c:
            padded = x.new_zeros(-(-rows // c) * c, self.in_features)
            padded[:rows] = x
            x = padded
        chunks = [
            torch.ops.mkldnn._linear_pointwise(x[i : i + c], self.packed, self.bias, "none", [], "")
            for i in range(0, x.shape[0], c)
        ]
        y = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        return y[:rows].reshape(*lead, self.out_features)


def rows_invariant(linear: Linear, seed: int = 0) -> bool:
    """Whether each row's output bits are the same alone, in a chunk of other rows and at another
    place in it (a few random rows; what onednn_chunks rests on, checked on the CPU at hand)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(CHUNK_ROWS + 3, linear.in_features, generator=gen).to(linear.dtype)
    together = linear(rows)
    moved = linear(rows.roll(5, dims=0)).roll(-5, dims=0)
    alone = torch.cat([linear(rows[i : i + 1]) for i in (0, CHUNK_ROWS - 1, CHUNK_ROWS + 2)])
    return torch.equal(together, moved) and torch.equal(alone, together[[0, CHUNK_ROWS - 1, CHUNK_ROWS + 2]])


def quantize_groups(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric in groups of GROUP along k: weight[n, k] ~ codes[n, k] * scales[n, g] + zeros[n, g]
    (g = k // GROUP), codes in [0, 2**bits - 1] rounded to nearest, so every weight within half a
    scale; the zero is the group's least weight, the scale its range over the levels (a GGUF Q4_1
    block's d and m at 4 bits). Returns (codes [N, K] uint8, scales [N, G] fp32, zeros [N, G] fp32)."""
    w = weight.float()
    if not torch.isfinite(w).all():  # a NaN or inf would spread over its group's every weight
        raise ValueError(f"quantization: a weight of shape {tuple(w.shape)} holds NaN or inf; it cannot be quantized")
    n, k = w.shape
    groups = -(-k // GROUP)
    if groups * GROUP > k:  # the last group repeats its last weight: the same least and range
        w = torch.cat([w, w[:, -1:].expand(n, groups * GROUP - k)], dim=1)
    w = w.reshape(n, groups, GROUP)
    zeros, levels = w.amin(dim=2), 2**bits - 1
    scales = (w.amax(dim=2) - zeros) / levels
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: codes 0
    codes = torch.round((w - zeros[..., None]) / scales[..., None]).clamp(0, levels).to(torch.uint8)
    return codes.reshape(n, groups * GROUP)[:, :k].contiguous(), scales.contiguous(), zeros.contiguous()


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The fp32 weights quantize_groups' codes stand for (code * scale + zero)."""
    g = torch.arange(codes.shape[1]) // GROUP
    return codes.float() * scales[:, g] + zeros[:, g]
