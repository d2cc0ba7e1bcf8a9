// Paged attention on the CPU for decodes and prompt chunks, reading K/V in place from the block
// pool.
//
// A work item is a tile of up to 8 consecutive query tokens of one sequence (16 for sequences
// with 64 query tokens or more; one token for a decode) and a range of kv heads. It makes two
// passes over the sequence's blocks: the first scores the G = Hq / Hkv query heads of each kv
// head and each token of the tile against every key it may see, then one softmax per (token,
// query head) runs over its whole row of scores (vectorised, no per-block rescaling), and the
// second pass sums the values weighted by it, all G heads of a kv head at once so each value row
// is loaded once. A tile reads each block once for all its tokens: a prompt chunk late in a long
// prompt would otherwise read the whole context once per token.
//
// Tiles of 8 query rows or more per kv head (prompt chunks) take another route with the same two
// passes, prompt_tile_gemm below, which runs both as small matrix products.
//
// What bounds this kernel for decodes is reading the pool: each block is a few KB somewhere in
// memory, and short scattered runs stream far slower than long ones, the shorter the slower
// (measured on one core: BENCHMARKS.md, "Speed work, every attempt (CPU, default model)"). So with
// enough tiles to keep every thread busy an item takes all kv heads of its tile, reading each
// block's heads as one contiguous run. A step of a few decodes (batch-1 decode above all) splits
// each context into parts of at least kMinPartBlocks blocks instead (flash-decoding), an item per
// part with all kv heads, and merges the parts' softmax sums at the end: against one kv head per
// item, that makes a batch-1 decode's attention faster, the more so the longer its context. Other
// steps with few tiles give an item one kv head, for parallelism. Items are cut into pieces of
// equal total context length, up to 16 per thread; a thread done with its own share of the
// pieces takes some from the back of the others' (parallel.h).
// (A single pass with an online softmax per block is slower: its per-block max, exp and
// rescaling are scalar work on every 16 keys.)
//
// The pool holds float32, float16 or bfloat16 (kv_cache_dtype="float16" or "bfloat16": half the
// bytes to read, each row widened to float32 as it is loaded: F16C, or a 16-bit shift for
// bfloat16, whose bits are a float32's upper half), or int8 (kv_cache_dtype="int8": D + 4 bytes a
// row, see below); queries, scores and sums are float32.
//
// An int8 pool holds each token's key (and value) of each kv head as D codes and one float32
// scale, value = code * scale, with scale = max |x| / 127 over the row: rows written one token at a
// time never rescale the rows before them. Each (block, kv head) run is block_size rows of D codes
// followed by their block_size scales, so the code rows keep the float pools' layout and stride;
// the pool's last dimension is D + 4 to make room. Scores are taken over the codes and multiplied
// by each key's scale, and the softmax weights by each value's scale before the values are summed,
// so a code is widened to float32 as a float16 is, with no multiply of its own.
//
// Shapes (contiguous):
//   q            (T, Hq, D)                         queries, flat (rows may be strided)
//   k_cache      (num_blocks, Hkv, block_size, W)   the pool of one layer, W = D (D + 4 for int8)
//   v_cache      (num_blocks, Hkv, block_size, W)
//   block_tables (B, max_blocks)                    int32
//   query_start  (B + 1,)                           int32, sequence b owns tokens [qs[b], qs[b+1])
//   seq_lens     (B,)                               int32, context length including the new tokens
//   window       keys a query sees, itself included (0: all of them)
//   softcap      c > 0: each score s becomes c * tanh(s / c) before the softmax (Gemma 2); 0: none.
//                Applied to a row of scores between the two passes, so a capped step takes the
//                row-by-row passes, never prompt_tile_gemm (whose scores never sit in a row)
//   sinks        (Hq,) float32 or undefined: a learned logit per query head (gpt-oss) that joins each
//                row's softmax denominator as one more score, taking probability mass but adding no
//                value: out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m))
// Query j of sequence b sits at position seq_lens[b] - qlen + j and sees positions 0..itself, or
// with a window only the last `window` of those: reading starts at the block holding the first
// key the tile's first query sees (blocks before it may have been given back to the pool).
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "parallel.h"
#include "simd.h"
#include "tile_gemm.h"

namespace {

// The run of the pool to read next (one kv head of one block, a few KB at a random place, where
// the hardware prefetcher starts late), asked for two cache lines at a time from inside the
// primitives' loops. Asked for in one burst of 64 prefetches instead, the lines fill the core's
// miss buffers and load queue, and the arithmetic on the current run waits behind them: batch-64
// decodes run faster with the prefetches spread out, over scattered blocks and contiguous ones
// alike, and the burst itself gains little over no prefetching at all. Two lines an iteration
// covers a whole run when a kv head serves two query heads or more (G >= 2); stepping as fast as
// the loops read (four lines an iteration of the dot products) is slower at G = 3. What the loops
// leave of a run (G = 1) is left to the hardware prefetcher, not asked for in a burst.
struct PrefetchCursor {
  const char* p = nullptr;
  const char* end = nullptr;
  void set(const void* begin, int64_t bytes) {
    p = static_cast<const char*>(begin);
    end = p + bytes;
  }
  void step2() {
    for (int i = 0; i < 2 && p < end; ++i, p += 64) __builtin_prefetch(p, 0, 3);
  }
};

// An int8 pool's rows come with scales (see above); the float pools' do not.
template <typename KV>
constexpr bool kScaled = std::is_same_v<KV, int8_t>;
template <typename KV>
constexpr int64_t kScaleBytes = kScaled<KV> ? 4 : 0;  // a row's width past its D codes

// The block_size scales of an int8 run that starts at `run` (row 0 of one kv head of one block).
inline const float* run_scales(const int8_t* run, int64_t block_size, int64_t D) {
  return reinterpret_cast<const float*>(run + block_size * D);
}

// x[g * stride + i] *= s[i] for g < G, i < n: scores or weights of G heads scaled by n rows' scales.
inline void scale_rows(float* x, int64_t G, int64_t stride, const float* s, int64_t n) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i) x[g * stride + i] *= s[i];
}

