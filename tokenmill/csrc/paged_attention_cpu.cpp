// Paged attention for short queries on the CPU, reading K/V in place from the block pool.
//
// One work item is (query token, kv head): it walks the sequence's block table, scores the
// G = Hq / Hkv query heads that share the kv head against each key (so every key is read
// once per item), and keeps an online softmax (running max m, running sum l, accumulator)
// per query head. Items are spread over threads with at::parallel_for.
//
// Shapes (all float32, contiguous):
//   q            (T, Hq, D)        queries of the sequences being attended, flat
//   k_cache      (S, Hkv, D)       the pool, S = num_blocks * block_size slots
//   v_cache      (S, Hkv, D)
//   block_tables (B, max_blocks)   int32
//   query_start  (B + 1,)          int32, sequence b owns tokens [query_start[b], query_start[b+1])
//   seq_lens     (B,)              int32, context length including the new tokens
// Query j of sequence b sits at position seq_lens[b] - qlen + j and sees positions 0..itself.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// 8 independent partial sums so the compiler emits one 256-bit FMA per step without -ffast-math.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  }
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict acc, float w, const float* __restrict x, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] += w * x[i];
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor query_start,
                              torch::Tensor seq_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
                  v_cache.dtype() == torch::kFloat32, "paged_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous(), "paged_attention: inputs must be contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && query_start.dtype() == torch::kInt32 &&
                  seq_lens.dtype() == torch::kInt32, "paged_attention: int32 metadata");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1);
  const int64_t G = Hq / Hkv;
  const int64_t B = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(2) == D, "paged_attention: head shapes disagree");

  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  auto out = torch::empty_like(q);
  float* op = out.data_ptr<float>();

  std::vector<int32_t> token_seq(T);
  for (int64_t b = 0; b < B; ++b) {
    for (int32_t t = qs[b]; t < qs[b + 1]; ++t) token_seq[t] = static_cast<int32_t>(b);
  }
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * block_size), acc(G * D), m(G), l(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hkv, h = item % Hkv;
      const int64_t b = token_seq[t];
      const int64_t qlen = qs[b + 1] - qs[b];
      const int64_t kv_len = sl[b] - qlen + (t - qs[b]) + 1;
      const float* qh = qp + (t * Hq + h * G) * D;  // G query heads, contiguous
      const int32_t* table = bt + b * max_blocks;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);

      for (int64_t p0 = 0; p0 < kv_len; p0 += block_size) {
        const int64_t slot0 = static_cast<int64_t>(table[p0 / block_size]) * block_size;
        const int64_t n = std::min(block_size, kv_len - p0);
        for (int64_t j = 0; j < n; ++j) {
          const float* kj = kp + ((slot0 + j) * Hkv + h) * D;
          for (int64_t g = 0; g < G; ++g) scores[g * block_size + j] = dot(qh + g * D, kj, D) * fscale;
        }
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores.data() + g * block_size;
          float block_max = s[0];
          for (int64_t j = 1; j < n; ++j) block_max = std::max(block_max, s[j]);
          const float new_m = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - new_m);  // exp(-inf) = 0 on the first block
          float* a = acc.data() + g * D;
          l[g] *= correction;
          for (int64_t d = 0; d < D; ++d) a[d] *= correction;
          for (int64_t j = 0; j < n; ++j) {
            const float w = std::exp(s[j] - new_m);
            l[g] += w;
            axpy(a, w, vp + ((slot0 + j) * Hkv + h) * D, D);
          }
          m[g] = new_m;
        }
      }
      float* oh = op + (t * Hq + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.0f / l[g];
        for (int64_t d = 0; d < D; ++d) oh[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention for short queries (CPU, float32)");
}
