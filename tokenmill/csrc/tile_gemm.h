// The register tile behind every float32 matrix product of the CPU kernels: out (R x 16) =
// x (R x K) @ panel (K x 16), R up to 6 rows of x (12: kWideTileRows), the panel a contiguous
// run of K rows of 16.
// The inner loop holds the 6 x 16 tile in twelve registers, loading two vectors of the panel and
// broadcasting six scalars of x per k. The projections (gemm_cpu.cpp) keep their weights in such
// panels; prompt attention (paged_attention_cpu.cpp) scores rows of keys against panels of queries.
#pragma once

#include <cstdint>

#include "simd.h"

#ifdef TOKENMILL_AVX2
namespace tokenmill {

constexpr int64_t kTileWidth = 16;  // columns of a panel and of the tile
constexpr int64_t kTileRows = 6;    // rows of x per tile: 12 accumulators, two of W, one of x
// The most rows a tile takes: where AVX-512VL gives 256-bit instructions 32 registers, 12 (24
// accumulators), for small steps, which then stream each panel (and decode a block panel) once
// instead of once per 6 rows, which makes decode steps of 8 and 16 rows faster. Big products keep
// tiles of 6: decode steps of 24 to 64 rows ran slower in tiles of 12 (BENCHMARKS.md, "Speed work,
// every attempt (CPU, default model)").
#ifdef __AVX512VL__
constexpr int64_t kWideTileRows = 12;
#else
constexpr int64_t kWideTileRows = kTileRows;
#endif

// out rows are ldo floats apart; lines 0..pf_lines-1 of pf (64 bytes each, one panel row) are
// prefetched meanwhile, one per k (the projections fetch their next panel this way).
using TileKernel = void (*)(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
                            const float* pf, int64_t pf_lines);

// One row of a tile at one k: (lo, hi) += x_r[k] * (w0, w1).
inline void row_fma(const float* xk, __m256 w0, __m256 w1, __m256& lo, __m256& hi) {
  const __m256 xb = _mm256_broadcast_ss(xk);
  lo = _mm256_fmadd_ps(xb, w0, lo);
  hi = _mm256_fmadd_ps(xb, w1, hi);
}

inline void prefetch_line(const float* pf, int64_t k, int64_t pf_lines) {
  if (k < pf_lines) _mm_prefetch(reinterpret_cast<const char*>(pf + k * kTileWidth), _MM_HINT_T0);
}

template <int R>
void tile_avx2(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
               const float* pf, int64_t pf_lines);

// One row (batch-1 decode): the four accumulators take alternate k, so that no single FMA
// chain's latency paces the stream (measured faster: it streams at the plain read rate).
template <>
inline void tile_avx2<1>(const float* x, int64_t, const float* panel, int64_t K, float* out, int64_t,
                         const float* pf, int64_t pf_lines) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    prefetch_line(pf, k, pf_lines);
    prefetch_line(pf, k + 1, pf_lines);
    const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
    a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + k * kTileWidth), a0);
    a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + k * kTileWidth + 8), a1);
    a2 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(panel + (k + 1) * kTileWidth), a2);
    a3 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(panel + (k + 1) * kTileWidth + 8), a3);
  }
  if (k < K) {
    prefetch_line(pf, k, pf_lines);
    const __m256 x0 = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + k * kTileWidth), a0);
    a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(panel + k * kTileWidth + 8), a1);
  }
  _mm256_storeu_ps(out, _mm256_add_ps(a0, a2));
  _mm256_storeu_ps(out + 8, _mm256_add_ps(a1, a3));
}

// Named accumulators, not an array: GCC kept an accumulator array on the stack (a store per
// FMA, far slower).
template <int R>
void tile_avx2(const float* x, int64_t ldx, const float* panel, int64_t K, float* out, int64_t ldo,
               const float* pf, int64_t pf_lines) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
  __m256 a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  __m256 a12 = a0, a13 = a0, a14 = a0, a15 = a0, a16 = a0, a17 = a0;
  __m256 a18 = a0, a19 = a0, a20 = a0, a21 = a0, a22 = a0, a23 = a0;
  for (int64_t k = 0; k < K; ++k) {
    prefetch_line(pf, k, pf_lines);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kTileWidth), w1 = _mm256_loadu_ps(panel + k * kTileWidth + 8);
    row_fma(x + k, w0, w1, a0, a1);
    if constexpr (R > 1) row_fma(x + ldx + k, w0, w1, a2, a3);
    if constexpr (R > 2) row_fma(x + 2 * ldx + k, w0, w1, a4, a5);
    if constexpr (R > 3) row_fma(x + 3 * ldx + k, w0, w1, a6, a7);
    if constexpr (R > 4) row_fma(x + 4 * ldx + k, w0, w1, a8, a9);
    if constexpr (R > 5) row_fma(x + 5 * ldx + k, w0, w1, a10, a11);
    if constexpr (R > 6) row_fma(x + 6 * ldx + k, w0, w1, a12, a13);
    if constexpr (R > 7) row_fma(x + 7 * ldx + k, w0, w1, a14, a15);
    if constexpr (R > 8) row_fma(x + 8 * ldx + k, w0, w1, a16, a17);
    if constexpr (R > 9) row_fma(x + 9 * ldx + k, w0, w1, a18, a19);
    if constexpr (R > 10) row_fma(x + 10 * ldx + k, w0, w1, a20, a21);
    if constexpr (R > 11) row_fma(x + 11 * ldx + k, w0, w1, a22, a23);
  }
  const __m256 acc[24] = {a0,  a1,  a2,  a3,  a4,  a5,  a6,  a7,  a8,  a9,  a10, a11,
                          a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ldo, acc[2 * r]);
    _mm256_storeu_ps(out + r * ldo + 8, acc[2 * r + 1]);
  }
}

#ifdef __AVX512VL__
constexpr TileKernel kTiles[kWideTileRows + 1] = {
    nullptr,      tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>,  tile_avx2<5>,  tile_avx2<6>,
    tile_avx2<7>, tile_avx2<8>, tile_avx2<9>, tile_avx2<10>, tile_avx2<11>, tile_avx2<12>};
#else
constexpr TileKernel kTiles[kTileRows + 1] = {nullptr,        tile_avx2<1>, tile_avx2<2>, tile_avx2<3>,
                                              tile_avx2<4>, tile_avx2<5>, tile_avx2<6>};
#endif

}  // namespace tokenmill
#endif
