// Paged attention for short queries on the CPU, reading K/V in place from the block pool.
//
// One work item is (query token, kv head): it walks the sequence's block table, scores the
// G = Hq / Hkv query heads that share the kv head against the block's keys, and keeps an
// online softmax (running max m, running sum l, accumulator) per query head. Items are spread
// over threads in contiguous ranges of equal total context length (items differ in cost by the
// context each one reads, so an even split by count would leave one thread waiting). The keys
// of one head in one block are contiguous (block_size * D floats): each item streams 4 KB runs
// and reads every key once.
//
// Shapes (all float32, contiguous):
//   q            (T, Hq, D)                         queries, flat (rows may be strided)
//   k_cache      (num_blocks, Hkv, block_size, D)   the pool of one layer
//   v_cache      (num_blocks, Hkv, block_size, D)
//   block_tables (B, max_blocks)                    int32
//   query_start  (B + 1,)                           int32, sequence b owns tokens [qs[b], qs[b+1])
//   seq_lens     (B,)                               int32, context length including the new tokens
// Query j of sequence b sits at position seq_lens[b] - qlen + j and sees positions 0..itself.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

// ---- portable block primitives (any D) ---------------------------------------------------

// scores[j] = scale * <q, k_j> for j < n, k: (n, D)
void block_scores_scalar(const float* q, const float* k, int64_t n, int64_t D, float scale, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; ++d) s += q[d] * k[j * D + d];
    scores[j] = s * scale;
  }
}

// acc = acc * c + sum_j w[j] * v_j, v: (n, D)
void block_accumulate_scalar(float* acc, float c, const float* w, const float* v, int64_t n, int64_t D) {
  for (int64_t d = 0; d < D; ++d) acc[d] *= c;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < D; ++d) acc[d] += w[j] * v[j * D + d];
  }
}

void exp_scalar(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

#ifdef TOKENMILL_AVX2
// ---- AVX2 + FMA block primitives (D a multiple of 8) -------------------------------------

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in seven shuffles instead of forty.
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

void block_scores_avx2(const float* q, const float* k, int64_t n, int64_t D, float scale, float* scores) {
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {  // eight keys at a time, one accumulator each
    __m256 a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + r) * D + d), a[r]);
    }
    _mm256_storeu_ps(scores + j, _mm256_mul_ps(reduce8(a), vscale));
  }
  if (j < n) block_scores_scalar(q, k + j * D, n - j, D, scale, scores + j);
}

void block_accumulate_avx2(float* acc, float c, const float* w, const float* v, int64_t n, int64_t D) {
  const __m256 vc = _mm256_set1_ps(c);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // 8 registers of accumulator at a time
    const int chunks = static_cast<int>(std::min<int64_t>(8, (D - d0) / 8));
    __m256 r[8];
    for (int i = 0; i < chunks; ++i) r[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * i), vc);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 wj = _mm256_set1_ps(w[j]);
      const float* vj = v + j * D + d0;
      for (int i = 0; i < chunks; ++i) r[i] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8 * i), r[i]);
    }
    for (int i = 0; i < chunks; ++i) _mm256_storeu_ps(acc + d0 + 8 * i, r[i]);
  }
}

// x must have room for n rounded up to a multiple of 8 (the scores buffer is padded).
void exp_avx2(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, tokenmill::exp256(_mm256_loadu_ps(x + i)));
}
#endif

struct Primitives {
  void (*scores)(const float*, const float*, int64_t, int64_t, float, float*);
  void (*accumulate)(float*, float, const float*, const float*, int64_t, int64_t);
  void (*exp)(float*, int64_t);
};

