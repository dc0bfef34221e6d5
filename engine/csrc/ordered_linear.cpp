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
#include <type_traits>
#include <vector>

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

// Weight-only quantized panels (engine/linear.py, quantization int8 and int4): W[n, k] = code *
// scale[n, g] + zero[n, g] over groups of GROUP k (g = k / GROUP), codes of BITS bits, the scale
// and zero in fp32. The codes lie in the model dtype's panel order (k-major, NR columns a step, in
// pairs of k for bf16 with AVX512_BF16), each 2 x LANES codes in a row a chunk: int8 a byte a
// code, int4 a byte for codes i and i + LANES of the chunk (low and high nibble). A tile turns
// each step's codes into weights in registers (fp32: code * scale + zero, one fused multiply-add
// where the build has FMA, else a multiply then an add; then bf16 pairs for vdpbf16ps, rounded as
// a bf16 checkpoint's weights are) and sums every output over k in order, as the ordered kernel
// does, so a row's bits depend on nothing else in the batch.
constexpr int64_t GROUP = 32;
static_assert(GROUP % 2 == 0, "bf16 pairs of k never straddle two groups");
template <int BITS>
constexpr int64_t CHUNK_BYTES = 2 * LANES * BITS / 8;

template <int BITS>
struct QPanel {  // one panel's codes and its groups' scales and zeros ([groups][NR] each)
  const uint8_t* codes;
  const float* scales;
  const float* zeros;
};

typedef uint8_t vec_u8 __attribute__((vector_size(LANES)));
typedef int32_t vec_i32 __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vec_i32 widen(const uint8_t* p) {  // LANES bytes as int32 lanes (vpmovzxbd)
#if defined(__AVX512F__)
  return (vec_i32)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vec_i32)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vec_u8 q;
  std::memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(q, vec_i32);
#endif
}

// A chunk's codes as fp32 (exact): lo the first LANES of them, hi the next LANES.
template <int BITS>
inline void load_codes(const uint8_t* p, vec& lo, vec& hi) {
  if constexpr (BITS == 8) {
    lo = __builtin_convertvector(widen(p), vec);
    hi = __builtin_convertvector(widen(p + LANES), vec);
  } else {
    const vec_i32 b = widen(p);
    lo = __builtin_convertvector(b & 15, vec);
    hi = __builtin_convertvector(b >> 4, vec);
  }
}

inline vec fma_lanes(vec a, vec b, vec c) {  // a * b + c
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX__) && defined(__FMA__)
  return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
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

// The quantized tile in fp32: a chunk is one k's NR columns.
template <int64_t R, int BITS>
inline void tile(const float* x, int64_t K, QPanel<BITS> q, row_acc acc[MR]) {
  static_assert(V == 2, "a chunk holds a step's two registers");
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v] = vec{};
  for (int64_t k = 0, g = 0; k < K; ++g) {
    const vec s0 = load_lanes(q.scales + g * NR), s1 = load_lanes(q.scales + g * NR + LANES);
    const vec z0 = load_lanes(q.zeros + g * NR), z1 = load_lanes(q.zeros + g * NR + LANES);
    for (const int64_t end = std::min(K, k + GROUP); k < end; ++k) {
      vec w[V];
      load_codes<BITS>(q.codes + k * CHUNK_BYTES<BITS>, w[0], w[1]);
      w[0] = fma_lanes(w[0], s0, z0);
      w[1] = fma_lanes(w[1], s1, z1);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t v = 0; v < V; ++v) acc[r][v] = mul_add(acc[r][v], x[r * K + k], w[v]);
    }
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