// ---- portable primitives (any D); KV is float, at::Half, at::BFloat16 or int8_t ----------

// scores[j] = scale * <q, k_j> for j < n, k: (n, D)
template <typename KV>
void block_scores_scalar(const float* q, const KV* k, int64_t n, int64_t D, float scale, float* scores,
                         PrefetchCursor& pf) {
  for (int64_t j = 0; j < n; ++j) {
    pf.step2();
    float s = 0.0f;
    for (int64_t d = 0; d < D; ++d) s += q[d] * static_cast<float>(k[j * D + d]);
    scores[j] = s * scale;
  }
}

// The G query heads of one kv head (q + g * D) against the same keys: scores of head g in
// scores[g * row + j].
template <typename KV>
void head_scores_scalar(const float* q, const KV* k, int64_t n, int64_t D, float scale, float* scores, int64_t row,
                        int64_t G, PrefetchCursor& pf) {
  for (int64_t g = 0; g < G; ++g) block_scores_scalar(q + g * D, k, n, D, scale, scores + g * row, pf);
}

// acc[g] += sum_j w[g * w_stride + j] * v_j for g < G, v: (n, D), acc: (G, D)
template <typename KV>
void block_accumulate_scalar(float* acc, int64_t G, const float* w, int64_t w_stride, const KV* v, int64_t n,
                             int64_t D, PrefetchCursor& pf) {
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < n; ++j) {
      pf.step2();
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += w[g * w_stride + j] * static_cast<float>(v[j * D + d]);
    }
  }
}

#ifdef TOKENMILL_AVX2
// ---- AVX2 + FMA primitives (D a multiple of 8) --------------------------------------------

// Eight cache elements as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {
  const __m256i halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in seven shuffles instead of forty.
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The last n < 8 keys of a run as block_scores_avx2 scores a group of eight, so each score has the
// same bits as in a full group: lanes past n repeat key n - 1 (read, never stored). Every
// sequence's last block has such a tail, which key by key in scalar code cost more than its size.
template <typename KV>
void tail_scores_avx2(const float* q, const KV* k, int64_t n, int64_t D, float scale, float* scores,
                      PrefetchCursor& pf) {
  __m256 a[8];
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    pf.step2();
    for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, load8(k + std::min<int64_t>(r, n - 1) * D + d), a[r]);
  }
  alignas(32) float s[8];
  _mm256_store_ps(s, _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale)));
  std::copy(s, s + n, scores);
}

template <typename KV>
void block_scores_avx2(const float* q, const KV* k, int64_t n, int64_t D, float scale, float* scores,
                       PrefetchCursor& pf) {
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {  // eight keys at a time, one accumulator each
    __m256 a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      pf.step2();
      for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, load8(k + (j + r) * D + d), a[r]);
    }
    _mm256_storeu_ps(scores + j, _mm256_mul_ps(reduce8(a), vscale));
  }
  if (j < n) tail_scores_avx2(q, k + j * D, n - j, D, scale, scores + j, pf);
}

// Scores of GH query heads (2 or 3) of one kv head for the first n keys (n a multiple of 4), four
// keys at a time: each key vector loaded feeds GH FMAs, where block_scores_avx2, one head at a
// time, loads every key vector once per head (GH x 4 accumulators, GH query vectors and one key
// vector: all 16 registers at GH = 3). Each score is block_scores_avx2's, bit for bit: the same
// FMAs per lane in the same order, and the same horizontal sums (reduce8).
template <typename KV, int GH>
void head_group_scores(const float* q, const KV* k, int64_t n, int64_t D, float scale, float* scores, int64_t row,
                       PrefetchCursor& pf) {
  static_assert(GH == 2 || GH == 3, "two or three heads at a time");
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 4) {
    __m256 a[4 * GH];  // a[4 g + r]: head g, key j + r
    for (int i = 0; i < 4 * GH; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      pf.step2();
      __m256 qv[GH];
      for (int g = 0; g < GH; ++g) qv[g] = _mm256_loadu_ps(q + g * D + d);
      for (int r = 0; r < 4; ++r) {
        const __m256 kv = load8(k + (j + r) * D + d);
        for (int g = 0; g < GH; ++g) a[4 * g + r] = _mm256_fmadd_ps(qv[g], kv, a[4 * g + r]);
      }
    }
    const __m256 s01 = _mm256_mul_ps(reduce8(a), vscale);  // heads 0 and 1, four keys each
    _mm_storeu_ps(scores + j, _mm256_castps256_ps128(s01));
    _mm_storeu_ps(scores + row + j, _mm256_extractf128_ps(s01, 1));
    if constexpr (GH == 3) {
      const __m256 rest[8] = {a[8], a[9], a[10], a[11], _mm256_setzero_ps(), _mm256_setzero_ps(),
                              _mm256_setzero_ps(), _mm256_setzero_ps()};
      _mm_storeu_ps(scores + 2 * row + j, _mm256_castps256_ps128(_mm256_mul_ps(reduce8(rest), vscale)));
    }
  }
}

// head_scores_scalar with AVX2: heads three (or two) at a time over the keys that
// block_scores_avx2 takes eight at a time, the rest of them as it does (tail_scores_avx2); a last
// head alone by block_scores_avx2. On the default model's shapes (three query heads per kv head) the
// attention takes less time than with one head at a time, or about as much (batch 1 at 1,000 keys).
template <typename KV>
void head_scores_avx2(const float* q, const KV* k, int64_t n, int64_t D, float scale, float* scores, int64_t row,
                      int64_t G, PrefetchCursor& pf) {
  const int64_t n8 = n / 8 * 8;
  const auto tail = [&](int64_t g0, int64_t heads) {
    for (int64_t g = g0; g < g0 + heads && n8 < n; ++g)
      tail_scores_avx2(q + g * D, k + n8 * D, n - n8, D, scale, scores + g * row + n8, pf);
  };
  int64_t g = 0;
  for (; G - g >= 3; g += 3) {
    head_group_scores<KV, 3>(q + g * D, k, n8, D, scale, scores + g * row, row, pf);
    tail(g, 3);
  }
  if (G - g == 2) {
    head_group_scores<KV, 2>(q + g * D, k, n8, D, scale, scores + g * row, row, pf);
    tail(g, 2);
  } else if (G - g == 1) {
    block_scores_avx2(q + g * D, k, n, D, scale, scores + g * row, pf);
  }
}

