// y = x @ W.T (+ b), float32, for the projections of a transformer layer.
//
// General GEMM libraries block for large square products; at decode sizes oneDNN reached
// 60-110 GFLOP/s on this model's matrices against 150 at M = 512, and at M = 1 it left
// bandwidth unused. This kernel keeps W in panels of 16 output features, (ceil(N / 16), K, 16):
// a panel is one contiguous run that streams from memory once per block of rows, and the inner
// loop (tile_gemm.h) holds a 6 x 16 tile of y in twelve registers, loading two vectors of W and
// broadcasting six scalars of x per k. Measured against oneDNN on the default model's matrices
// (2 threads): 1.5x at M = 1, 1.2-1.4x from 16 to 128 rows, about even at 512. Panels are split
// across threads; rows go in blocks of 512 so that a block of x stays in cache while the panels
// stream past.
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

#include "tile_gemm.h"

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int64_t kRows = 6;    // rows of x per tile
constexpr int64_t kRowBlock = 512;  // rows of x per pass over the panels (a default prefill chunk)
constexpr int64_t kPrefetchRows = 4;  // prefetch the next panel from this many rows of x up
#ifdef TOKENMILL_AVX2
static_assert(kPanel == tokenmill::kTileWidth && kRows == tokenmill::kTileRows, "panels are the tile's shape");
#endif

// The 16 outputs of one panel for `rows` rows of x (any row count up to 6), into out (rows, 16),
// without AVX2.
void tile_scalar(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < kPanel; ++j) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[r * ldx + k] * panel[k * kPanel + j];
      out[r * kPanel + j] = s;
    }
  }
}

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
          tokenmill::kTiles[rows](xp + m0 * K, K, panel, K, tile, kPanel, panel + (K + first) * kPanel,
                                  prefetch ? last - first : 0);
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
