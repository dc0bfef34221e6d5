// Paged decode attention for CPUs: one query token per sequence, K/V read in place from the
// paged cache through the block table (no gather copy), GQA heads sharing each K/V load, and an
// online softmax in fp32. Registered as torch.ops.pdserve.paged_decode_attention.
//
// Written with GCC/Clang vector types of 8 floats, which compile to AVX2 or AVX-512 registers
// on x86 and NEON pairs on Arm alike. A key row is loaded once (bf16 -> fp32 is a widening
// shift) and multiplied with every query head of its group; each product stays a vector of 8
// partial sums, and 8 tokens' vectors are summed across lanes together by a transpose-add (21
// shuffles and adds for 8 scores instead of a horizontal sum per score).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "to_float.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using pdserve::to_float;

// Lanes: 16 where AVX-512 holds them in one register, 8 elsewhere (AVX2: one register; Arm: two).
#ifdef __AVX512F__
constexpr int64_t L = 16;
#else
constexpr int64_t L = 8;
#endif
typedef float fv __attribute__((vector_size(L * 4)));
typedef uint16_t u16v __attribute__((vector_size(L * 2)));
typedef uint32_t u32v __attribute__((vector_size(L * 4)));

template <typename T>
inline fv load_lanes(const T* p) {
  fv r;
  for (int i = 0; i < L; ++i) r[i] = to_float(p[i]);
  return r;
}

