// Fused element-wise ops for the CPU forward pass (float32). Each replaces several torch ops
// (and their temporaries) with one pass over the rows, threaded with at::parallel_for:
//   add_rms_norm   residual += x (in place), out = rms_norm(residual) * weight
//   rotary_qkv_    rotates the q and k heads of the fused qkv projection in place, after
//                  their RMSNorms where given (Qwen3's of each head, OLMoE's over all of q and k)
//   silu_mul       out = silu(gate) * up, from the fused gate_up projection
// The torch reference for each lives in tokenmill/models/ops.py; tests compare the two. Beside
// them, for the sampler: argmax_rows, each greedy row's argmax, tested against torch.argmax (the
// sampled rows: sampler_cpu.cpp).
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_ops.h"
#include "simd.h"

namespace {

float sum_squares(const float* x, int64_t n) {
#ifdef TOKENMILL_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(u, u, a0);
    a1 = _mm256_fmadd_ps(v, v, a1);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
  float s = 0.0f;
  for (float lane : lanes) s += lane;
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
#else
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
#endif
}

// out = x * (1 / sqrt(mean(x^2) + eps)) * w over n values (out may be x).
void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

}  // namespace

void check_rows(const at::Tensor& t, const char* name) {
  TM_CHECK(t.dtype() == at::kFloat, std::string(name) + ": float32 only");
  TM_CHECK(t.dim() == 2 && t.stride(1) == 1, std::string(name) + ": expected a 2-d tensor with contiguous rows");
}

at::Tensor out_or_empty(const c10::optional<at::Tensor>& out, at::IntArrayRef shape, const char* name) {
  if (!out.has_value()) return at::empty(shape, at::kFloat);
  TM_CHECK(out->dtype() == at::kFloat && out->is_contiguous() && out->sizes() == shape,
           std::string(name) + ": out must be a contiguous float32 tensor of the result's shape");
  return *out;
}

// Returns the norm's rows (into `out` where given); `residual`, when given, is updated in place to
// residual + x.
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                        double eps, c10::optional<at::Tensor> rows) {
  check_rows(x, "add_rms_norm(x)");
  TM_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: weight shape");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = out_or_empty(rows, {T, H}, "add_rms_norm");
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* rp = nullptr;
  int64_t r_stride = 0;
  if (residual.has_value()) {
    check_rows(*residual, "add_rms_norm(residual)");
    TM_CHECK(residual->size(0) == T && residual->size(1) == H, "add_rms_norm: residual shape");
    rp = residual->data_ptr<float>();
    r_stride = residual->stride(0);
  }
  const int64_t x_stride = x.stride(0);
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * x_stride;
      const float* src = xr;
      if (rp != nullptr) {
        float* r = rp + t * r_stride;
        for (int64_t i = 0; i < H; ++i) r[i] += xr[i];
        src = r;
      }
      rms_norm_row(src, w, H, feps, op + t * H);
    }
  });
  return out;
}