// GC heads x VC vectors of the accumulator in registers while the n value rows stream past:
// each loaded value vector feeds GC FMAs.
template <typename KV, int GC, int VC>
void accumulate_tile(float* acc, const float* w, int64_t w_stride, const KV* v, int64_t n, int64_t D,
                     PrefetchCursor& pf) {
  __m256 r[GC][VC];
  for (int g = 0; g < GC; ++g)
    for (int i = 0; i < VC; ++i) r[g][i] = _mm256_loadu_ps(acc + g * D + 8 * i);
  for (int64_t j = 0; j < n; ++j) {
    __m256 vj[VC];
    pf.step2();
    for (int i = 0; i < VC; ++i) vj[i] = load8(v + j * D + 8 * i);
    for (int g = 0; g < GC; ++g) {
      const __m256 wg = _mm256_set1_ps(w[g * w_stride + j]);
      for (int i = 0; i < VC; ++i) r[g][i] = _mm256_fmadd_ps(wg, vj[i], r[g][i]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int i = 0; i < VC; ++i) _mm256_storeu_ps(acc + g * D + 8 * i, r[g][i]);
}

template <typename KV, int VC>
void accumulate_heads(float* acc, int64_t G, const float* w, int64_t w_stride, const KV* v, int64_t n,
                      int64_t D, PrefetchCursor& pf) {
  for (int64_t d0 = 0; d0 < D; d0 += 8 * VC) {  // tiles of up to 3 heads x VC vectors (12 registers)
    int64_t g = 0;
    for (; g + 3 <= G; g += 3)
      accumulate_tile<KV, 3, VC>(acc + g * D + d0, w + g * w_stride, w_stride, v + d0, n, D, pf);
    if (G - g == 2)
      accumulate_tile<KV, 2, VC>(acc + g * D + d0, w + g * w_stride, w_stride, v + d0, n, D, pf);
    if (G - g == 1)
      accumulate_tile<KV, 1, VC>(acc + g * D + d0, w + g * w_stride, w_stride, v + d0, n, D, pf);
  }
}

template <typename KV>
void block_accumulate_avx2(float* acc, int64_t G, const float* w, int64_t w_stride, const KV* v, int64_t n,
                           int64_t D, PrefetchCursor& pf) {
  if (D % 32 == 0) {
    accumulate_heads<KV, 4>(acc, G, w, w_stride, v, n, D, pf);
  } else {
    accumulate_heads<KV, 1>(acc, G, w, w_stride, v, n, D, pf);
  }
}

// ---- prompt tiles as small matrix products (AVX2, D a multiple of 32) -------------------------
//
// A tile of nt query tokens has R = nt * G query rows per kv head. Rather than one dot product per
// (row, key), pass 1 runs the register tile of tile_gemm.h with rows of keys as x and the tile's
// queries as panels of 16 rows, (D, 16) each, scores landing transposed: st[key][row]. The softmax
// then runs key by key, eight rows per vector (st in the order it lies: over a long context st
// outgrows the caches, and sweeps down one column of vectors at a time read it once per column),
// giving weight 0 to keys a row may not see, and pass 2 sums the value rows for six rows and 16
// columns at a time, over spans of several blocks (span_tile). For one sequence's prompt in one
// chunk on the default model that is faster than the per-row path, and faster than SDPA on the
// gathered context, by most on short prompts (measured: BENCHMARKS.md, "Speed work, every attempt
// (CPU, default model)" and "Long prompts on an AVX2-only CPU").

struct PromptScratch {
  std::vector<float> qt, keys, st, acc, sums, lens, maxes;
};

// The prompt tile's softmax numerators in place of its scores st (keys x RP rows, row r seeing the
// first last_len - (nt - 1 - r / G) keys; rows from R on are padding) and each row's sum, with its
// sink where `sinks`. Key by key: the rows' maxima, then each e = exp(s - max) and the sums. Every
// row sees the keys before the tile's last nt - 1, which take no mask (a padding row's numbers
// there are never read).
void prompt_softmax(int64_t nt, int64_t G, int64_t R, int64_t RP, int64_t last_len, const float* sinks,
                    PromptScratch& s) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t all_see = last_len - (nt - 1);
  s.lens.resize(RP);
  s.maxes.assign(RP, -std::numeric_limits<float>::infinity());
  s.sums.assign(RP, 0.0f);
  for (int64_t r = 0; r < RP; ++r) s.lens[r] = r < R ? static_cast<float>(last_len - (nt - 1 - r / G)) : 0.0f;
  float *lens = s.lens.data(), *maxes = s.maxes.data(), *sums = s.sums.data();
  const auto seen = [&](int64_t key, int64_t c0) {
    return _mm256_cmp_ps(_mm256_set1_ps(static_cast<float>(key)), _mm256_loadu_ps(lens + c0), _CMP_LT_OQ);
  };
  for (int64_t key = 0; key < last_len; ++key) {
    const float* sp = &s.st[key * RP];
    for (int64_t c0 = 0; c0 < RP; c0 += 8) {
      __m256 v = _mm256_loadu_ps(sp + c0);
      if (key >= all_see) v = _mm256_blendv_ps(ninf, v, seen(key, c0));
      _mm256_storeu_ps(maxes + c0, _mm256_max_ps(_mm256_loadu_ps(maxes + c0), v));
    }
  }
  for (int64_t key = 0; key < last_len; ++key) {
    float* sp = &s.st[key * RP];
    for (int64_t c0 = 0; c0 < RP; c0 += 8) {
      __m256 e = tokenmill::exp256(_mm256_sub_ps(_mm256_loadu_ps(sp + c0), _mm256_loadu_ps(maxes + c0)));
      if (key >= all_see) e = _mm256_and_ps(e, seen(key, c0));
      _mm256_storeu_ps(sp + c0, e);
      _mm256_storeu_ps(sums + c0, _mm256_add_ps(_mm256_loadu_ps(sums + c0), e));
    }
  }
  for (int64_t r = 0; sinks != nullptr && r < R; ++r)  // each row's sink joins its denominator, as the rest
    sums[r] += std::exp(sinks[r % G] - maxes[r]);
}

constexpr int64_t kSpanKeys = 64;  // keys whose value rows pass 2 sums with each row group's sums in registers

// Pass 2 of a prompt tile for GC rows and 16 columns d0.. of their outputs, over `span` keys
// (consecutive blocks of block_size keys, the values of block b at values[b]): the rows' sums stay
// in registers (2 GC of the 16) across the span's blocks, each loaded value vector feeding GC FMAs.
// Every sum adds its keys in order, as one block at a time would.
template <typename KV, int GC>
void span_tile(float* acc, int64_t D, const float* w, int64_t RP, const KV* const* values, int64_t d0,
               int64_t span, int64_t block_size) {
  __m256 r[GC][2];
  for (int g = 0; g < GC; ++g)
    for (int i = 0; i < 2; ++i) r[g][i] = _mm256_loadu_ps(acc + g * D + 8 * i);
  for (int64_t p = 0, b = 0; p < span; p += block_size, ++b) {
    const KV* v = values[b] + d0;
    const float* wb = w + p * RP;
    for (int64_t j = 0; j < std::min(block_size, span - p); ++j) {
      const __m256 v0 = load8(v + j * D), v1 = load8(v + j * D + 8);
      for (int g = 0; g < GC; ++g) {
        const __m256 wg = _mm256_set1_ps(wb[j * RP + g]);
        r[g][0] = _mm256_fmadd_ps(wg, v0, r[g][0]);
        r[g][1] = _mm256_fmadd_ps(wg, v1, r[g][1]);
      }
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int i = 0; i < 2; ++i) _mm256_storeu_ps(acc + g * D + 8 * i, r[g][i]);
}

// span_tile for the last rows rows (fewer than 6) of a tile.
template <typename KV>
void span_tail(int64_t rows, float* acc, int64_t D, const float* w, int64_t RP, const KV* const* values,
               int64_t d0, int64_t span, int64_t block_size) {
  switch (rows) {
    case 5: return span_tile<KV, 5>(acc, D, w, RP, values, d0, span, block_size);
    case 4: return span_tile<KV, 4>(acc, D, w, RP, values, d0, span, block_size);
    case 3: return span_tile<KV, 3>(acc, D, w, RP, values, d0, span, block_size);
    case 2: return span_tile<KV, 2>(acc, D, w, RP, values, d0, span, block_size);
    case 1: return span_tile<KV, 1>(acc, D, w, RP, values, d0, span, block_size);
    default: return;
  }
}

// Attention of query rows r = j * G + g (token j of the tile, head g of the kv head's group) over
// the keys of one kv head: row r sees the first last_len - (nt - 1 - j) keys. q(j, g) and out(j, g)
// point at a row's query and output; head_run(p0) at the (block_size, D) run of keys p0.. (or of
// values, values = true), its scales after it in an int8 pool. sinks: the G heads' sink logits (see
// above), or nullptr for none.
template <typename KV, typename Q, typename O, typename Run>
void prompt_tile_gemm(int64_t nt, int64_t G, int64_t D, int64_t last_len, int64_t block_size, float scale, Q q,
                      O out, Run head_run, const float* sinks, PromptScratch& s) {
  const int64_t R = nt * G, RP = (R + 15) / 16 * 16, num_panels = RP / 16;
  const int64_t keys_rounded = (last_len + block_size - 1) / block_size * block_size;
  s.qt.assign(RP * D, 0.0f);
  s.st.resize(keys_rounded * RP);
  s.acc.assign(R * D, 0.0f);
  s.keys.resize(block_size * D);
  for (int64_t r = 0; r < R; ++r) {  // qt[panel][d][c] = scale * q(row 16 panel + c)[d]
    const float* qr = q(r / G, r % G);
    float* dst = s.qt.data() + (r / 16) * D * 16 + r % 16;
    for (int64_t d = 0; d < D; ++d) dst[d * 16] = qr[d] * scale;
  }
  for (int64_t p0 = 0; p0 < last_len; p0 += block_size) {  // pass 1
    const int64_t n = std::min(block_size, last_len - p0);
    const KV* run = head_run(p0, false);
    const float* k;
    if constexpr (std::is_same_v<KV, float>) {
      k = run;
    } else if constexpr (kScaled<KV>) {  // widen and scale the block's keys once for all the tile's rows
      const float* ks = run_scales(run, block_size, D);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; ++d) s.keys[i * D + d] = static_cast<float>(run[i * D + d]) * ks[i];
      k = s.keys.data();
    } else {  // widen the block's keys once for all the tile's rows
      for (int64_t i = 0; i < n * D; ++i) s.keys[i] = static_cast<float>(run[i]);
      k = s.keys.data();
    }
    for (int64_t k0 = 0; k0 < n; k0 += tokenmill::kTileRows) {
      const int64_t rows = std::min(tokenmill::kTileRows, n - k0);
      for (int64_t panel = 0; panel < num_panels; ++panel)
        tokenmill::kTiles[rows](k + k0 * D, D, s.qt.data() + panel * D * 16, D,
                                s.st.data() + (p0 + k0) * RP + panel * 16, RP, nullptr, 0);
    }
  }
  prompt_softmax(nt, G, R, RP, last_len, sinks, s);
  std::array<const KV*, kSpanKeys> values;  // pass 2, whole blocks of about kSpanKeys keys at a time
  const int64_t span_keys = std::max<int64_t>(1, kSpanKeys / block_size) * block_size;
  for (int64_t p0 = 0; p0 < last_len; p0 += span_keys) {
    const int64_t span = std::min(span_keys, last_len - p0);
    int64_t runs = 0;
    for (int64_t p = p0; p < p0 + span; p += block_size) {
      const KV* v = head_run(p, true);
      values[runs++] = v;
      if constexpr (kScaled<KV>) {  // each key's weights (a row of RP) times its value's scale
        const float* vs = run_scales(v, block_size, D);
        float* w = s.st.data() + p * RP;
        for (int64_t i = 0; i < std::min(block_size, p0 + span - p); ++i)
          for (int64_t c = 0; c < RP; ++c) w[i * RP + c] *= vs[i];
      }
    }
    const float* w = s.st.data() + p0 * RP;
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      int64_t r = 0;
      for (; r + 6 <= R; r += 6) span_tile<KV, 6>(&s.acc[r * D + d0], D, w + r, RP, values.data(), d0, span, block_size);
      span_tail<KV>(R - r, &s.acc[r * D + d0], D, w + r, RP, values.data(), d0, span, block_size);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* o = out(r / G, r % G);
    const float inv = 1.0f / s.sums[r];
    for (int64_t d = 0; d < D; ++d) o[d] = s.acc[r * D + d] * inv;
  }
}
#endif

template <typename KV>
struct Primitives {
  void (*scores)(const float*, const KV*, int64_t, int64_t, float, float*, int64_t, int64_t, PrefetchCursor&);
  void (*accumulate)(float*, int64_t, const float*, int64_t, const KV*, int64_t, int64_t, PrefetchCursor&);
  float (*softmax_numerator)(float*, int64_t, float*);
};

template <typename KV>
Primitives<KV> pick_primitives(int64_t D) {
#ifdef TOKENMILL_AVX2
  if (D % 8 == 0) return {head_scores_avx2<KV>, block_accumulate_avx2<KV>, tokenmill::softmax_numerator_avx2};
#endif
  return {head_scores_scalar<KV>, block_accumulate_scalar<KV>, tokenmill::softmax_numerator_scalar};
}

constexpr int64_t kQueryTile = 8;  // query tokens of one sequence that share each block read
constexpr int64_t kLongQuery = 64;  // from this many query tokens a sequence takes tiles of 2 * kQueryTile
constexpr int64_t kPromptRowsMin = 8;  // query rows per kv head from which a tile runs prompt_tile_gemm
// A decode's context splits into parts of at least this many blocks: two, so that a batch-1
// decode over a short context (a few hundred keys) already runs on every thread; parts of one
// block cost more in merging than they save (BENCHMARKS.md).
constexpr int64_t kMinPartBlocks = 2;
constexpr int64_t kPiecesPerThread = 16;  // work shared out in pieces of equal cost (parallel.h)
constexpr int64_t kParallelWriteTokens = 8;  // write_kv splits keys and values over two threads from here

template <typename KV>
at::Tensor paged_attention_impl(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                at::Tensor block_tables, at::Tensor query_start,
                                at::Tensor seq_lens, double scale, int64_t window, double softcap,
                                const float* sinks, const c10::optional<at::Tensor>& rows) {
  TM_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_attention: q heads must be contiguous");
  TM_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous(),
           "paged_attention: the pool and block tables must be contiguous");
  TM_CHECK(block_tables.dtype() == at::kInt && query_start.dtype() == at::kInt &&
               seq_lens.dtype() == at::kInt, "paged_attention: int32 metadata");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t W = D + kScaleBytes<KV>;  // a row's width in the pool
  const int64_t G = Hq / Hkv;
  const int64_t B = seq_lens.size(0);
  const int64_t max_blocks = block_tables.size(1);
  TM_CHECK(Hq % Hkv == 0 && k_cache.size(3) == W && v_cache.sizes() == k_cache.sizes(),
           "paged_attention: head shapes disagree");
  TM_CHECK(!kScaled<KV> || block_size * D % 4 == 0, "paged_attention: an int8 pool's scales must be 4-byte aligned");

  const float* qp = q.data_ptr<float>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int64_t q_stride = q.stride(0);  // q may be a view into the fused qkv rows
  auto out = out_or_empty(rows, {T, Hq, D}, "paged_attention");
  float* op = out.data_ptr<float>();

  // Tiles: up to kQueryTile consecutive query tokens of one sequence (twice that from kLongQuery
  // query tokens up), so a prompt chunk reads each block once for the whole tile rather than once
  // per token.
  std::vector<int32_t> tile_start, tile_stop, tile_seq;
  int64_t max_len = 0, max_tile = 1;
  for (int64_t b = 0; b < B; ++b) {
    max_len = std::max<int64_t>(max_len, sl[b]);
    const int64_t qlen = qs[b + 1] - qs[b], tile = qlen >= kLongQuery ? 2 * kQueryTile : kQueryTile;
    max_tile = std::max<int64_t>(max_tile, std::min<int64_t>(qlen, tile));
    for (int32_t t = qs[b]; t < qs[b + 1]; t += tile) {
      tile_start.push_back(t);
      tile_stop.push_back(static_cast<int32_t>(std::min<int64_t>(t + tile, qs[b + 1])));
      tile_seq.push_back(static_cast<int32_t>(b));
    }
  }
  const int64_t num_tiles = static_cast<int64_t>(tile_seq.size());
  // keys token t sees: its sequence's context up to and including itself
  const auto kv_len_of = [&](int64_t t, int64_t b) { return sl[b] - (qs[b + 1] - t) + 1; };
  // the first key it sees, and the first position of the block holding it
  const auto first_key_of = [&](int64_t t, int64_t b) {
    return window > 0 ? std::max<int64_t>(0, kv_len_of(t, b) - window) : int64_t{0};
  };
  const auto first_read_of = [&](int64_t t, int64_t b) { return first_key_of(t, b) / block_size * block_size; };
  const auto tile_end = [&](int64_t i) { return static_cast<int64_t>(tile_stop[i]); };

  const int64_t threads = at::get_num_threads();
  // A step of only decodes, too few to give every thread several items, splits each decode's
  // context into parts of whole blocks (flash-decoding): an item is then one part with all kv heads,
  // and the parts' softmax sums are merged at the end. Otherwise an item is a whole tile, with all
  // kv heads when there are enough tiles and one kv head when there are not.
  const bool decodes_only = max_tile == 1;
  const bool split = decodes_only && num_tiles < 4 * threads;
  const int64_t H = split || num_tiles >= 4 * threads ? Hkv : 1;  // kv heads per item
  std::vector<int32_t> item_tile, item_part, tile_parts(num_tiles, 1);
  for (int64_t i = 0; i < num_tiles; ++i) {
    if (split) {
      const int64_t blocks =
          (kv_len_of(tile_start[i], tile_seq[i]) - first_read_of(tile_start[i], tile_seq[i]) + block_size - 1) /
          block_size;
      const int64_t want = (4 * threads + num_tiles - 1) / num_tiles;
      tile_parts[i] = static_cast<int32_t>(std::clamp<int64_t>(blocks / kMinPartBlocks, 1, want));
    }
    for (int64_t part = 0; part < tile_parts[i]; ++part)
      for (int64_t h = 0; h < Hkv / H; ++h) {
        item_tile.push_back(static_cast<int32_t>(i));
        item_part.push_back(static_cast<int32_t>(split ? part : h));  // the part, or the kv head group
      }
  }
  const int64_t num_items = static_cast<int64_t>(item_tile.size());
  // key range [begin, end) of part `part` of `parts` over keys first..last_len, in whole blocks
  // (first is a block's first position)
  const auto part_range = [&](int64_t first, int64_t last_len, int64_t part, int64_t parts) {
    const int64_t blocks = (last_len - first + block_size - 1) / block_size;
    return std::make_pair(first + blocks * part / parts * block_size,
                          std::min(last_len, first + blocks * (part + 1) / parts * block_size));
  };
  // prefix sums of each item's work: keys scored, summed over its tokens (a tile reads each block
  // once, but scores it once per token)
  std::vector<int64_t> cost_before(num_items + 1, 0);
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t i = item_tile[item];
    int64_t cost = 0;
    if (split) {
      const auto [k0, k1] = part_range(first_read_of(tile_start[i], tile_seq[i]), kv_len_of(tile_start[i], tile_seq[i]),
                                       item_part[item], tile_parts[i]);
      cost = k1 - k0;
    } else {
      for (int64_t t = tile_start[i]; t < tile_end(i); ++t) cost += kv_len_of(t, tile_seq[i]) - first_key_of(t, tile_seq[i]);
    }
    cost_before[item + 1] = cost_before[item] + cost;
  }
  // a split item's unnormalised output, its scores' max and its softmax sum, per query head
  std::vector<float> part_acc(split ? num_items * Hq * D : 0), part_max(split ? num_items * Hq : 0),
      part_sum(split ? num_items * Hq : 0);
  // cut into pieces of about equal cost, shared out with stealing (parallel.h)
  const int64_t num_pieces = std::min(threads * kPiecesPerThread, num_items);
  const int64_t total_cost = cost_before[num_items];
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const Primitives<KV> prim = pick_primitives<KV>(D);
  const int64_t row = (max_len + 7) / 8 * 8;  // one query head's scores
  const int64_t HG = H * G;                   // query heads of an item, per token
  const int64_t run_bytes = block_size * W * static_cast<int64_t>(sizeof(KV));  // one head of one block

  // the first item whose cost prefix reaches piece/num_pieces of the total
  const auto item_at = [&](int64_t piece) -> int64_t {
    if (piece == num_pieces) return num_items;
    return std::lower_bound(cost_before.begin(), cost_before.end() - 1, total_cost * piece / num_pieces) -
           cost_before.begin();
  };
  tokenmill::parallel_chunks(num_pieces, 1, [&](tokenmill::ThreadChunks& pieces) {
    // every score an item reads is written first by its pass 1, so no zero fill
    std::unique_ptr<float[]> scores(new float[max_tile * HG * row]);
    std::vector<float> acc(max_tile * HG * D), sums(max_tile * HG), maxes(max_tile * HG);
#ifdef TOKENMILL_AVX2
    PromptScratch prompt_scratch;
#endif
    PrefetchCursor pf;
    for (int64_t first, last; pieces.next(first, last);)
    for (int64_t item = item_at(first), end = item_at(last); item < end; ++item) {
      const int64_t tile = item_tile[item], h0 = split ? 0 : item_part[item] * H;
      const int64_t b = tile_seq[tile], t0 = tile_start[tile], nt = tile_end(tile) - t0;
      const int64_t last_len = kv_len_of(t0 + nt - 1, b);  // the tile's longest context
      // the keys this item reads: all of them (from the window's first block), or one part's
      const int64_t first_read = first_read_of(t0, b);
      const auto [k_begin, k_end] = split ? part_range(first_read, last_len, item_part[item], tile_parts[tile])
                                          : std::pair<int64_t, int64_t>{first_read, last_len};
      const int32_t* table = bt + b * max_blocks;
      // where the run of kv head h0 + h of the sequence's block `blk` starts in the pool (the loops
      // count blocks rather than divide positions by block_size, known only at run time: a 64-bit
      // division per run takes tens of cycles)
      const auto head_base = [&](int64_t blk, int64_t h) {
        return (static_cast<int64_t>(table[blk]) * Hkv + h0 + h) * block_size * W;
      };
      const auto query = [&](int64_t j, int64_t g) { return qp + (t0 + j) * q_stride + (h0 * G + g) * D; };
      // token j's first key (window) and the keys of block p0 that it sees, counted from the block's
      // start (0 when the block is past it, or wholly before its window)
      const auto first_key = [&](int64_t j) { return first_key_of(t0 + j, b); };
      const auto visible = [&](int64_t j, int64_t p0) {
        if (p0 + block_size <= first_key(j)) return int64_t{0};
        return std::clamp<int64_t>(last_len - (nt - 1 - j) - p0, 0, block_size);
      };
#ifdef TOKENMILL_AVX2
      if (!split && window == 0 && cap == 0.0f && nt * G >= kPromptRowsMin && D % 32 == 0) {
        for (int64_t h = 0; h < H; ++h) {
          prompt_tile_gemm<KV>(
              nt, G, D, last_len, block_size, fscale, [&](int64_t j, int64_t g) { return query(j, h * G + g); },
              [&](int64_t j, int64_t g) { return op + ((t0 + j) * Hq + (h0 + h) * G + g) * D; },
              [&](int64_t p0, bool values) { return (values ? vp : kp) + head_base(p0 / block_size, h); },
              sinks == nullptr ? nullptr : sinks + (h0 + h) * G, prompt_scratch);
        }
        continue;
      }
#endif
      // While one block's head is scored (or summed), the next run in reading order is fetched
      // (PrefetchCursor): keys block by block, then the values from the first block.
      const int64_t first_block = k_begin / block_size, end_block = (k_end + block_size - 1) / block_size;
      for (int64_t blk = first_block; blk < end_block; ++blk) {  // pass 1: every score
        const int64_t p0 = blk * block_size;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t base = head_base(blk, h);
          pf.set(blk + 1 < end_block ? kp + head_base(blk + 1, h) : vp + head_base(first_block, h), run_bytes);
          for (int64_t j = 0; j < nt; ++j) {
            const int64_t n = visible(j, p0);
            if (n == 0) continue;
            float* s = &scores[(j * HG + h * G) * row + p0];
            prim.scores(query(j, h * G), kp + base, n, D, fscale, s, row, G, pf);
            if constexpr (kScaled<KV>) scale_rows(s, G, row, run_scales(kp + base, block_size, D), n);
          }
        }
      }
      for (int64_t j = 0; j < nt; ++j) {  // token j sees keys first_key(j) .. last_len - (nt - 1 - j)
        // scores of its window's first block before the window: read by pass 2, so zeroed
        const int64_t lo = std::max(k_begin, first_key(j)), lo_block = std::max(k_begin, lo / block_size * block_size);
        const int64_t hi = std::min(k_end, last_len - (nt - 1 - j));
        for (int64_t g = 0; g < HG; ++g) {
          float* x = &scores[(j * HG + g) * row];
          if (cap != 0.0f)
            for (int64_t i = lo; i < hi; ++i) x[i] = cap * std::tanh(x[i] / cap);
          sums[j * HG + g] = prim.softmax_numerator(x + lo, hi - lo, &maxes[j * HG + g]);
          std::fill(x + lo_block, x + lo, 0.0f);
        }
      }
      std::fill(acc.begin(), acc.begin() + nt * HG * D, 0.0f);
      for (int64_t blk = first_block; blk < end_block; ++blk) {  // pass 2: the weighted values
        const int64_t p0 = blk * block_size;
        for (int64_t h = 0; h < H; ++h) {
          const int64_t base = head_base(blk, h);
          if (blk + 1 < end_block) pf.set(vp + head_base(blk + 1, h), run_bytes);
          for (int64_t j = 0; j < nt; ++j) {
            const int64_t n = visible(j, p0);
            if (n == 0) continue;
            float* w = &scores[(j * HG + h * G) * row + p0];  // read once, here: scaled in place
            if constexpr (kScaled<KV>) scale_rows(w, G, row, run_scales(vp + base, block_size, D), n);
            prim.accumulate(&acc[(j * HG + h * G) * D], G, w, row, vp + base, n, D, pf);
          }
        }
      }
      if (split) {  // one decode token, all heads: left for the merge below
        std::copy(acc.begin(), acc.begin() + Hq * D, part_acc.begin() + item * Hq * D);
        std::copy(maxes.begin(), maxes.begin() + Hq, part_max.begin() + item * Hq);
        std::copy(sums.begin(), sums.begin() + Hq, part_sum.begin() + item * Hq);
        continue;
      }
      for (int64_t j = 0; j < nt; ++j) {
        float* oh = op + ((t0 + j) * Hq + h0 * G) * D;
        for (int64_t g = 0; g < HG; ++g) {
          const float sink = sinks == nullptr ? 0.0f : std::exp(sinks[h0 * G + g] - maxes[j * HG + g]);
          const float inv = 1.0f / (sums[j * HG + g] + sink);
          for (int64_t d = 0; d < D; ++d) oh[g * D + d] = acc[(j * HG + g) * D + d] * inv;
        }
      }
    }
  });
  if (split) {  // out = sum_p e^(m_p - m) acc_p / (sum_p e^(m_p - m) s_p + e^(sink - m)), m the largest m_p
    for (int64_t item = 0; item < num_items;) {
      const int64_t tile = item_tile[item], parts = tile_parts[tile];
      float* oh = op + tile_start[tile] * Hq * D;
      for (int64_t g = 0; g < Hq; ++g) {
        float m = -std::numeric_limits<float>::infinity(), denom = 0.0f;
        for (int64_t p = item; p < item + parts; ++p) m = std::max(m, part_max[p * Hq + g]);
        if (sinks != nullptr) denom = std::exp(sinks[g] - m);
        std::fill(oh + g * D, oh + (g + 1) * D, 0.0f);
        for (int64_t p = item; p < item + parts; ++p) {
          const float w = std::exp(part_max[p * Hq + g] - m);
          denom += w * part_sum[p * Hq + g];
          for (int64_t d = 0; d < D; ++d) oh[g * D + d] += w * part_acc[(p * Hq + g) * D + d];
        }
        for (int64_t d = 0; d < D; ++d) oh[g * D + d] /= denom;
      }
      item += parts;
    }
  }
  return out;
}

