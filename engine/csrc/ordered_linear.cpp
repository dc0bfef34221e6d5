// y = x @ W.T + b with every output summed in one fixed order, whatever the number of rows
// (deterministic mode's linears on CPUs, engine/linear.py). Registered under torch.ops.pdserve.
//
// Each output y[m, n] is a running fp32 sum over k = 0, 1, ..., K-1 (one fused multiply-add a step,
// written as the intrinsic, where the build has FMA; a multiply then an add where it has not; in
// bf16 on a CPU with AVX512_BF16, one vdpbf16ps a step, which adds x[k+1] w[k+1] and then x[k]
// w[k], each rounded, denormals flushed), then + b[n], then one rounding to the model dtype. The
// kernel vectorizes across outputs (NR columns of W side by side), never across k. A tile computes
// up to MR rows at once, but each of its sums takes the same steps in the same order whatever the
// tile's height (the rows share the weight loads, not their arithmetic), so a row's bits depend
// neither on what else is in the batch, nor on how the rows are split between tiles or threads, nor
// on the batch's size. A BLAS picks its blocking of k by the shape it is given, which is why a row
// of a batched matmul moves with the batch.
//
// ordered_linear_pack lays W out once as panels of NR columns, k-major (column n at panel n / NR,
// lane n % NR; in pairs of k for vdpbf16ps; columns past N and the odd k past K zero): each step
// over k reads NR adjacent weights.

// Reassociating the sum over k is what this file must not do; -ffast-math (the build's flags)
// would allow it. Nor may the compiler choose, tile by tile, whether a multiply and an add become
// one FMA (GCC may keep a lone chain unfused on some -mtune), so contraction is off and the FMA
// is spelled out. Before the includes, so that the headers' inline functions (bf16 conversions)
// compile with the same options and inline.
#if defined(__clang__)
#pragma clang fp reassociate(off) contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "to_float.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

using pdserve::to_float;

#if defined(__AVX512F__)
constexpr int64_t LANES = 16;  // floats in a vector register
#elif defined(__AVX__)
constexpr int64_t LANES = 8;
#else
constexpr int64_t LANES = 4;  // SSE2, NEON; wider vectors than the registers compile to scalar code
#endif
constexpr int64_t V = 2;            // registers a tile row spans
constexpr int64_t NR = V * LANES;   // columns a tile computes side by side
// The most rows a tile computes: its MR x V sums stay in registers beside the V weight vectors and
// a row's value (32 vector registers with AVX-512; 16 with AVX: 6 x 2 + 2 + 1, the 6 x 16 tile
// of BLIS's Haswell kernels; 4 rows left 5-8 rows to two tiles, 10 ms more per decode step of the
// default model in fp32, docs/benchmarks.md#engine, "Linears").
constexpr int64_t MR = LANES == 16 ? 8 : 6;
constexpr int64_t MC = 64;          // rows whose copy stays in cache while the panels stream past

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint16_t vec_half __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vec_bits __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef vec row_acc[V];  // a tile row's NR sums

#if defined(__AVX512BF16__)
template <typename scalar_t>
constexpr bool paired = std::is_same_v<scalar_t, c10::BFloat16>;  // k in pairs, vdpbf16ps
#else
template <typename scalar_t>
constexpr bool paired = false;
#endif

// x's rows as the tile reads them: fp32, or bf16 as it is where the tile multiplies bf16 pairs.
template <typename scalar_t>
using x_t = std::conditional_t<paired<scalar_t>, c10::BFloat16, float>;

template <typename scalar_t>
int64_t padded_k(int64_t K) {
  return paired<scalar_t> ? (K + 1) / 2 * 2 : K;
}

