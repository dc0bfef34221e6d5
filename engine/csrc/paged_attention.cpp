// Paged decode attention for CPUs: one query token per sequence, K/V read in place from the
// paged cache through the block table (no gather copy), GQA heads sharing each K/V load, and an
// online softmax in fp32. Registered as torch.ops.pdserve.paged_decode_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "to_float.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using pdserve::to_float;

// HEAD_DIM > 0 fixes the head size at compile time (fully unrolled inner loops); 0 reads it at run time.
template <typename scalar_t, int HEAD_DIM>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
            double scale, int64_t window) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t slot_stride = num_kv_heads * head_dim;  // elements between consecutive slots
  const int64_t q_stride = q.stride(0);  // q may be a view into the fused qkv projection
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    // Scratch per thread: queries, accumulators, scores, and one block of K or V in fp32.
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores(group * block_size);
    std::vector<float> kv(block_size * head_dim), row_max(group), row_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t ctx = cl[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = qp + seq * q_stride + (kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(src[d]) * float(scale);
        row_max[g] = -std::numeric_limits<float>::max();  // finite: built with -ffast-math
        row_sum[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = first / block_size; blk * block_size < ctx; ++blk) {
        const int64_t block = bt[seq * max_blocks + blk];
        const int64_t t0 = std::max(blk * block_size, first), t1 = std::min((blk + 1) * block_size, ctx);
        const int64_t n = t1 - t0;
        const int64_t base = ((block * block_size + (t0 - blk * block_size)) * num_kv_heads + kv_head) * head_dim;
        // 1. this block's keys to fp32, then one score per (query head, token)
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* k = kp + base + t * slot_stride;
          for (int64_t d = 0; d < head_dim; ++d) kv[t * head_dim + d] = to_float(k[d]);
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          for (int64_t t = 0; t < n; ++t) {
            const float* kt = kv.data() + t * head_dim;
            float s = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kt[d];
            scores[g * block_size + t] = s;
          }
        }
        // 2. online softmax: rescale what was accumulated if the running max grew
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * block_size;
          float m = row_max[g];
          for (int64_t t = 0; t < n; ++t) m = std::max(m, sg[t]);
          const float correction = std::exp(row_max[g] - m);
          row_max[g] = m;
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = std::exp(sg[t] - m);
            sum += sg[t];
          }
          row_sum[g] = row_sum[g] * correction + sum;
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] *= correction;
        }
        // 3. this block's values to fp32, accumulated with the probabilities
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* v = vp + base + t * slot_stride;
          for (int64_t d = 0; d < head_dim; ++d) kv[t * head_dim + d] = to_float(v[d]);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* ag = acc.data() + g * head_dim;
          for (int64_t t = 0; t < n; ++t) {
            const float p = scores[g * block_size + t];
            const float* vt = kv.data() + t * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vt[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = op + (seq * num_heads + kv_head * group + g) * head_dim;
        const float inv = 1.f / row_sum[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

// out, q: [B, Hq, D]; k_cache, v_cache: [num_slots, Hkv, D]; block_tables: [B, max_blocks] int64;
// context_lens: [B] int64 (KV positions to attend, the new token's included).
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "paged_decode_attention: out and caches must be contiguous, q rows [heads, head_dim] dense");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_decode_attention: heads must be a multiple of kv heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    switch (q.size(2)) {
      case 64: decode<scalar_t, 64>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window); break;
      case 128: decode<scalar_t, 128>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window); break;
      default: decode<scalar_t, 0>(out, q, k_cache, v_cache, block_tables, context_lens, block_size, scale, window);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