// The quantized tile in bf16 pairs: a chunk is one register's 16 columns x a pair of k (its lo
// half columns 0-7, hi 8-15, column j's pair side by side), each weight rounded to bf16 after its
// fp32 multiply-add; the scales and zeros spread to the pairs once a group (vpermps).
template <int64_t R, int BITS>
inline void tile(const c10::BFloat16* x, int64_t K, QPanel<BITS> q, row_acc acc[MR]) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  __m512 a[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t v = 0; v < V; ++v) a[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0, g = 0; k < K; ++g) {
    alignas(64) float s[V][2][LANES], z[V][2][LANES];  // in L1, read by the multiply-adds (no registers held)
    for (int64_t v = 0; v < V; ++v) {
      const __m512 sv = _mm512_loadu_ps(q.scales + g * NR + v * LANES);
      const __m512 zv = _mm512_loadu_ps(q.zeros + g * NR + v * LANES);
      _mm512_store_ps(s[v][0], _mm512_permutexvar_ps(lo_idx, sv)), _mm512_store_ps(s[v][1], _mm512_permutexvar_ps(hi_idx, sv));
      _mm512_store_ps(z[v][0], _mm512_permutexvar_ps(lo_idx, zv)), _mm512_store_ps(z[v][1], _mm512_permutexvar_ps(hi_idx, zv));
    }
    for (const int64_t end = std::min(K, k + GROUP); k < end; k += 2) {
      __m512bh w[V];
      for (int64_t v = 0; v < V; ++v) {
        vec lo, hi;
        load_codes<BITS>(q.codes + ((k / 2) * V + v) * CHUNK_BYTES<BITS>, lo, hi);
        w[v] = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps((__m512)hi, _mm512_load_ps(s[v][1]), _mm512_load_ps(z[v][1])),
                                   _mm512_fmadd_ps((__m512)lo, _mm512_load_ps(s[v][0]), _mm512_load_ps(z[v][0])));
      }
      for (int64_t r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + k, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int64_t v = 0; v < V; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], xb, w[v]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) std::memcpy(acc[r], a[r], sizeof(row_acc));
}

#endif

// A quantized panel as the weights its tile computes in registers, in the unquantized tile's
// panel layout (w_t: float, or bf16 pairs where the tile multiplies them), with the same
// arithmetic: a batch of several tiles turns each group's codes into weights once, not once a
// tile, and the unquantized tile over them gives the quantized tile's bits.
template <int BITS>
void dequantize_panel(QPanel<BITS> q, int64_t K, float* out) {
  for (int64_t k = 0, g = 0; k < K; ++g) {
    const vec s0 = load_lanes(q.scales + g * NR), s1 = load_lanes(q.scales + g * NR + LANES);
    const vec z0 = load_lanes(q.zeros + g * NR), z1 = load_lanes(q.zeros + g * NR + LANES);
    for (const int64_t end = std::min(K, k + GROUP); k < end; ++k) {
      vec lo, hi;
      load_codes<BITS>(q.codes + k * CHUNK_BYTES<BITS>, lo, hi);
      store_lanes(out + k * NR, fma_lanes(lo, s0, z0));
      store_lanes(out + k * NR + LANES, fma_lanes(hi, s1, z1));
    }
  }
}

#if defined(__AVX512BF16__)
template <int BITS>
void dequantize_panel(QPanel<BITS> q, int64_t K, c10::BFloat16* out) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  for (int64_t k = 0, g = 0; k < K; ++g) {
    __m512 s[V][2], z[V][2];
    for (int64_t v = 0; v < V; ++v) {
      const __m512 sv = _mm512_loadu_ps(q.scales + g * NR + v * LANES);
      const __m512 zv = _mm512_loadu_ps(q.zeros + g * NR + v * LANES);
      s[v][0] = _mm512_permutexvar_ps(lo_idx, sv), s[v][1] = _mm512_permutexvar_ps(hi_idx, sv);
      z[v][0] = _mm512_permutexvar_ps(lo_idx, zv), z[v][1] = _mm512_permutexvar_ps(hi_idx, zv);
    }
    for (const int64_t end = std::min(K, k + GROUP); k < end; k += 2)
      for (int64_t v = 0; v < V; ++v) {
        vec lo, hi;
        load_codes<BITS>(q.codes + ((k / 2) * V + v) * CHUNK_BYTES<BITS>, lo, hi);
        const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps((__m512)hi, s[v][1], z[v][1]),
                                               _mm512_fmadd_ps((__m512)lo, s[v][0], z[v][0]));
        _mm512_storeu_si512(out + k * NR + v * 2 * LANES, (__m512i)w);
      }
  }
}
#endif

template <typename T>
constexpr bool quantized = false;
template <int BITS>
constexpr bool quantized<QPanel<BITS>> = true;

// The tile for the rows left, R = rows (at most MR): a tile of R rows, not MR with zero rows.
template <int64_t R = MR, typename xs_t, typename panel_t>
inline void tile_rows(int64_t rows, const xs_t* x, int64_t K, panel_t panel, row_acc acc[MR]) {
  if constexpr (R > 1)
    if (rows < R) return tile_rows<R - 1>(rows, x, K, panel, acc);
  tile<R>(x, K, panel, acc);
}