inline vec load_lanes(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vec load_lanes(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  vec_half h;
  std::memcpy(&h, p, sizeof(h));
  const vec_bits bits = __builtin_convertvector(h, vec_bits) << 16;
  vec v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline vec load_lanes(const c10::Half* p) {
  vec v;
  for (int64_t j = 0; j < LANES; ++j) v[j] = static_cast<float>(p[j]);
  return v;
}

typedef int8_t vec_i8 __attribute__((vector_size(LANES)));
typedef int32_t vec_i32 __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vec load_lanes(const int8_t* p) {  // int8 weights as fp32, exact (vpmovsxbd, vcvtdq2ps)
#if defined(__AVX512F__)
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vec_i8 q;
  std::memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(__builtin_convertvector(q, vec_i32), vec);
#endif
}

inline void store_lanes(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

inline void store_lanes(c10::BFloat16* p, vec v) {  // rounded to nearest even, as c10::BFloat16(float)
  vec_bits bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vec_bits rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
  const vec_bits nan = (vec_bits)((bits & 0x7FFFFFFF) > 0x7F800000);  // all ones where NaN
  const vec_half h = __builtin_convertvector((rounded & ~nan) | (0x7FC0 & nan), vec_half);
  std::memcpy(p, &h, sizeof(h));
}

inline void store_lanes(c10::Half* p, vec v) {
  for (int64_t j = 0; j < LANES; ++j) p[j] = static_cast<c10::Half>(v[j]);
}

// acc + x * w, one rounding where the build has FMA, two where it has not: the same either way
// for every row, whatever the tile.
inline vec mul_add(vec acc, float x, vec w) {
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps(_mm512_set1_ps(x), (__m512)w, (__m512)acc);
#elif defined(__AVX__) && defined(__FMA__)
  return (vec)_mm256_fmadd_ps(_mm256_set1_ps(x), (__m256)w, (__m256)acc);
#else
  return acc + x * w;
#endif
}

// acc[r] = sum over k of x[r, k] * panel[k, :], in k order. x: R rows of K.
template <int64_t R, typename scalar_t>
inline void tile(const float* x, int64_t K, const scalar_t* panel, row_acc acc[MR]) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    vec w[V];
    for (int64_t v = 0; v < V; ++v) w[v] = load_lanes(panel + k * NR + v * LANES);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < V; ++v) acc[r][v] = mul_add(acc[r][v], x[r * K + k], w[v]);
  }
}

#if defined(__AVX512BF16__)
// The same in bf16 pairs of k (k = 0, 2, ...), one vdpbf16ps per pair and register.
template <int64_t R>
inline void tile(const c10::BFloat16* x, int64_t K, const c10::BFloat16* panel, row_acc acc[MR]) {
  __m512 a[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) a[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh w[V];
    for (int64_t v = 0; v < V; ++v) w[v] = (__m512bh)_mm512_loadu_si512(panel + k * NR + v * 2 * LANES);
    for (int64_t r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + k, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int64_t v = 0; v < V; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], xb, w[v]);
    }
  }
  for (int64_t r = 0; r < R; ++r) std::memcpy(acc[r], a[r], sizeof(row_acc));
}

// 16 columns' pairs of k from an int8 panel packed in pairs (int8_linear_pack for bf16): int8 to
// fp32 to bf16, each exact, so the pairs are those a bf16 panel of the same integers would hold.
inline __m512bh load_pairs(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo, 16-31 from hi: column j's pair at 2j
}

// The int8 tile in bf16 pairs, each step's weights turned into bf16 in registers: the same steps
// and bits as the bf16 tile over a bf16 panel of the same integers.
template <int64_t R>
inline void tile(const c10::BFloat16* x, int64_t K, const int8_t* panel, row_acc acc[MR]) {
  __m512 a[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) a[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh w[V];
    for (int64_t v = 0; v < V; ++v) w[v] = load_pairs(panel + k * NR + v * 2 * LANES);
    for (int64_t r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + k, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int64_t v = 0; v < V; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], xb, w[v]);
    }
  }
  for (int64_t r = 0; r < R; ++r) std::memcpy(acc[r], a[r], sizeof(row_acc));
}

#endif

// The tile for the rows left, R = rows (at most MR): a tile of R rows, not MR with zero rows.
template <int64_t R = MR, typename xs_t, typename scalar_t>
inline void tile_rows(int64_t rows, const xs_t* x, int64_t K, const scalar_t* panel, row_acc acc[MR]) {
  if constexpr (R > 1)
    if (rows < R) return tile_rows<R - 1>(rows, x, K, panel, acc);
  tile<R>(x, K, panel, acc);
}