// The pool's element types the kernels read and write.
bool pool_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kChar;
}

}  // namespace

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor query_start,
                           at::Tensor seq_lens, double scale, int64_t window, double softcap,
                           c10::optional<at::Tensor> sinks, c10::optional<at::Tensor> out) {
  TM_CHECK(window >= 0, "paged_attention: window must be 0 (none) or positive");
  TM_CHECK(softcap >= 0, "paged_attention: softcap must be 0 (none) or positive");
  TM_CHECK(!sinks.has_value() || (sinks->dtype() == at::kFloat && sinks->dim() == 1 &&
                                  sinks->size(0) == q.size(1) && sinks->is_contiguous()),
           "paged_attention: sinks must be a contiguous float32 tensor of one logit per query head");
  const float* sink_ptr = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  TM_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == v_cache.dtype() && pool_dtype(k_cache.scalar_type()),
           "paged_attention: float32 queries, a float32, float16, bfloat16 or int8 pool");
  if (k_cache.dtype() == at::kChar)
    return paged_attention_impl<int8_t>(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window,
                                        softcap, sink_ptr, out);
  if (k_cache.dtype() == at::kHalf)
    return paged_attention_impl<at::Half>(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window,
                                          softcap, sink_ptr, out);
  if (k_cache.dtype() == at::kBFloat16)
    return paged_attention_impl<at::BFloat16>(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale,
                                              window, softcap, sink_ptr, out);
  return paged_attention_impl<float>(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window, softcap,
                                     sink_ptr, out);
}