// A row of x as the tile reads it: the same values in out_t (x_t), k padded with zeros to Kp.
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

// One panel's columns of y for `rows` rows of xs, in `tiles` tiles whose heights differ by at
// most one (each tile after the first reads the panel again, from cache: 8 rows go as 4 + 4, not
// 6 + 2); out: y at the first row and the panel's first column, rows N apart.
template <typename xs_t, typename scalar_t, typename panel_t>
inline void panel_tiles(int64_t rows, int64_t tiles, const xs_t* xs, int64_t Kp, panel_t panel, const scalar_t* bias,
                        int64_t cols, int64_t N, scalar_t* out, row_acc acc[MR]) {
  for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
    const int64_t height = rows / tiles + (t < rows % tiles);
    tile_rows(height, xs + r0 * Kp, Kp, panel, acc);
    for (int64_t r = 0; r < height; ++r) store_row(acc[r], bias, cols, out + (r0 + r) * N);
    r0 += height;
  }
}

// y = x @ W.T + b: the rows copied in blocks of MC as the tile reads them (xs_t), the panels
// (panel_of(p): panel p's weights, in the model dtype or quantized) split between threads.
template <typename xs_t, typename scalar_t, typename panel_of_t>
void run_tiles(const at::Tensor& x, int64_t Kp, int64_t P, panel_of_t panel_of, const c10::optional<at::Tensor>& bias,
               at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* bp = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
  scalar_t* yp = y.data_ptr<scalar_t>();
  // Buffers held by the calling thread between calls, grown as needed (a call's new[] of a few
  // hundred KB is an mmap and its page faults each time): the rows' copy, in the tile's type, k
  // padded to Kp (written in full before each use); and where several tiles read a quantized
  // panel, each worker thread's copy of its weights, turned from codes once a panel.
  static thread_local std::vector<xs_t> xs_store, scratch_store;
  if (xs_store.size() < size_t(std::min(MC, M) * Kp)) xs_store.resize(std::min(MC, M) * Kp);
  const int64_t threads = at::get_num_threads();
  const bool dequantized_once = quantized<decltype(panel_of(0))> && M > MR;
  if (dequantized_once && scratch_store.size() < size_t(threads * Kp * NR)) scratch_store.resize(threads * Kp * NR);
  xs_t* const xs_rows = xs_store.data();
  xs_t* const scratch = dequantized_once ? scratch_store.data() : nullptr;
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t rows = std::min(MC, M - m0);
    for (int64_t r = 0; r < rows; ++r) copy_row(xp + (m0 + r) * K, K, Kp, xs_rows + r * Kp);
    const int64_t tiles = (rows + MR - 1) / MR;
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      row_acc acc[MR];
      const int64_t thread = at::get_thread_num();  // outside a parallel region's team: none of its own
      xs_t* weights = scratch && tiles > 1 && thread < threads ? scratch + thread * Kp * NR : nullptr;
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
        const scalar_t* b = bp ? bp + n0 : nullptr;
        scalar_t* out = yp + m0 * N + n0;
        if constexpr (quantized<decltype(panel_of(0))>) {
          if (weights) {
            dequantize_panel(panel_of(p), Kp, weights);
            panel_tiles(rows, tiles, xs_rows, Kp, static_cast<const xs_t*>(weights), b, cols, N, out, acc);
            continue;
          }
        }
        panel_tiles(rows, tiles, xs_rows, Kp, panel_of(p), b, cols, N, out, acc);
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
    const scalar_t* wp = panels.data_ptr<scalar_t>();
    run_tiles<x_t<scalar_t>, scalar_t>(x, Kp, panels.size(0), [&](int64_t p) { return wp + p * Kp * NR; }, bias, y);
  });
  return y;
}