// A row of x as the tile reads it: the same values in out_t (x_t, or fp32 for the int8 tile), k
// padded with zeros to Kp.
template <typename out_t, typename scalar_t>
inline void copy_row(const scalar_t* x, int64_t K, int64_t Kp, out_t* out) {
  if constexpr (std::is_same_v<out_t, scalar_t>)
    std::memcpy(out, x, K * sizeof(scalar_t));
  else
    for (int64_t k = 0; k < K; ++k) out[k] = to_float(x[k]);
  for (int64_t k = K; k < Kp; ++k) out[k] = out_t(0);
}

// A tile row's NR sums (+ bias) into y, each rounded once to the model dtype (store_lanes, for
// the last panel's columns too); cols <= NR of them.
template <typename scalar_t>
inline void store_row(const row_acc& acc, const scalar_t* bias, int64_t cols, scalar_t* out) {
  if (cols == NR) {
    for (int64_t v = 0; v < V; ++v) store_lanes(out + v * LANES, bias ? acc[v] + load_lanes(bias + v * LANES) : acc[v]);
    return;
  }
  scalar_t last[NR];
  for (int64_t v = 0; v < V; ++v) {
    vec sums = acc[v];
    for (int64_t j = 0; bias && j < LANES && v * LANES + j < cols; ++j) sums[j] += to_float(bias[v * LANES + j]);
    store_lanes(last + v * LANES, sums);
  }
  std::memcpy(out, last, cols * sizeof(scalar_t));
}

// W [N, K] into panels of NR columns, k-major, `step` k side by side in a lane (2: bf16 pairs),
// columns past N and k past K zero.
template <typename w_t>
void pack_panels(const w_t* wp, int64_t N, int64_t K, int64_t Kp, int64_t step, w_t* pp) {
  const int64_t P = (N + NR - 1) / NR;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < NR; ++j) {
        const int64_t n = p * NR + j;
        for (int64_t k = 0; k < Kp; ++k) {
          const int64_t at = p * Kp * NR + (k / step) * NR * step + j * step + k % step;
          pp[at] = n < N && k < K ? wp[n * K + k] : w_t(0);
        }
      }
  });
}

// y = x @ W.T (x scale[n] where given) + b: the rows copied in blocks of MC as the tile reads them
// (xs_t), the panels (w_t: the model dtype's, or int8) split between threads.
template <typename xs_t, typename scalar_t, typename w_t>
void run_tiles(const at::Tensor& x, const w_t* wp, int64_t Kp, int64_t P, const float* scales,
               const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* bp = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
  scalar_t* yp = y.data_ptr<scalar_t>();
  // the rows' copy, in the tile's type, k padded to Kp (written in full before each use)
  std::unique_ptr<xs_t[]> xs(new xs_t[std::min(MC, M) * Kp]);
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t rows = std::min(MC, M - m0);
    for (int64_t r = 0; r < rows; ++r) copy_row(xp + (m0 + r) * K, K, Kp, xs.get() + r * Kp);
    // the fewest tiles, their heights differing by at most one (each tile after the first reads
    // the panel again, from cache: 8 rows go as 4 + 4, not 6 + 2)
    const int64_t tiles = (rows + MR - 1) / MR;
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      row_acc acc[MR];
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
          const int64_t height = rows / tiles + (t < rows % tiles);
          tile_rows(height, xs.get() + r0 * Kp, Kp, wp + p * Kp * NR, acc);
          for (int64_t r = 0; r < height; ++r) {
            if (scales)
              for (int64_t v = 0; v < V; ++v) acc[r][v] = acc[r][v] * load_lanes(scales + n0 + v * LANES);
            store_row(acc[r], bp ? bp + n0 : nullptr, cols, yp + (m0 + r0 + r) * N + n0);
          }
          r0 += height;
        }
      }
    });
  }
}

#define DISPATCH(dtype, name, ...)                                \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                      AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

at::Tensor ordered_linear_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "ordered_linear_pack: a contiguous [N, K] weight expected");
  at::Tensor panels;
  DISPATCH(weight.scalar_type(), "ordered_linear_pack", [&] {
    const int64_t P = (weight.size(0) + NR - 1) / NR;
    const int64_t Kp = padded_k<scalar_t>(weight.size(1));
    panels = at::empty({P, Kp * NR}, weight.options());
    pack_panels(weight.data_ptr<scalar_t>(), weight.size(0), weight.size(1), Kp, paired<scalar_t> ? 2 : 1,
                panels.data_ptr<scalar_t>());
  });
  return panels;
}

