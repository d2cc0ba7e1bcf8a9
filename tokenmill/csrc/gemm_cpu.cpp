// y = x @ W.T (+ b), float32, for the projections of a transformer layer.
//
// General GEMM libraries block for large square products; at decode sizes oneDNN reached
// 60-110 GFLOP/s on this model's matrices against 150 at M = 512, and at M = 1 it left
// bandwidth unused. This kernel keeps W in panels of 16 output features, (ceil(N / 16), K, 16):
// a panel is one contiguous run that streams from memory once per block of rows, and the inner
// loop holds a 6 x 16 tile of y in twelve registers, loading two vectors of W and broadcasting
// six scalars of x per k. Measured against oneDNN on the default model's matrices (2 threads):
// 1.5x at M = 1, 1.2-1.4x from 16 to 128 rows, about even at 512. Panels are split across threads;
// rows go in blocks of 512 so that a block of x stays in cache while the panels stream past.
//
// From 4 rows up, the passes over one panel also prefetch the next panel (one 64-byte line, a k
// row of it, per k, shared between the passes in proportion to their rows): the first pass would
// otherwise wait on memory while the later ones compute from cache. Measured over the model's
// 121 matrices streamed from memory (paired runs): 4-7% faster from 4 to 64 rows; at 1 and 2 rows,
// where a pass is a pure stream that the hardware prefetcher already keeps busy, 5-10% slower, so
// those do without.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "simd.h"

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int64_t kRows = 6;    // rows of x per tile
constexpr int64_t kRowBlock = 512;  // rows of x per pass over the panels (a default prefill chunk)
constexpr int64_t kPrefetchRows = 4;  // prefetch the next panel from this many rows of x up

// The 16 outputs of one panel for `rows` rows of x (any row count up to 6), into out (rows, 16);
// meanwhile lines 0..pf_lines-1 of pf (k rows of the next panel) are prefetched, one per k.
using TileKernel = void (*)(const float*, int64_t, const float*, int64_t, float*, const float*, int64_t);

void tile_scalar(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < kPanel; ++j) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[r * ldx + k] * panel[k * kPanel + j];
      out[r * kPanel + j] = s;
    }
  }
}

#ifdef TOKENMILL_AVX2
// One row of a tile at one k: (lo, hi) += x_r[k] * (w0, w1).
inline void row_fma(const float* xk, __m256 w0, __m256 w1, __m256& lo, __m256& hi) {
  const __m256 xb = _mm256_broadcast_ss(xk);
  lo = _mm256_fmadd_ps(xb, w0, lo);
  hi = _mm256_fmadd_ps(xb, w1, hi);
}

inline void prefetch_line(const float* pf, int64_t k, int64_t pf_lines) {
  if (k < pf_lines) _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel), _MM_HINT_T0);
}

template <int R>
void tile_avx2(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, const float* pf,
               int64_t pf_lines);

// One row (batch-1 decode): the four accumulators take alternate k, so that no single FMA
// chain's latency paces the stream (measured 3% faster, at the plain read rate).
template <>
void tile_avx2<1>(const float* x, int64_t, const float* panel, int64_t K, float* out, const float* pf,
                  int64_t pf_lines) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    prefetch_line(pf, k, pf_lines);
    prefetch_line(pf, k + 1, pf_lines);
    const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
    a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + k * kPanel), a0);
    a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + k * kPanel + 8), a1);
    a2 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(panel + (k + 1) * kPanel), a2);
    a3 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(panel + (k + 1) * kPanel + 8), a3);
  }
  if (k < K) {
    prefetch_line(pf, k, pf_lines);
    const __m256 x0 = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + k * kPanel), a0);
    a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + k * kPanel + 8), a1);
  }
  _mm256_storeu_ps(out, _mm256_add_ps(a0, a2));
  _mm256_storeu_ps(out + 8, _mm256_add_ps(a1, a3));
}

// Named accumulators, not an array: GCC kept an accumulator array on the stack (a store per
// FMA, a third of the speed).
template <int R>
void tile_avx2(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, const float* pf,
               int64_t pf_lines) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
  __m256 a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  for (int64_t k = 0; k < K; ++k) {
    prefetch_line(pf, k, pf_lines);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    row_fma(x + k, w0, w1, a0, a1);
    if constexpr (R > 1) row_fma(x + ldx + k, w0, w1, a2, a3);
    if constexpr (R > 2) row_fma(x + 2 * ldx + k, w0, w1, a4, a5);
    if constexpr (R > 3) row_fma(x + 3 * ldx + k, w0, w1, a6, a7);
    if constexpr (R > 4) row_fma(x + 4 * ldx + k, w0, w1, a8, a9);
    if constexpr (R > 5) row_fma(x + 5 * ldx + k, w0, w1, a10, a11);
  }
  const __m256 acc[12] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel, acc[2 * r]);
    _mm256_storeu_ps(out + r * kPanel + 8, acc[2 * r + 1]);
  }
}

constexpr TileKernel kTiles[kRows + 1] = {nullptr,        tile_avx2<1>, tile_avx2<2>, tile_avx2<3>,
                                          tile_avx2<4>, tile_avx2<5>, tile_avx2<6>};
#endif

}  // namespace

// W (N, K) -> (ceil(N / 16), K, 16), the last panel zero-padded.
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.dim() == 2, "pack_panels: a float32 matrix");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  auto w = weight.contiguous();
  auto panels = torch::zeros({P, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const float* row = src + (p * kPanel + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = row[k];
      }
    }
  });
  return panels;
}

// y = x @ W.T + bias for x (M, K), with W given as panels from pack_panels and N its row count.
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && panels.dtype() == torch::kFloat32, "panel_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(1) == x.size(1) && panels.size(2) == kPanel &&
                  panels.is_contiguous() && (N + kPanel - 1) / kPanel == panels.size(0),
              "panel_linear: shapes disagree");
  auto xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "panel_linear: bias shape");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t block = 0; block < M; block += kRowBlock) {
    const int64_t block_end = std::min(M, block + kRowBlock);
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      float tile[kRows * kPanel];
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = wp + p * K * kPanel;
        const int64_t n0 = p * kPanel, width = std::min(kPanel, N - n0);
        const int64_t block_rows = block_end - block;
        const bool prefetch = p + 1 < end && block_rows >= kPrefetchRows;
        for (int64_t m0 = block; m0 < block_end; m0 += kRows) {
          const int64_t rows = std::min(kRows, block_end - m0);
#ifdef TOKENMILL_AVX2
          // this pass's share of the next panel's K lines
          const int64_t first = K * (m0 - block) / block_rows, last = K * (m0 - block + rows) / block_rows;
          kTiles[rows](xp + m0 * K, K, panel, K, tile, panel + (K + first) * kPanel, prefetch ? last - first : 0);
#else
          tile_scalar(xp + m0 * K, K, panel, K, tile, rows);
#endif
          for (int64_t r = 0; r < rows; ++r) {
            float* dst = yp + (m0 + r) * N + n0;
            for (int64_t j = 0; j < width; ++j) dst[j] = tile[r * kPanel + j] + (b ? b[n0 + j] : 0.0f);
          }
        }
      }
    });
  }
  return y;
}
