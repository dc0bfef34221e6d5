// Fused elementwise ops for CPUs: each one pass over memory in fp32 registers instead of the
// four to six torch ops (and temporaries) it replaces. Registered under torch.ops.pdserve.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "to_float.h"

#include <cmath>
#include <cstring>

namespace {

using pdserve::to_float;

// residual += x (rounded to the model dtype, as an unfused add would), then
// x = rms_norm(residual) * weight. x, residual: [T, H]; weight: [H].
template <typename scalar_t>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* rp = residual.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = xp + r * hidden;
      scalar_t* rr = rp + r * hidden;
      float sum = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        const scalar_t s = static_cast<scalar_t>(to_float(xr[i]) + to_float(rr[i]));
        rr[i] = s;
        const float f = to_float(s);
        sum += f * f;
      }
      const float inv = 1.f / std::sqrt(sum / float(hidden) + float(eps));
      for (int64_t i = 0; i < hidden; ++i) {
        // normalize, round to the model dtype, then scale: transformers' LlamaRMSNorm order
        const float normed = to_float(static_cast<scalar_t>(to_float(rr[i]) * inv));
        xr[i] = static_cast<scalar_t>(normed * to_float(wp[i]));
      }
    }
  });
}

// Rotates q and k heads in place (rotate-half convention). qkv: [T, (Hq + 2 Hkv) * D] with q then
// k then v; positions: [T] int64; cos_sin: [P, 2, D] in the model dtype.
template <typename scalar_t>
void rope_impl(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim) {
  const int64_t rows = qkv.size(0), row_stride = qkv.stride(0), half = head_dim / 2;
  const int64_t rotated_heads = num_heads + num_kv_heads;
  scalar_t* base = qkv.data_ptr<scalar_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const scalar_t* table = cos_sin.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* cos = table + pos[r] * 2 * head_dim;
      const scalar_t* sin = cos + head_dim;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        scalar_t* x = base + r * row_stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          // x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]
          x[i] = static_cast<scalar_t>(x1 * to_float(cos[i]) - x2 * to_float(sin[i]));
          x[i + half] = static_cast<scalar_t>(x2 * to_float(cos[i + half]) + x1 * to_float(sin[i + half]));
        }
      }
    }
  });
}

// out = silu(gate) * up, gate_up: [T, 2 I] (gate first) -> out: [T, I].
template <typename scalar_t>
void silu_mul_impl(at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const scalar_t* gp = gate_up.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gp + r * 2 * inter;
      const scalar_t* u = g + inter;
      scalar_t* o = op + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float gf = to_float(g[i]);
        o[i] = static_cast<scalar_t>(gf / (1.f + std::exp(-gf)) * to_float(u[i]));
      }
    }
  });
}

#define DISPATCH(dtype, name, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, name, __VA_ARGS__)

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() && x.dim() == 2,
              "add_rms_norm: contiguous [T, H] tensors expected");
  DISPATCH(x.scalar_type(), "add_rms_norm", [&] { add_rms_norm_impl<scalar_t>(x, residual, weight, eps); });
}

void rope(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos_sin, int64_t num_heads,
          int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.stride(1) == 1 && positions.scalar_type() == at::kLong && cos_sin.is_contiguous() &&
                  cos_sin.scalar_type() == qkv.scalar_type(),
              "rope: qkv rows must be dense, positions int64, cos_sin contiguous in qkv's dtype");
  DISPATCH(qkv.scalar_type(), "rope",
           [&] { rope_impl<scalar_t>(qkv, positions, cos_sin, num_heads, num_kv_heads, head_dim); });
}

void silu_mul(at::Tensor out, const at::Tensor& gate_up) {
  TORCH_CHECK(out.is_contiguous() && gate_up.is_contiguous(), "silu_mul: contiguous tensors expected");
  DISPATCH(gate_up.scalar_type(), "silu_mul", [&] { silu_mul_impl<scalar_t>(out, gate_up); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope(Tensor(a!) qkv, Tensor positions, Tensor cos_sin, int num_heads, int num_kv_heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
}