at::Tensor ordered_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                          int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "ordered_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(panels.dim() == 2 && panels.is_contiguous() && panels.scalar_type() == x.scalar_type() &&
                  out_features >= 0 && panels.size(0) == (out_features + NR - 1) / NR,
              "ordered_linear: panels must come from ordered_linear_pack, in x's dtype");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == out_features &&
                                    bias->scalar_type() == x.scalar_type()),
              "ordered_linear: bias must be [N] in x's dtype");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  DISPATCH(x.scalar_type(), "ordered_linear", [&] {
    const int64_t Kp = padded_k<scalar_t>(x.size(1));
    TORCH_CHECK(panels.size(1) == Kp * NR, "ordered_linear: panels packed for another K");
    run_tiles<x_t<scalar_t>, scalar_t>(x, panels.data_ptr<scalar_t>(), Kp, panels.size(0), nullptr, bias, y);
  });
  return y;
}

// Weight-only int8 (engine/linear.py, quantization int8): W = scale[n] * q[n, k], q in [-127, 127],
// packed in panels as the model dtype's weights are (k-major, NR columns a step, in pairs of k for
// bf16 with AVX512_BF16), so DRAM gives one byte per weight. The tile turns each step's weights
// into the model dtype's tile type in registers (exact: fp32, or bf16 pairs for vdpbf16ps) and
// every output is a sum over k in order, then times scale[n], + b[n], one rounding: batch-invariant like
// the ordered kernel, with a bf16 model's arithmetic that of the bf16 tile.
// q: [N, K] int8, scales: [N] fp32, for x of `dtype` -> (panels, scales padded to whole panels).
std::tuple<at::Tensor, at::Tensor> int8_linear_pack(const at::Tensor& q, const at::Tensor& scales, at::ScalarType dtype) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "int8_linear_pack: a contiguous [N, K] int8 weight expected");
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == q.size(0) && scales.scalar_type() == at::kFloat,
              "int8_linear_pack: scales must be [N] float32");
  const int64_t P = (q.size(0) + NR - 1) / NR;
  at::Tensor panels;
  DISPATCH(dtype, "int8_linear_pack", [&] {
    const int64_t Kp = padded_k<scalar_t>(q.size(1));
    panels = at::empty({P, Kp * NR}, q.options());
    pack_panels(q.data_ptr<int8_t>(), q.size(0), q.size(1), Kp, paired<scalar_t> ? 2 : 1, panels.data_ptr<int8_t>());
  });
  at::Tensor padded = at::zeros({P * NR}, scales.options());
  padded.narrow(0, 0, q.size(0)).copy_(scales);
  return {panels, padded};
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int8_linear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK(panels.dim() == 2 && panels.is_contiguous() && panels.scalar_type() == at::kChar &&
                  out_features >= 0 && panels.size(0) == (out_features + NR - 1) / NR &&
                  scales.numel() == panels.size(0) * NR && scales.scalar_type() == at::kFloat,
              "int8_linear: panels and scales must come from int8_linear_pack");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == out_features &&
                                    bias->scalar_type() == x.scalar_type()),
              "int8_linear: bias must be [N] in x's dtype");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  DISPATCH(x.scalar_type(), "int8_linear", [&] {
    const int64_t Kp = padded_k<scalar_t>(x.size(1));
    TORCH_CHECK(panels.size(1) == Kp * NR, "int8_linear: panels packed for another K or dtype");
    const float* sp = scales.data_ptr<float>();
    run_tiles<x_t<scalar_t>, scalar_t>(x, panels.data_ptr<int8_t>(), Kp, panels.size(0), sp, bias, y);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("ordered_linear_pack(Tensor weight) -> Tensor");
  m.def("ordered_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_linear_pack(Tensor q, Tensor scales, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("int8_linear(Tensor x, Tensor panels, Tensor scales, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("ordered_linear_pack", &ordered_linear_pack);
  m.impl("ordered_linear", &ordered_linear);
  m.impl("int8_linear_pack", &int8_linear_pack);
  m.impl("int8_linear", &int8_linear);
}