// qkv: (T, (nq + nkv + nkv) * D) rows; cos, sin: (T, D / 2). Rotates the first nq + nkv heads
// (q and k) in place with the half-split layout: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). With
// q_norm and k_norm, those heads are first normed as add_rms_norm computes a row: each head by
// itself where the weights are D long (Qwen3), or all of q as one row and all of k as another
// where they are nq * D and nkv * D long (OLMoE). In the same pass, where torch's rms_norm and a
// copy back made a dozen operations and temporaries a layer.
void rotary_qkv_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t num_q_heads,
                 int64_t num_kv_heads, int64_t head_dim, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, double eps) {
  check_rows(qkv, "rotary_qkv_(qkv)");
  TM_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim / 2,
           "rotary_qkv_: cos/sin must be (T, head_dim / 2) and contiguous");
  TM_CHECK(q_norm.has_value() == k_norm.has_value(), "rotary_qkv_: q and k norms go together");
  const bool whole = q_norm.has_value() && q_norm->numel() != head_dim;  // one norm over all q, one over all k
  for (const auto& [w, heads] : {std::pair{&q_norm, num_q_heads}, std::pair{&k_norm, num_kv_heads}}) {
    TM_CHECK(!w->has_value() || ((*w)->dtype() == at::kFloat && (*w)->is_contiguous() &&
                                 (*w)->numel() == (whole ? heads : 1) * head_dim),
             "rotary_qkv_: q and k norm weights must be contiguous float32, head_dim long each or "
             "num_q_heads * head_dim and num_kv_heads * head_dim");
  }
  const float* qw = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kw = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const float feps = static_cast<float>(eps);
  const int64_t T = qkv.size(0), half = head_dim / 2, heads = num_q_heads + num_kv_heads;
  const int64_t stride = qkv.stride(0);
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      float* row = base + t * stride;
      if (whole) {
        rms_norm_row(row, qw, num_q_heads * head_dim, feps, row);
        rms_norm_row(row + num_q_heads * head_dim, kw, num_kv_heads * head_dim, feps, row + num_q_heads * head_dim);
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = row + h * head_dim;
        if (qw != nullptr && !whole) rms_norm_row(x1, h < num_q_heads ? qw : kw, head_dim, feps, x1);
        float* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// gate_up: (T, 2 * I) rows -> (T, I) = silu(gate) * up.
at::Tensor silu_mul(at::Tensor gate_up, c10::optional<at::Tensor> rows) {
  check_rows(gate_up, "silu_mul(gate_up)");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = out_or_empty(rows, {T, I}, "silu_mul");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(gp + t * stride, I, op + t * I);
  });
  return out;
}

void silu_mul_row(const float* gate_up, int64_t I, float* out) {
  const float* u = gate_up + I;
  int64_t i = 0;
#ifdef TOKENMILL_AVX2
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (; i + 8 <= I; i += 8) {
    const __m256 gv = _mm256_loadu_ps(gate_up + i);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, tokenmill::exp256(_mm256_sub_ps(zero, gv))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < I; ++i) out[i] = gate_up[i] / (1.0f + std::exp(-gate_up[i])) * u[i];
}

// A row's largest value, and in *has_nan whether it holds a NaN (which max would skip).
float row_max(const float* row, int64_t V, bool* has_nan) {
  float mx = row[0];
  bool nan = false;
  int64_t i = 0;
#ifdef TOKENMILL_AVX2
  __m256 vmax = _mm256_set1_ps(row[0]), vnan = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    vmax = _mm256_max_ps(vmax, v);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  for (float lane : lanes) mx = std::max(mx, lane);
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < V; ++i) {
    nan = nan || std::isnan(row[i]);
    mx = std::max(mx, row[i]);
  }
  *has_nan = nan;
  return mx;
}

// The index of a row's largest value, the first one on ties, or its first NaN (torch.argmax's
// answers). The row is read twice, once for its max, then up to it for the index.
int64_t row_argmax(const float* row, int64_t V) {
  bool has_nan;
  const float mx = row_max(row, V, &has_nan);
  int64_t found = 0;
  if (has_nan) {
    while (!std::isnan(row[found])) ++found;
  } else {
    while (row[found] != mx) ++found;
  }
  return found;
}

// (T, V) rows -> (T,) int64: each row's row_argmax. torch's own CPU argmax is a scalar loop,
// several times slower over the rows of a batch-64 decode step (BENCHMARKS.md, "Speed work, every
// attempt (CPU, default model)").
at::Tensor argmax_rows(at::Tensor x) {
  check_rows(x, "argmax_rows(x)");
  const int64_t T = x.size(0), V = x.size(1), stride = x.stride(0);
  TM_CHECK(V > 0, "argmax_rows: empty rows");
  auto out = at::empty({T}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) op[t] = row_argmax(xp + t * stride, V);
  });
  return out;
}