Primitives pick_primitives(int64_t D) {
#ifdef TOKENMILL_AVX2
  if (D % 8 == 0) return {block_scores_avx2, block_accumulate_avx2, exp_avx2};
#endif
  return {block_scores_scalar, block_accumulate_scalar, exp_scalar};
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor query_start,
                              torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
                  v_cache.dtype() == torch::kFloat32, "paged_attention: float32 only");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q heads must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_attention: the pool and block tables must be contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && query_start.dtype() == torch::kInt32 &&
                  seq_lens.dtype() == torch::kInt32, "paged_attention: int32 metadata");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const int64_t B = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D, "paged_attention: head shapes disagree");

  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int64_t q_stride = q.stride(0);  // q may be a view into the fused qkv rows
  auto out = torch::empty({T, Hq, D}, q.options());
  float* op = out.data_ptr<float>();

  std::vector<int32_t> token_seq(T);
  std::vector<int64_t> cost_before(T * Hkv + 1, 0);  // prefix sums of the context each item reads
  for (int64_t b = 0; b < B; ++b) {
    for (int32_t t = qs[b]; t < qs[b + 1]; ++t) {
      token_seq[t] = static_cast<int32_t>(b);
      const int64_t kv_len = sl[b] - (qs[b + 1] - qs[b]) + (t - qs[b]) + 1;
      for (int64_t h = 0; h < Hkv; ++h) cost_before[t * Hkv + h + 1] = cost_before[t * Hkv + h] + kv_len;
    }
  }
  const int64_t num_chunks = std::min<int64_t>(at::get_num_threads(), T * Hkv);
  const int64_t total_cost = cost_before[T * Hkv];
  const float fscale = static_cast<float>(scale);
  const Primitives prim = pick_primitives(D);
  const int64_t padded_block = (block_size + 7) / 8 * 8;  // room for whole 8-lane exp chunks

  at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    // items whose cost prefix falls in [chunk_begin, chunk_end) / num_chunks of the total
    const auto item_at = [&](int64_t chunk) {
      return std::lower_bound(cost_before.begin(), cost_before.end() - 1, total_cost * chunk / num_chunks) -
             cost_before.begin();
    };
    const int64_t begin = item_at(chunk_begin), end = chunk_end == num_chunks ? T * Hkv : item_at(chunk_end);
    std::vector<float> scores(G * padded_block, 0.0f), acc(G * D), m(G), l(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hkv, h = item % Hkv;
      const int64_t b = token_seq[t];
      const int64_t kv_len = sl[b] - (qs[b + 1] - qs[b]) + (t - qs[b]) + 1;
      const float* qh = qp + t * q_stride + h * G * D;  // the G query heads of kv head h, contiguous
      const int32_t* table = bt + b * max_blocks;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);

      for (int64_t p0 = 0; p0 < kv_len; p0 += block_size) {
        const int64_t base = (static_cast<int64_t>(table[p0 / block_size]) * Hkv + h) * block_size * D;
        const int64_t n = std::min(block_size, kv_len - p0);
        if (p0 + block_size < kv_len) {  // the next block is elsewhere in memory: start loading it now
          const int64_t next = (static_cast<int64_t>(table[p0 / block_size + 1]) * Hkv + h) * block_size * D;
          for (int64_t off = 0; off < block_size * D; off += 16) {
            __builtin_prefetch(kp + next + off);
            __builtin_prefetch(vp + next + off);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores.data() + g * padded_block;
          prim.scores(qh + g * D, kp + base, n, D, fscale, s);
          const float new_m = std::max(m[g], *std::max_element(s, s + n));
          const float correction = std::exp(m[g] - new_m);  // exp(-inf) = 0 on the first block
          for (int64_t j = 0; j < n; ++j) s[j] -= new_m;
          prim.exp(s, n);
          float sum = 0.0f;
          for (int64_t j = 0; j < n; ++j) sum += s[j];
          prim.accumulate(acc.data() + g * D, correction, s, vp + base, n, D);
          l[g] = l[g] * correction + sum;
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

// Store this step's keys and values: token t goes to block slot_block[t], offset slot_offset[t].
// k, v: (T, Hkv, D) (rows may be strided views of the fused qkv projection); caches as above.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_block, torch::Tensor slot_offset) {
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "write_kv: heads must be contiguous");
  TORCH_CHECK(slot_block.dtype() == torch::kInt64 && slot_offset.dtype() == torch::kInt64, "write_kv: int64 slots");
  TORCH_CHECK(k.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "write_kv: contiguous float32 caches");
  const int64_t T = k.size(0), Hkv = k_cache.size(1), bs = k_cache.size(2), D = k_cache.size(3);
  const int64_t* blocks = slot_block.data_ptr<int64_t>();
  const int64_t* offsets = slot_offset.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t dst = ((blocks[t] * Hkv + h) * bs + offsets[t]) * D;
      std::copy_n(kp + t * k.stride(0) + h * D, D, kc + dst);
      std::copy_n(vp + t * v.stride(0) + h * D, D, vc + dst);
    }
  }
}
