"""y = x @ W.T + b, the weight packed once: for engine/csrc/ordered_linear.cpp, or for oneDNN.

On a CPU the weight is reordered once into oneDNN's blocked layout, the one its kernels for this
CPU want (AMX or AVX-512 for bf16, AVX2 or AVX-512 for fp32), and only that copy is kept, not
the checkpoint's layout beside it. Measured at decode batch sizes:
bf16 25-45% faster than F.linear, fp32 1.6x faster at 64 rows on AVX2. Where oneDNN cannot
(bf16 on a CPU without native bf16, fp16 on most CPUs, CUDA) it is plain F.linear;
engine/hardware.py decides.

With quantization int8 the weight is kept as int8 per output channel (a scale a row) in the int8
kernel's panels (engine/csrc/ordered_linear.cpp): one byte a weight read per step, turned into
the model dtype's arithmetic in registers (bf16 pairs where the CPU has AVX512_BF16), each output
summed in k order like the ordered kernel's.

With `ordered` the weight is packed instead for engine/csrc/ordered_linear.cpp, whose every output
is summed in k order whatever else is in the batch (a BLAS picks its blocking, and the order of a
row's sums, by the shape it is given): what deterministic mode needs, and the faster kernel by
default where engine/hardware.py says it measured so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.hardware import can_prepack

PACK_FOR_BATCH = 64  # oneDNN's hint for the row count; any count works


class Linear:
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, ordered: bool = False, quantization: str = "none"
    ):
        self.weight = weight  # [out, in]
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = self.panels = self.scales = None
        # The packed layout holds the weight: the engine keeps that copy only.
        if quantization == "int8":
            self.panels, self.scales = torch.ops.pdserve.int8_linear_pack(*quantize_int8(weight), weight.dtype)
            self.weight = None
        elif ordered:
            self.panels = torch.ops.pdserve.ordered_linear_pack(weight.contiguous())
            self.weight = None
        elif weight.device.type == "cpu" and can_prepack(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_BATCH)
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            if x.shape[-1] != self.in_features:  # the panels' padding would hide a K off by one
                raise ValueError(f"linear: input of {x.shape[-1]} features, the weight takes {self.in_features}")
            if self.scales is not None:
                return torch.ops.pdserve.int8_linear(
                    x.contiguous(), self.panels, self.scales, self.bias, self.out_features
                )
            return torch.ops.pdserve.ordered_linear(x.contiguous(), self.panels, self.bias, self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: (q [N, K] int8 in [-127, 127], scale [N] fp32), weight ~ scale[n] * q[n, k]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()