// codes [N, K] uint8 (< 2^bits), scales and zeros [N, G] fp32 (G = ceil(K / GROUP)), for x of
// `dtype` -> (panels [P, Kp * NR * bits / 8] uint8, scales [P, G, NR], zeros [P, G, NR]; the
// columns past N zero).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quant_linear_pack(const at::Tensor& codes, const at::Tensor& scales,
                                                                 const at::Tensor& zeros, int64_t bits,
                                                                 at::ScalarType dtype) {
  TORCH_CHECK(bits == 8 || bits == 4, "quant_linear_pack: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte,
              "quant_linear_pack: a contiguous [N, K] uint8 tensor of codes expected");
  const int64_t N = codes.size(0), K = codes.size(1), G = (K + GROUP - 1) / GROUP, P = (N + NR - 1) / NR;
  for (const at::Tensor* t : {&scales, &zeros})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N && t->size(1) == G && t->scalar_type() == at::kFloat,
                "quant_linear_pack: scales and zeros must be [N, ceil(K / 32)] float32");
  TORCH_CHECK(bits == 8 || N * K == 0 || codes.max().item<uint8_t>() < 16, "quant_linear_pack: int4 codes must be < 16");
  at::Tensor panels;
  DISPATCH(dtype, "quant_linear_pack", [&] {
    const int64_t Kp = padded_k<scalar_t>(K);
    at::Tensor values = at::empty({P, Kp * NR}, codes.options());
    pack_panels(codes.data_ptr<uint8_t>(), N, K, Kp, paired<scalar_t> ? 2 : 1, values.data_ptr<uint8_t>());
    if (bits == 8) {
      panels = values;
      return;
    }
    panels = at::empty({P, Kp * NR / 2}, codes.options());
    const uint8_t* vp = values.data_ptr<uint8_t>();
    uint8_t* pp = panels.data_ptr<uint8_t>();
    for (int64_t c = 0; c < P * Kp * NR / (2 * LANES); ++c)  // a chunk: codes i and i + LANES in byte i
      for (int64_t i = 0; i < LANES; ++i) pp[c * LANES + i] = vp[c * 2 * LANES + i] | vp[c * 2 * LANES + LANES + i] << 4;
  });
  auto by_panel = [&](const at::Tensor& t) {  // [N, G] -> [P, G, NR]
    at::Tensor padded = at::zeros({P * NR, G}, t.options());
    padded.narrow(0, 0, N).copy_(t);
    return padded.view({P, NR, G}).transpose(1, 2).contiguous();
  };
  return {panels, by_panel(scales), by_panel(zeros)};
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales,
                        const at::Tensor& zeros, const c10::optional<at::Tensor>& bias, int64_t bits,
                        int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant_linear: x must be a contiguous [M, K] tensor");
  const int64_t P = (out_features + NR - 1) / NR, G = (x.size(1) + GROUP - 1) / GROUP;
  TORCH_CHECK((bits == 8 || bits == 4) && out_features >= 0 && panels.dim() == 2 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kByte && panels.size(0) == P,
              "quant_linear: panels must come from quant_linear_pack, for these bits and out_features");
  for (const at::Tensor* t : {&scales, &zeros})
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == at::kFloat && t->size(0) == P &&
                    t->size(1) == G && t->size(2) == NR,
                "quant_linear: scales and zeros must come from quant_linear_pack, for x's K");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == out_features &&
                                    bias->scalar_type() == x.scalar_type()),
              "quant_linear: bias must be [N] in x's dtype");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  DISPATCH(x.scalar_type(), "quant_linear", [&] {
    const int64_t Kp = padded_k<scalar_t>(x.size(1)), bytes = Kp * NR * bits / 8;
    TORCH_CHECK(panels.size(1) == bytes, "quant_linear: panels must come from quant_linear_pack for this K, dtype and bits");
    const uint8_t* cp = panels.data_ptr<uint8_t>();
    const float *sp = scales.data_ptr<float>(), *zp = zeros.data_ptr<float>();
    auto run = [&](auto bits_c) {
      constexpr int B = decltype(bits_c)::value;
      run_tiles<x_t<scalar_t>, scalar_t>(
          x, Kp, P, [&](int64_t p) { return QPanel<B>{cp + p * bytes, sp + p * G * NR, zp + p * G * NR}; }, bias, y);
    };
    if (bits == 8)
      run(std::integral_constant<int, 8>{});
    else
      run(std::integral_constant<int, 4>{});
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("ordered_linear_pack(Tensor weight) -> Tensor");
  m.def("ordered_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("quant_linear_pack(Tensor codes, Tensor scales, Tensor zeros, int bits, ScalarType dtype) -> (Tensor, Tensor, Tensor)");
  m.def("quant_linear(Tensor x, Tensor panels, Tensor scales, Tensor zeros, Tensor? bias, int bits, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("ordered_linear_pack", &ordered_linear_pack);
  m.impl("ordered_linear", &ordered_linear);
  m.impl("quant_linear_pack", &quant_linear_pack);
  m.impl("quant_linear", &quant_linear);
}