// One row of an int8 pool: scale = max |x| / 127 and codes x / scale rounded to nearest even (all 0
// with scale 0 for a row of zeros). A row with a NaN or infinity gets a NaN scale, so that attention
// over it gives NaN as it does over a float pool, not a silently clipped key.
static void quantize_row(const float* x, int64_t D, int8_t* codes, float* scale) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t d = 0; d < D; ++d) {
    finite = finite && std::isfinite(x[d]);
    amax = std::max(amax, std::fabs(x[d]));
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t d = 0; d < D; ++d)
    codes[d] = finite ? static_cast<int8_t>(std::clamp(std::nearbyint(x[d] * inv), -127.0f, 127.0f)) : 0;
  *scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
}

// Store this step's keys and values: token t goes to block slot_block[t], offset slot_offset[t].
// k, v: (T, Hkv, D) float32 (rows may be strided views of the fused qkv projection); caches as
// above, float32, float16 (rounded to nearest on the way in, saturating at +-65504), bfloat16
// (rounded to nearest even, as torch's conversion does) or int8 (quantize_row).
template <typename KV>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                   const int64_t* blocks, const int64_t* offsets) {
  const int64_t T = k.size(0), num_blocks = k_cache.size(0), Hkv = k_cache.size(1), bs = k_cache.size(2),
                D = k.size(2), W = k_cache.size(3);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  KV* kc = k_cache.data_ptr<KV>();
  KV* vc = v_cache.data_ptr<KV>();
  // float16 saturates at its largest finite value rather than turning into inf (and NaN scores)
  const auto store = [](float x) -> KV {
    if constexpr (std::is_same_v<KV, at::Half>) {
      return static_cast<KV>(std::clamp(x, -65504.0f, 65504.0f));
    } else {
      return static_cast<KV>(x);  // (int8 pools quantize whole rows instead: quantize_row)
    }
  };
  TM_CHECK(!k_cache.is_same(v_cache), "write_kv: the K and V pools must be two tensors");
  for (int64_t t = 0; t < T; ++t)
    TM_CHECK(blocks[t] >= 0 && blocks[t] < num_blocks && offsets[t] >= 0 && offsets[t] < bs,
             "write_kv: slot out of range");
  const auto write = [&](const float* src, int64_t stride, KV* pool) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < Hkv; ++h) {
        const float* x = src + t * stride + h * D;
        KV* run = pool + (blocks[t] * Hkv + h) * bs * W;  // row 0 of this kv head of the block
        if constexpr (kScaled<KV>) {
          float scale;
          quantize_row(x, D, run + offsets[t] * D, &scale);
          std::memcpy(run + bs * D + offsets[t] * kScaleBytes<KV>, &scale, sizeof scale);
        } else {
          for (int64_t d = 0; d < D; ++d) run[offsets[t] * D + d] = store(x[d]);
        }
      }
  };
  // The first write into a page of the pool faults it in, which this virtual machine serves far
  // more slowly than it reads touched memory, and the K and V pools fault at the same blocks: with
  // keys and values on two threads the two faults are taken at once, rather than one after the
  // other while the other thread waits. A few tokens are not worth the fork.
  const auto write_parts = [&](int64_t begin, int64_t end) {  // 0: the keys, 1: the values
    for (int64_t which = begin; which < end; ++which)
      which == 0 ? write(kp, k.stride(0), kc) : write(vp, v.stride(0), vc);
  };
  if (T < kParallelWriteTokens) {
    write_parts(0, 2);
  } else {
    at::parallel_for(0, 2, 1, write_parts);
  }
}

