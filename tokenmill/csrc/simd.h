// Small SIMD helpers shared by the CPU kernels (AVX2 + FMA + F16C when the compiler targets them).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_AVX2 1

namespace tokenmill {

// exp(x), 8 lanes: x = n ln2 + r, exp(r) by Cephes' degree-6 polynomial (relative error ~1e-7).
// Inputs are clamped to [-87, 88], so the result underflows to ~1e-38, not 0. NaN stays NaN: max and
// min return their second operand when either is NaN, so x goes second (first, NaN became -87).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 8-bit tiles' integer multiply-add (gemm_cpu.cpp): where the CPU has VNNI, vpdpbusd adds the
// products of four unsigned bytes with four signed ones into each int32 lane in one instruction.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKENMILL_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#elif defined(__AVXVNNI__)
#define TOKENMILL_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#endif
// bfloat16 panels' vdpbf16ps (gemm_cpu.cpp).
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define TOKENMILL_BF16 1
constexpr bool kBf16 = true;
#else
constexpr bool kBf16 = false;
#endif
// bfloat16 panels' AMX tiles (gemm_cpu.cpp), for steps of many rows.
#if defined(TOKENMILL_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENMILL_AMX 1
#endif
#ifdef TOKENMILL_VNNI
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

}  // namespace tokenmill
#endif

// Softmax numerators, for the attention's scores and the MoE router's logits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace tokenmill {

// x[i] = exp(x[i] - max(x)) for i < n; returns their sum, and max(x) in *max_out.
inline float softmax_numerator_scalar(float* x, int64_t n, float* max_out) {
  const float mx = *max_out = *std::max_element(x, x + n);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - mx));
  return sum;
}

#ifdef TOKENMILL_AVX2
// As softmax_numerator_scalar, eight values at a time through exp256, the last n % 8 as one more
// vector with the lanes past n masked off: every attention row has such a tail, and std::exp
// one value at a time is slow beside exp256's eight.
inline float softmax_numerator_avx2(float* x, int64_t n, float* max_out) {
  const int64_t n8 = n / 8 * 8;
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - n8)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));  // the tail's lanes
  const __m256 tail = _mm256_blendv_ps(minus_inf, _mm256_maskload_ps(x + n8, keep), _mm256_castsi256_ps(keep));
  __m256 vmax = tail;
  for (int64_t i = 0; i < n8; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  const float mx = *max_out = *std::max_element(lanes, lanes + 8);
  const __m256 vm = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (n8 < n) {
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(tail, vm)), _mm256_castsi256_ps(keep));
    _mm256_maskstore_ps(x + n8, keep, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return hsum256(vsum);
}
#endif

// The build's fastest of the two.
inline float softmax_numerator(float* x, int64_t n, float* max_out) {
#ifdef TOKENMILL_AVX2
  return softmax_numerator_avx2(x, n, max_out);
#else
  return softmax_numerator_scalar(x, n, max_out);
#endif
}

}  // namespace tokenmill
