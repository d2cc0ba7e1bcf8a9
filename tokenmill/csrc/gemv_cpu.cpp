// y = x @ W.T (+ b) for a handful of rows (decode steps with few sequences), float32.
//
// With M this small the product is bound by reading W once from memory, not by arithmetic,
// and general GEMM libraries lose bandwidth to blocking meant for large M. This streams W
// one row at a time against all M inputs (held in L1) and splits the output features across
// threads. (Two or four weight rows at a time, and software prefetching, were tried and
// measured slower.)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

namespace {

constexpr int64_t kMaxRows = 8;  // measured: faster than oneDNN up to 8 rows, slower from 12

using RowKernel = void (*)(const float*, const float*, int64_t, float*);

#ifdef TOKENMILL_AVX2
// One weight row against MC input rows, MC accumulators in registers: W is read once.
template <int64_t MC>
void row_times_inputs(const float* wrow, const float* x, int64_t K, float* out) {
  __m256 acc[MC];
  for (int64_t m = 0; m < MC; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 wv = _mm256_loadu_ps(wrow + k);
    for (int64_t m = 0; m < MC; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
  }
  for (int64_t m = 0; m < MC; ++m) out[m] = tokenmill::hsum256(acc[m]);
}

constexpr RowKernel kRowKernels[9] = {nullptr, row_times_inputs<1>, row_times_inputs<2>, row_times_inputs<3>,
                                      row_times_inputs<4>, row_times_inputs<5>, row_times_inputs<6>,
                                      row_times_inputs<7>, row_times_inputs<8>};
#endif

void rows_scalar(const float* x, const float* w, int64_t M, int64_t K, int64_t n, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; ++k) s += w[n * K + k] * x[m * K + k];
    out[m] = s;
  }
}

}  // namespace

torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32, "small_m_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_m_linear: 1 to 8 rows");
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
  RowKernel vector_kernel = nullptr;  // none: the scalar loop
#ifdef TOKENMILL_AVX2
  if (K % 8 == 0) vector_kernel = kRowKernels[M];
#endif
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    float sums[kMaxRows];
    for (int64_t n = begin; n < end; ++n) {
      if (vector_kernel != nullptr) {
        vector_kernel(wp + n * K, xp, K, sums);
      } else {
        rows_scalar(xp, wp, M, K, n, sums);
      }
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = sums[m] + (b ? b[n] : 0.0f);
    }
  });
  return y;
}