void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_block, at::Tensor slot_offset) {
  TM_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
           "write_kv: heads must be contiguous");
  TM_CHECK(slot_block.dtype() == at::kLong && slot_offset.dtype() == at::kLong, "write_kv: int64 slots");
  TM_CHECK(k.dtype() == at::kFloat && v.dtype() == at::kFloat && k_cache.dtype() == v_cache.dtype() &&
           pool_dtype(k_cache.scalar_type()) && k_cache.is_contiguous() && v_cache.is_contiguous(),
           "write_kv: float32 k/v, contiguous float32, float16, bfloat16 or int8 caches");
  TM_CHECK(k.dim() == 3, "write_kv: k/v shapes disagree with the cache");
  const bool int8_pool = k_cache.dtype() == at::kChar;
  const int64_t T = k.size(0), Hkv = k_cache.size(1), D = k.size(2);
  TM_CHECK(k.size(1) == Hkv && k_cache.size(3) == D + (int8_pool ? kScaleBytes<int8_t> : 0) && v.sizes() == k.sizes() &&
           v_cache.sizes() == k_cache.sizes(), "write_kv: k/v shapes disagree with the cache");
  TM_CHECK(!int8_pool || k_cache.size(2) * D % 4 == 0, "write_kv: an int8 pool's scales must be 4-byte aligned");
  TM_CHECK(slot_block.is_contiguous() && slot_offset.is_contiguous() && slot_block.numel() == T &&
           slot_offset.numel() == T, "write_kv: one contiguous slot per token");
  const int64_t* blocks = slot_block.data_ptr<int64_t>();
  const int64_t* offsets = slot_offset.data_ptr<int64_t>();
  if (int8_pool) {
    write_kv_impl<int8_t>(k, v, k_cache, v_cache, blocks, offsets);
  } else if (k_cache.dtype() == at::kHalf) {
    write_kv_impl<at::Half>(k, v, k_cache, v_cache, blocks, offsets);
  } else if (k_cache.dtype() == at::kBFloat16) {
    write_kv_impl<at::BFloat16>(k, v, k_cache, v_cache, blocks, offsets);
  } else {
    write_kv_impl<float>(k, v, k_cache, v_cache, blocks, offsets);
  }
}
