// y = x @ W.T (+ b) for a handful of rows (decode steps with 1..4 sequences), float32.
//
// With M this small the product is bound by reading W once from memory, not by arithmetic,
// and general GEMM libraries lose bandwidth to blocking meant for large M. This streams W
// a few rows at a time against all M inputs (held in L1) and splits the output features
// across threads. (Software prefetching was tried and measured slower than the hardware's.)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace {

constexpr int64_t kMaxRows = 4;

// R weight rows at a time against all M inputs: R * M accumulators stay in registers.
template <int64_t M, int64_t R>
void gemv_rows(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N,
               int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
#ifdef TOKENMILL_AVX2
  if (K % 8 == 0) {
    for (; n + R <= n_end; n += R) {
      const float* wr = w + n * K;
      __m256 acc[R][M];
      for (int64_t r = 0; r < R; ++r)
        for (int64_t m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) {
        for (int64_t r = 0; r < R; ++r) {
          const __m256 wv = _mm256_loadu_ps(wr + r * K + k);
          for (int64_t m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[r][m]);
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t m = 0; m < M; ++m) y[m * N + n + r] = tokenmill::hsum256(acc[r][m]) + (bias ? bias[n + r] : 0.0f);
    }
  }
#endif
  for (; n < n_end; ++n) {  // leftovers, or no AVX2
    for (int64_t m = 0; m < M; ++m) {
      float s = bias ? bias[n] : 0.0f;
      for (int64_t k = 0; k < K; ++k) s += w[n * K + k] * x[m * K + k];
      y[m * N + n] = s;
    }
  }
}

}  // namespace

torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32, "small_m_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_m_linear: 1 to 4 rows");
  auto xc = x.contiguous();
  TORCH_CHECK(weight.is_contiguous() && weight.size(1) == x.size(1), "small_m_linear: weight shape");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "small_m_linear: bias shape");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: gemv_rows<1, 4>(xp, wp, b, yp, K, N, begin, end); break;
      case 2: gemv_rows<2, 4>(xp, wp, b, yp, K, N, begin, end); break;
      case 3: gemv_rows<3, 2>(xp, wp, b, yp, K, N, begin, end); break;
      default: gemv_rows<4, 2>(xp, wp, b, yp, K, N, begin, end); break;
    }
  });
  return y;
}