template <>
inline fv load_lanes<float>(const float* p) {
  fv r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

template <>
inline fv load_lanes<c10::BFloat16>(const c10::BFloat16* p) {
  u16v h;
  std::memcpy(&h, p, sizeof(h));
  const u32v w = __builtin_convertvector(h, u32v) << 16;
  fv r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
}

// v[t] holds L partial sums of token t's score; returns the L scores. Each level adds pairs of
// vectors whose lanes hold sums over 2, 4, 8 (and 16) of the original lanes.
#ifdef __AVX512F__
inline fv sum_lanes(const fv* v) {
  fv b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(d[0], d[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
#else
inline fv sum_lanes(const fv* v) {
  fv b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
#endif

// DV > 0 fixes the vectors per head row at compile time (fully unrolled inner loops); 0 reads it at run time.
template <typename scalar_t, int DV>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
            double scale, int64_t window, double softcap) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t dv = DV > 0 ? DV : head_dim / L;
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive slots
  const int64_t q_stride = q.stride(0);  // q may be a view into the fused qkv projection
  const int64_t padded_block = (block_size + L - 1) / L * L;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();

  // A task is one sequence's KV heads (all of them unless there are fewer sequences than threads),
  // so that a block of the cache ([block_size, kv_heads, head_dim], contiguous) is read in one sweep.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = num_seqs >= threads ? 1 : std::min(num_kv_heads, (threads + num_seqs - 1) / num_seqs);
  const int64_t heads_per_task = (num_kv_heads + chunks - 1) / chunks;

  at::parallel_for(0, num_seqs * chunks, 1, [&](int64_t begin, int64_t end) {
    // Scratch per thread, for the task's query heads (rows): queries and accumulators [rows, dv],
    // partial sums [rows, padded_block] (zero past a block's tokens), scores [rows, padded_block],
    // and one KV head's values of a block [block_size, dv].
    const int64_t max_rows = heads_per_task * group;
    std::vector<fv> qf(max_rows * dv), acc(max_rows * dv), part(max_rows * padded_block, fv{}), vf(block_size * dv);
    std::vector<float> scores(max_rows * padded_block), row_max(max_rows), row_sum(max_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / chunks;
      const int64_t h0 = task % chunks * heads_per_task, h1 = std::min(h0 + heads_per_task, num_kv_heads);
      const int64_t rows = (h1 - h0) * group;
      const int64_t ctx = cl[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* src = qp + seq * q_stride + (h0 * group + r) * head_dim;
        for (int64_t j = 0; j < dv; ++j) qf[r * dv + j] = load_lanes(src + j * L) * float(scale);
        row_max[r] = -std::numeric_limits<float>::max();  // finite: built with -ffast-math
        row_sum[r] = 0.f;
      }
      std::fill(acc.begin(), acc.begin() + rows * dv, fv{});
      for (int64_t blk = first / block_size; blk * block_size < ctx; ++blk) {
        const int64_t block = bt[seq * max_blocks + blk];
        const int64_t t0 = std::max(blk * block_size, first), t1 = std::min((blk + 1) * block_size, ctx);
        const int64_t n = t1 - t0;
        if ((blk + 2) * block_size < ctx) {  // the next block's rows of these heads, while this one computes
          const int64_t next = bt[seq * max_blocks + blk + 2] * block_size * slot_stride + h0 * head_dim;
          const int64_t bytes = ((block_size - 1) * slot_stride + (h1 - h0) * head_dim) * int64_t(sizeof(scalar_t));
          for (int64_t off = 0; off < bytes; off += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(kp + next) + off);
            __builtin_prefetch(reinterpret_cast<const char*>(vp + next) + off);
          }
        }
        for (int64_t kv_head = h0; kv_head < h1; ++kv_head) {
          const int64_t r0 = (kv_head - h0) * group;  // this KV head's first query row
          const int64_t base = ((block * block_size + (t0 - blk * block_size)) * num_kv_heads + kv_head) * head_dim;
          // 1. each key row once, against every query head of the group: 8 partial sums per score
          for (int64_t t = 0; t < n; ++t) {
            const scalar_t* k = kp + base + t * slot_stride;
            fv kv[DV > 0 ? DV : 256 / L];
            for (int64_t j = 0; j < dv; ++j) kv[j] = load_lanes(k + j * L);
            for (int64_t g = 0; g < group; ++g) {
              const fv* qg = qf.data() + (r0 + g) * dv;
              fv s = qg[0] * kv[0];
              for (int64_t j = 1; j < dv; ++j) s += qg[j] * kv[j];
              part[(r0 + g) * padded_block + t] = s;
            }
          }
          // 2. the scores, and an online softmax: rescale what was accumulated if the running max grew
          for (int64_t r = r0; r < r0 + group; ++r) {
            if (n % L) std::fill(part.begin() + r * padded_block + n, part.begin() + (r + 1) * padded_block, fv{});
            float* sr = scores.data() + r * padded_block;
            for (int64_t t = 0; t < n; t += L) {
              const fv s = sum_lanes(part.data() + r * padded_block + t);
              std::memcpy(sr + t, &s, sizeof(s));
            }
            if (softcap > 0) {  // Gemma 2: cap * tanh(s / cap), before the softmax
              const float cap = float(softcap), inv_cap = 1.f / cap;
              for (int64_t t = 0; t < n; ++t) sr[t] = cap * std::tanh(sr[t] * inv_cap);
            }
            float m = row_max[r];
            for (int64_t t = 0; t < n; ++t) m = std::max(m, sr[t]);
            const float correction = std::exp(row_max[r] - m);
            row_max[r] = m;
            float sum = 0.f;
            for (int64_t t = 0; t < n; ++t) {
              sr[t] = std::exp(sr[t] - m);
              sum += sr[t];
            }
            row_sum[r] = row_sum[r] * correction + sum;
            fv* ar = acc.data() + r * dv;
            for (int64_t j = 0; j < dv; ++j) ar[j] *= correction;
          }
          // 3. the block's values to fp32 once, then accumulated per query head in registers
          for (int64_t t = 0; t < n; ++t) {
            const scalar_t* v = vp + base + t * slot_stride;
            for (int64_t j = 0; j < dv; ++j) vf[t * dv + j] = load_lanes(v + j * L);
          }
          for (int64_t r = r0; r < r0 + group; ++r) {
            const float* pr = scores.data() + r * padded_block;
            fv* ar = acc.data() + r * dv;
            fv a[DV > 0 ? DV : 256 / L];
            for (int64_t j = 0; j < dv; ++j) a[j] = ar[j];
            for (int64_t t = 0; t < n; ++t) {
              const float p = pr[t];
              const fv* vt = vf.data() + t * dv;
              for (int64_t j = 0; j < dv; ++j) a[j] += p * vt[j];
            }
            for (int64_t j = 0; j < dv; ++j) ar[j] = a[j];
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* dst = op + (seq * num_heads + h0 * group + r) * head_dim;
        const float inv = 1.f / row_sum[r];
        for (int64_t j = 0; j < dv; ++j)
          for (int64_t l = 0; l < L; ++l) dst[j * L + l] = static_cast<scalar_t>(acc[r * dv + j][l] * inv);
      }
    }
  });
}

// out, q: [B, Hq, D]; k_cache, v_cache: [num_slots, Hkv, D]; block_tables: [B, max_blocks] int64;
// context_lens: [B] int64 (KV positions to attend, the new token's included). D: a multiple of 8, at most 256.
// window: a sliding window's width, 0 for none; softcap: the scores' tanh cap, 0 for none.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window,
                            double softcap) {
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "paged_decode_attention: out and caches must be contiguous, q rows [heads, head_dim] dense");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_decode_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % L == 0 && q.size(2) <= 256,
              "paged_decode_attention: head_dim must be a multiple of ", L, " and at most 256, got ", q.size(2));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    switch (q.size(2)) {
      case 64: decode<scalar_t, 64 / L>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, softcap); break;
      case 128: decode<scalar_t, 128 / L>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, softcap); break;
      default: decode<scalar_t, 0>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window, softcap);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, int window, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
