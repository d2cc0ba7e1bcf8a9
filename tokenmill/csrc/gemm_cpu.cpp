// y = x @ W.T (+ b), float32, for the projections of a transformer layer.
//
// General GEMM libraries block for large square products; at decode sizes oneDNN ran well below
// its rate at M = 512 on this model's matrices, and at M = 1 it left bandwidth unused. This kernel
// keeps W in panels of 16 output features, (ceil(N / 16), K, 16): a panel is one contiguous run
// that streams from memory once per block of rows, and the inner loop (tile_gemm.h) holds a 6 x 16
// tile of y in twelve registers (small steps: up to 12 x 16 where AVX-512VL gives 32 registers),
// loading two vectors of W and broadcasting six scalars of x per k. On the default model's
// matrices it is faster than oneDNN at decode sizes and about even at 512 rows. Panels are split
// across threads (with stealing, parallel.h); rows go in blocks of 512 so that a block of x
// stays in cache while the panels stream past.
//
// From 4 rows up, the passes over one panel also prefetch the next panel (one 64-byte line, a k
// row of it, per k, shared between the passes in proportion to their rows): the first pass would
// otherwise wait on memory while the later ones compute from cache. Over the model's matrices
// streamed from memory that is faster from 4 to 64 rows; at 1 and 2 rows, where a pass is a pure
// stream that the hardware prefetcher already keeps busy, it is slower, so those do without.
//
// Batch-1 decode streams every weight once and is bound by memory. For GGUF weights in Q4_0,
// Q4_1 or Q8_0 (and Q5_0, Q5_1 and the K-quants Q3_K to Q6_K, see Format below) the
// kernel can also read them in their blocks of 32 (a scale, and for some an offset, per 32
// weights of a row), re-laid as panels: per block of 32 k (or super-block of 256, see Format), the
// 16 features' scales, then each k's 16 codes side by side. A tile decodes each k's 16 weights into two registers with exactly
// the arithmetic of gguf's own dequantization (d * q, + m for Q4_1, rounded the same way) and
// runs the same FMAs in the same order as over float32 panels, so the product is bit for bit the
// same while a fifth of the bytes (Q4_1) stream from memory. Each pass (a tile of rows) decodes everything again,
// so from 13 rows a panel is decoded once into a 64-byte aligned buffer that the float32 tiles
// then run over. Over the default model's matrices the blocks take far less time than float32
// panels at 1 row, less by a shrinking margin as the rows grow, and about the same at 512
// (measured: BENCHMARKS.md, "Speed work, every attempt (CPU, default model)").
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "panel_gemm.h"
#include "parallel.h"
#include "tile_gemm.h"

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
constexpr int64_t kRows = 6;    // rows of x per tile
#ifdef TOKENMILL_AVX2
constexpr int64_t kWideRows = tokenmill::kWideTileRows;  // most rows per tile (12 with AVX-512VL, else 6)
#else
constexpr int64_t kWideRows = kRows;
#endif
constexpr int64_t kRowBlock = 512;  // rows of x per pass over the panels (a default prefill chunk)
constexpr int64_t kPrefetchRows = 4;  // prefetch the next panel from this many rows of x up
// Block panels: steps of up to this many rows decode in registers, once per tile; bigger ones
// decode each panel once into a buffer. With tiles of 12, two passes of decoding beat the buffer
// up to 20 rows and were even with it at 24 (measured: BENCHMARKS.md, "Speed work, every attempt
// (CPU, default model)").
constexpr int64_t kDecodeRows = kWideRows > kRows ? 20 : 12;
// Panels go to the threads with stealing (parallel.h): one at a time where a panel is much work
// (more rows than kDecodeRows), else in chunks of a size the stealing picks (0).
constexpr int64_t panel_chunk(int64_t rows) { return rows > kDecodeRows ? 1 : 0; }
// Rows per tile in a block of rows: small steps in the widest tiles, where streaming (or
// decoding) the panels once per tile bounds them, big ones in tiles of 6. The float32 and block
// paths cut alike: a row alone in its tile is summed in another order (tile_gemm.h).
constexpr int64_t tile_rows(int64_t block_rows) { return block_rows <= kDecodeRows ? kWideRows : kRows; }
static_assert(kWideRows <= kDecodeRows, "a block of rows that decodes in registers fits the widest tiles");
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

// Writes a finished tile (rows, 16) of panel p, for rows m0.. of x, into `out`.
void store_tile(const tokenmill::PanelOut& out, const float* tile, int64_t p, int64_t m0, int64_t rows) {
  const int64_t n0 = p * kPanel, width = std::min(kPanel, out.N - n0);
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out.y + (m0 + r) * out.ldy + n0;
    const float* t = tile + r * kPanel;
    if (out.row_scale != nullptr) {
      const float scale = out.row_scale[m0 + r];
      for (int64_t j = 0; j < width; ++j) dst[j] = (t[j] + (out.bias ? out.bias[n0 + j] : 0.0f)) * scale;
    } else {
      for (int64_t j = 0; j < width; ++j) dst[j] = t[j] + (out.bias ? out.bias[n0 + j] : 0.0f);
    }
  }
}

// Rows [0, M) in the fewest passes of at most `most` rows, their sizes differing by one at most
// (a step of 13 rows at most 12: 6 and 7), so that no pass of a row or two re-reads a panel for
// little work: pass(m0, n) for each.
template <typename Pass>
inline void even_passes(int64_t M, int64_t most, Pass pass) {
  const int64_t passes = (M + most - 1) / most;
  for (int64_t i = 0, m0 = 0; i < passes; ++i) {
    const int64_t n = (M - m0) / (passes - i);  // the rows left, shared out over the passes left
    pass(m0, n);
    m0 += n;
  }
}

// Rows [block, block_end) of x (M, K) times float32 panel p, tile by tile; a tile's pass also
// prefetches its share of the next panel from kPrefetchRows rows up.
void float_panel(const float* xp, int64_t block, int64_t block_end, int64_t K, const float* panel, const float* next,
                 float* tile, const tokenmill::PanelOut& out, int64_t p) {
  const int64_t block_rows = block_end - block, per_tile = tile_rows(block_rows);
  const bool prefetch = next != nullptr && block_rows >= kPrefetchRows;
  for (int64_t m0 = block; m0 < block_end; m0 += per_tile) {
    const int64_t rows = std::min(per_tile, block_end - m0);
#ifdef TOKENMILL_AVX2
    // this pass's share of the next panel's K lines
    const int64_t first = K * (m0 - block) / block_rows, last = K * (m0 - block + rows) / block_rows;
    tokenmill::kTiles[rows](xp + m0 * K, K, panel, K, tile, kPanel, prefetch ? next + first * kPanel : panel,
                            prefetch ? last - first : 0);
#else
    tile_scalar(xp + m0 * K, K, panel, K, tile, rows);
#endif
    store_tile(out, tile, p, m0, rows);
  }
}

// Weight formats of panel_linear: float32 panels, or one of GGUF's block formats. The K-quants
// are re-cut at load (recut_k_quant below) into codes the tiles decode with one instruction or
// two, their scales such that the kernel's float32 arithmetic gives gguf's values:
//   Q4F  Q4_K in its super-blocks of 256 k: fp16 d and dmin, per block of 32 an 8-bit scale sc
//        and min m, Q4_1's nibbles; a block's scale is d * sc and its offset -(dmin * m), made
//        per block in the tile (both products exact in float32, as gguf's own)
//   Q5K  Q5_K the same way, with a byte per 5-bit code
//   Q5F  blocks of 32 with a float32 scale and offset and a byte per 5-bit code (Q5_0 and Q5_1,
//        re-cut in loader.py)
//   Q6F  super-blocks of 256: fp16 d, an int8 scale sc per 16 k, a signed byte per code (Q6_K's
//        q - 32; Q3_K's q - 4, re-cut in loader.py), or in the 512-bit builds 6 bits a code
//        (six_bit_codes); scale d * sc
//   MXF  MXFP4 (gpt-oss's experts) as GGUF stores it: per block of 32 an E8M0 scale byte e and
//        Q4_0's nibbles, each an FP4 E2M1 code; value FP4(q) * 2^(e - 127), exact in float32
// The super-block formats keep a panel's 16 scales per super-block in a header before its
// codes: 0.58 bytes a weight for Q4F with a byte per scale and min (the file's 0.5625; in 6 bits,
// 0.5625 too), 1.08 for Q5K (0.69) and 1.07 for Q6F with a byte per code (0.82; in 6 bits, 0.82
// too), where float32 scales for every block of 32 took 0.75, 1.25 and 1.25.
// BF16 (9) is no block format: bfloat16 panels of a float checkpoint (see bf16_tile below).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TOKENMILL_VNNI_512 1
constexpr bool kVnni512 = true;  // the 8-bit tiles are int8_tile_512's (below)
#else
constexpr bool kVnni512 = false;
#endif
// VBMI's byte permute and multishift (Zen 4, Ice Lake and later; Cascade Lake has 512-bit VNNI
// without them): Q4F's scales in 6 bits (six_bit_scales), and byte transposes in one instruction.
#if defined(TOKENMILL_VNNI_512) && defined(__AVX512VBMI__)
#define TOKENMILL_VBMI 1
constexpr bool kVbmi = true;
#else
constexpr bool kVbmi = false;
#endif
enum Format : int64_t {
  kFloat32 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ8_0 = 3, kQ4F = 4, kQ5F = 5, kQ6F = 6, kQ5K = 7, kMXF = 8, kBF16 = 9
};
constexpr int64_t kLastBlockFormat = kMXF;
constexpr bool block_format(int64_t f) { return f >= kQ4_0 && f <= kLastBlockFormat; }
constexpr int64_t kBlock = 32;  // weights per GGUF block
constexpr int64_t kSuper = 8;   // blocks per super-block (Q4F, Q6F)

constexpr bool super_blocks(int64_t f) { return f == kQ4F || f == kQ6F || f == kQ5K; }
constexpr bool byte_codes(int64_t f) { return f == kQ8_0 || f == kQ5F || f == kQ6F || f == kQ5K; }
constexpr bool has_offset(int64_t f) { return f == kQ4_1 || f == kQ4F || f == kQ5F || f == kQ5K; }  // v = d * q + m
constexpr bool unsigned_bytes(int64_t f) { return f == kQ5F || f == kQ5K; }  // byte codes 0..31, not int8

// A panel is stored in units of 32 k (a block) or of 256 k (a super-block): blocks per unit.
constexpr int64_t unit_blocks(int64_t f) { return super_blocks(f) ? kSuper : 1; }
constexpr int64_t unit_k(int64_t f) { return kBlock * unit_blocks(f); }

// One unit across a panel's 16 features. A block: its scales (and offsets; fp16, or float32 for
// Q5F), then its codes (32 k x 8 bytes of two nibbles, or 32 k x 16 bytes). A super-block: a
// header (fp16 d, for Q4F fp16 dmin, then per block the 16 8-bit scales and for Q4F the 16 mins,
// or for Q6F per 16 k the 16 int8 scales), then its 8 blocks' codes.
constexpr int64_t scale_bytes(int64_t format) { return (format == kQ5F ? 4 : format == kMXF ? 1 : 2) * kPanel; }
constexpr int64_t offset_bytes(int64_t format) {  // a block's own offsets (Q4_1, Q5F)
  return has_offset(format) && !super_blocks(format) ? scale_bytes(format) : 0;
}
// Q6F's codes where the 512-bit tile runs: 6 bits each, laid out for it (put_codes), 0.82
// bytes a weight with the header as in the file, where a byte per code took 1.07. A batch-1 step
// streams its weights, and Q6_K is a quarter to a third of a Q4_K_M file's (the head, half of
// ffn_down, attn_v).
constexpr bool six_bit_codes(int64_t format) { return format == kQ6F && kVnni512; }
// Q4_0's, Q4_1's and Q4_K's nibbles where the 512-bit tile runs: laid out for it too (put_codes),
// so that a mask, or a shift and a mask, give vpdpbusd four k's (feature, four k) dwords. MXFP4's
// stay as the float32 path, its only one, reads them.
constexpr bool quad_nibbles(int64_t format) {
  return kVnni512 && (format == kQ4_0 || format == kQ4_1 || format == kQ4F);
}
// Codes laid out for the 512-bit tile, which the float32 path unpacks block by block (row_codes).
constexpr bool tile_layout(int64_t format) { return six_bit_codes(format) || quad_nibbles(format); }
constexpr int64_t code_bytes(int64_t format) {
  return six_bit_codes(format) ? kBlock * kPanel * 3 / 4 : byte_codes(format) ? kBlock * kPanel : kBlock * kPanel / 2;
}
// The bytes of an octet (8 k) of a block laid out for the 512-bit tile (tile_layout): a quarter of its codes.
constexpr int64_t octet_bytes(int64_t format) { return code_bytes(format) / (kBlock / 8); }
// Q4F's scales and mins where the 512-bit tile runs with VBMI: 6 bits each, as in the file
// (six_bit_scales_of unpacks them with VBMI's multishift), 0.5625 bytes a weight where a byte each
// took 0.58. A Q4_K_M file is mostly Q4_K, and a batch-1 step streams it.
constexpr bool six_bit_scales(int64_t format) { return format == kQ4F && kVbmi; }
constexpr int64_t kSixBitScaleBytes = 2 * kPanel * 6 / 8;  // a block's 16 scales and 16 mins in 6 bits
// A super-block's header: the 16 features' fp16 d, for Q4F and Q5K their fp16 dmin, then its
// 8-bit scales (Q4F, Q5K: a block's 16, block by block, then its 16 mins the same way, or where
// six_bit_scales, per block its 16 scales and 16 mins in 24 bytes, features 0-7's scales in bits
// 0-47, 8-15's in 48-95, then the mins so; Q6F: per 16 k, 16 int8 scales).
constexpr int64_t kDminAt = 2 * kPanel;
constexpr int64_t super_scales_at(int64_t format) { return format == kQ6F ? 2 * kPanel : 4 * kPanel; }
constexpr int64_t codes_at(int64_t format) {  // where a panel unit's codes start
  if (six_bit_scales(format)) return super_scales_at(format) + kSuper * kSixBitScaleBytes;
  if (super_blocks(format)) return super_scales_at(format) + 2 * kSuper * kPanel;
  return scale_bytes(format) + offset_bytes(format);
}
constexpr int64_t unit_bytes(int64_t format) { return codes_at(format) + unit_blocks(format) * code_bytes(format); }
// A unit of Q6F's 6-bit codes spread out for the passes of a big step (spread_six_bits).
constexpr int64_t kSpreadUnitBytes = codes_at(kQ6F) + kSuper * kBlock * kPanel;

// One row's unit, as given to pack_block_panels, holds what a panel unit holds for 16 rows, in the
// same order: a sixteenth of its bytes (Q6F's codes and Q4F's scales a byte each even where its
// panels pack them in 6 bits), its codes at a sixteenth of the offset. That is the GGUF file's
// block for Q4_0, Q4_1 and Q8_0; Q5F's two float32 (scale, offset) and 32 codes; Q4F's fp16 d and
// dmin, 8 scales, 8 mins and 128 bytes of nibbles (Q5K: 256 bytes of codes); Q6F's fp16 d, 16
// int8 scales and 256 codes.
constexpr int64_t row_codes_at(int64_t format) {
  return (super_blocks(format) ? super_scales_at(format) + 2 * kSuper * kPanel : codes_at(format)) / kPanel;
}
constexpr int64_t row_block_codes(int64_t format) { return byte_codes(format) ? kBlock : kBlock / 2; }  // per block
constexpr int64_t row_unit_bytes(int64_t format) {
  return row_codes_at(format) + unit_blocks(format) * row_block_codes(format);
}
static_assert(row_unit_bytes(kQ4_0) == 18 && row_unit_bytes(kQ4_1) == 20 && row_unit_bytes(kQ8_0) == 34 &&
                  row_unit_bytes(kQ5F) == 40 && row_unit_bytes(kQ4F) == 2 + 2 + 8 + 8 + 128 &&
                  row_unit_bytes(kQ5K) == 2 + 2 + 8 + 8 + 256 && row_unit_bytes(kQ6F) == 2 + 16 + 256 &&
                  row_unit_bytes(kMXF) == 17,
              "a row's unit is a sixteenth of a panel's: GGUF's block sizes, and the re-cut rows'");
// What a block of 32 k takes of a panel, on average over its unit: a tile's first pass prefetches
// that much of the next panel per block, the whole panel over its blocks.
constexpr int64_t block_span(int64_t format) { return unit_bytes(format) / unit_blocks(format); }

#ifdef TOKENMILL_AVX2
// v = d * q (+ m), as gguf's numpy dequantization computes it: the product rounded, then the
// offset added. The product is exact in float32 (d has at most 17 significant bits: an fp16, or
// the fp16 d of a K-quant times its 6-bit scale; q at most 5), so that rounding changes nothing
// and one FMA gives the same value (tested bit for bit) for an instruction less. Q4_0, Q8_0 and
// Q6F have no offset: a plain multiply, as in gguf.
template <int64_t F>
inline __m256 decode8(__m256i q, __m256 d, __m256 m) {
  if constexpr (has_offset(F)) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
  }
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
}

using tokenmill::row_fma;

// A block's scales (d) and offsets (m) for the 16 features of a panel; for Q6F, m holds the
// scales of the block's second 16 k.
struct BlockScales {
  __m256 d0, d1, m0, m1;
};

inline __m256 halves8(const uint8_t* p) {  // 8 fp16 -> float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <bool Signed>
inline __m256 bytes8(const uint8_t* p) {  // 8 int8 or uint8 -> float32
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// A block's scales from the unit it begins (Q4_0, Q4_1, Q8_0, Q5F).
template <int64_t F>
inline BlockScales block_scales(const uint8_t* blk) {
  BlockScales s;
  if constexpr (F == kQ5F) {
    const float* f = reinterpret_cast<const float*>(blk);
    s.d0 = _mm256_loadu_ps(f), s.d1 = _mm256_loadu_ps(f + 8), s.m0 = _mm256_loadu_ps(f + 16), s.m1 = _mm256_loadu_ps(f + 24);
    return s;
  }
  if constexpr (F == kMXF) {  // e << 23 is the float 2^(e - 127) (e = 0, a zero block in practice, gives 0)
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    s.d0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(e), 23));
    s.d1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(e, 8)), 23));
    s.m0 = s.m1 = _mm256_setzero_ps();
    return s;
  }
  s.d0 = halves8(blk), s.d1 = halves8(blk + 16);
  s.m0 = s.m1 = _mm256_setzero_ps();
  if constexpr (F == kQ4_1) s.m0 = halves8(blk + 32), s.m1 = halves8(blk + 48);
  return s;
}

#ifdef TOKENMILL_VBMI
// vpermb's indexes that put each 6 bytes of a block's 6-bit scales (six_bit_scales) in a qword of
// their own, and the bit offsets of its 8 values there for vpmultishiftqb.
constexpr std::array<uint8_t, 64> six_bit_scales_index() {
  std::array<uint8_t, 64> index{};
  for (int q = 0; q < 8; ++q)
    for (int b = 0; b < 8; ++b) index[8 * q + b] = static_cast<uint8_t>(6 * (q % 4) + std::min(b, 5));
  return index;
}
alignas(64) constexpr std::array<uint8_t, 64> kSixBitScalesIndex = six_bit_scales_index();
constexpr uint64_t kSixBitShifts = 0x2A241E18120C0600ull;  // bytes 0, 6, 12, ..., 42

// A block's 24 bytes of 6-bit scales and mins -> bytes 0-15 its 16 features' scales, 16-31 their
// mins (reads 8 bytes past them: the header's next block, or the unit's codes).
inline __m256i six_bit_scales_of(const uint8_t* p) {
  const __m512i bytes = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i spread = _mm512_permutexvar_epi8(_mm512_load_si512(kSixBitScalesIndex.data()), bytes);
  const __m512i values = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(static_cast<int64_t>(kSixBitShifts)), spread);
  return _mm256_and_si256(_mm512_castsi512_si256(values), _mm256_set1_epi8(63));
}
#endif

// Block j's scales from its super-block's header (Q4F, Q6F): d * sc and -(dmin * m), or Q6F's
// d * sc of its two halves, the products gguf's dequantization makes (exact in float32: fp16 d
// has 11 significant bits, sc and m at most 8).
template <int64_t F>
inline BlockScales super_block_scales(const uint8_t* unit, int64_t j) {
  const __m256 d0 = halves8(unit), d1 = halves8(unit + 16);
  BlockScales s;
#ifdef TOKENMILL_VBMI
  if constexpr (six_bit_scales(F)) {
    const __m256i both = six_bit_scales_of(unit + super_scales_at(F) + j * kSixBitScaleBytes);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(both)));
    const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(both, 1)));
    const __m512 d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit))), sc);
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + kDminAt)));
    const __m512 m = _mm512_xor_ps(_mm512_mul_ps(dmin, mn), _mm512_set1_ps(-0.0f));
    s.d0 = _mm512_castps512_ps256(d), s.d1 = _mm512_extractf32x8_ps(d, 1);
    s.m0 = _mm512_castps512_ps256(m), s.m1 = _mm512_extractf32x8_ps(m, 1);
    return s;
  }
#endif
  if constexpr (F == kQ4F || F == kQ5K) {
    const uint8_t *sc = unit + super_scales_at(F) + j * kPanel, *m = sc + kSuper * kPanel;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    s.d0 = _mm256_mul_ps(d0, bytes8<false>(sc)), s.d1 = _mm256_mul_ps(d1, bytes8<false>(sc + 8));
    s.m0 = _mm256_xor_ps(_mm256_mul_ps(halves8(unit + kDminAt), bytes8<false>(m)), sign);
    s.m1 = _mm256_xor_ps(_mm256_mul_ps(halves8(unit + kDminAt + 16), bytes8<false>(m + 8)), sign);
  } else {
    const uint8_t* sc = unit + super_scales_at(F) + 2 * j * kPanel;
    s.d0 = _mm256_mul_ps(d0, bytes8<true>(sc)), s.d1 = _mm256_mul_ps(d1, bytes8<true>(sc + 8));
    s.m0 = _mm256_mul_ps(d0, bytes8<true>(sc + kPanel)), s.m1 = _mm256_mul_ps(d1, bytes8<true>(sc + kPanel + 8));
  }
  return s;
}

// Block b (of 32 k) of a panel: its codes, and its scales.
template <int64_t F>
inline const uint8_t* codes_of(const uint8_t* panel, int64_t b) {
  return panel + b / unit_blocks(F) * unit_bytes(F) + codes_at(F) + b % unit_blocks(F) * code_bytes(F);
}
template <int64_t F>
inline BlockScales scales_of(const uint8_t* panel, int64_t b) {
  if constexpr (super_blocks(F)) return super_block_scales<F>(panel + b / kSuper * unit_bytes(F), b % kSuper);
  return block_scales<F>(panel + b * unit_bytes(F));
}

// Q6F's scales for k 16-31 are in the offsets' slot: from there on, they are the scales.
template <int64_t F>
inline void next_half(BlockScales& s) {
  if constexpr (F == kQ6F) s.d0 = s.m0, s.d1 = s.m1;
}

// Eight FP4 E2M1 codes (int32 lanes, 0..15) -> their values: the magnitude by the code's low three
// bits, the sign from its fourth.
inline __m256 fp4_values(__m256i q) {
  const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f), q);
  return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(q, 3), 31)));
}

#ifdef TOKENMILL_VNNI_512
// Q6F's codes in 6 bits (six_bit_codes): a block's 32 k in four octets of 8 k, 96 bytes each,
// laid out so that five instructions give the 512-bit tile the 16 features' (four k) dwords of
// codes q (0..63, Q6_K's own: the value is d * sc * (q - 32)) for both halves of an octet (its k
// 0-3 and 4-7), byte 4f + j of a half's dwords being feature f's k j of that half:
//   bytes 0-63: byte b holds the first half's code b in bits 0-5 (masked, they are its dwords)
//     and the low two bits of the second half's code b in bits 6-7;
//   bytes 64-95: byte s holds the high four bits of the second half's codes s (bits 0-3) and
//     s + 32 (bits 4-7), copied into both 32-byte lanes and rotated by a lane's amount into
//     bits 2-5 of each byte, beside bits 6-7 of bytes 0-63 shifted down into bits 0-1.

// Octet o of a block's 6-bit codes -> the 16 features' (four k) dwords of its two halves.
inline void six_bit_quads(const uint8_t* codes, int64_t o, __m512i& first, __m512i& second) {
  const uint8_t* octet = codes + o * octet_bytes(kQ6F);
  const __m512i low = _mm512_loadu_si512(octet), six = _mm512_set1_epi8(0x3F);
  const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(octet + 64)));
  const __m512i high4 = _mm512_rolv_epi64(high, _mm512_setr_epi64(2, 2, 2, 2, 62, 62, 62, 62));  // into bits 2-5
  constexpr int kBits01OrElse = 0xE4;  // vpternlogd's table for (a & c) | (b & ~c)
  first = _mm512_and_si512(low, six);
  second = _mm512_and_si512(
      _mm512_ternarylogic_epi32(_mm512_srli_epi16(low, 6), high4, _mm512_set1_epi8(0x03), kBits01OrElse), six);
}

// Octet o (8 k, 64 bytes) of a block's quad_nibbles codes -> the 16 features' (four k) dwords of
// its two halves: byte 4f + j holds feature f's k j in its low nibble and its k 4 + j in its high one.
inline void nibble_quads(const uint8_t* codes, int64_t o, __m512i& first, __m512i& second) {
  const __m512i c = _mm512_loadu_si512(codes + o * octet_bytes(kQ4_0)), nibble = _mm512_set1_epi8(0x0F);
  first = _mm512_and_si512(c, nibble);
  second = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
}

// Between four k rows of 16 byte codes (feature f of k row j at byte 16j + f) and the 16
// features' (four k) dwords (at byte 4f + j). With VBMI one vpermb; without, the transpose of 4 x 4
// dwords across the 128-bit lanes (lane L then holds k rows 0-3 of features 4L to 4L + 3, or back)
// and the transpose of 4 x 4 bytes within each lane, in the order that inverts the other.
#ifdef TOKENMILL_VBMI
constexpr std::array<uint8_t, 64> quads_index(bool to_rows) {
  std::array<uint8_t, 64> index{};
  for (int f = 0; f < 16; ++f)
    for (int j = 0; j < 4; ++j) {
      const int row_byte = 16 * j + f, quad_byte = 4 * f + j;
      index[to_rows ? row_byte : quad_byte] = static_cast<uint8_t>(to_rows ? quad_byte : row_byte);
    }
  return index;
}
alignas(64) constexpr std::array<uint8_t, 64> kByteQuads = quads_index(false);
alignas(64) constexpr std::array<uint8_t, 64> kQuadRows = quads_index(true);
#endif
template <bool ToRows>
inline __m512i transpose_quads(__m512i v) {
#ifdef TOKENMILL_VBMI
  return _mm512_permutexvar_epi8(_mm512_load_si512((ToRows ? kQuadRows : kByteQuads).data()), v);
#else
  const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  if constexpr (ToRows) return _mm512_permutexvar_epi32(dwords, _mm512_shuffle_epi8(v, bytes));
  return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, v), bytes);
#endif
}

// A block's quad_nibbles codes -> the nibble rows the other builds keep (k by k, feature j in byte
// j's low nibble, j + 8 in its high one): what decode_row reads.
inline void unpack_quad_nibbles(const uint8_t* codes, uint8_t* bytes) {
  const __m512i qwords = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);  // each lane's low half first
  for (int64_t o = 0; o < kBlock / 8; ++o) {
    __m512i halves[2];
    nibble_quads(codes, o, halves[0], halves[1]);
    for (int h = 0; h < 2; ++h) {
      // four k rows of 16 codes; codes are at most 15, so a 16-bit shift by four moves each byte's alone
      const __m512i rows = transpose_quads<true>(halves[h]);
      const __m512i packed = _mm512_or_si512(rows, _mm512_slli_epi16(_mm512_bsrli_epi128(rows, 8), 4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bytes + (8 * o + 4 * h) * kPanel / 2),
                          _mm512_castsi512_si256(_mm512_permutexvar_epi64(qwords, packed)));
    }
  }
}

// A block's 6-bit codes -> a signed byte (q - 32) per code, k by k, as the other builds keep them:
// what decode_row reads, so that the float32 path gives the same bits in every build.
inline void unpack_six_bits(const uint8_t* codes, uint8_t* bytes) {
  const __m512i bias = _mm512_set1_epi8(32);
  for (int64_t o = 0; o < kBlock / 8; ++o) {
    __m512i first, second;
    six_bit_quads(codes, o, first, second);
    _mm512_storeu_si512(bytes + 8 * o * kPanel, _mm512_sub_epi8(transpose_quads<true>(first), bias));
    _mm512_storeu_si512(bytes + (8 * o + 4) * kPanel, _mm512_sub_epi8(transpose_quads<true>(second), bias));
  }
}
#endif

// Block b's codes as decode_row reads them: in the panel, or codes in the 512-bit tile's layout
// (tile_layout) unpacked into `bytes` (room for kBlock * kPanel).
template <int64_t F>
inline const uint8_t* row_codes(const uint8_t* panel, int64_t b, uint8_t* bytes) {
#ifdef TOKENMILL_VNNI_512
  if constexpr (six_bit_codes(F)) {
    unpack_six_bits(codes_of<F>(panel, b), bytes);
    return bytes;
  } else if constexpr (quad_nibbles(F)) {
    unpack_quad_nibbles(codes_of<F>(panel, b), bytes);
    return bytes;
  }
#endif
  return codes_of<F>(panel, b);
}

// The 16 weights of code row i of a block -> (w0, w1).
template <int64_t F>
inline void decode_row(const uint8_t* codes, int64_t i, const BlockScales& s, __m256& w0, __m256& w1) {
  __m256i q0, q1;
  if constexpr (F == kQ8_0 || F == kQ6F) {
    q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i * kPanel)));
    q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i * kPanel + 8)));
  } else if constexpr (unsigned_bytes(F)) {
    q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i * kPanel)));
    q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i * kPanel + 8)));
  } else {  // byte j: feature j in the low nibble, feature j + 8 in the high one
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i * kPanel / 2)));
    q0 = _mm256_and_si256(c, _mm256_set1_epi32(0x0F));
    q1 = _mm256_srli_epi32(c, 4);
    if constexpr (F == kQ4_0) {
      q0 = _mm256_sub_epi32(q0, _mm256_set1_epi32(8));
      q1 = _mm256_sub_epi32(q1, _mm256_set1_epi32(8));
    }
  }
  if constexpr (F == kMXF) {  // FP4 (q & 7 its magnitude's index, bit 3 its sign) times the scale
    w0 = _mm256_mul_ps(s.d0, fp4_values(q0));
    w1 = _mm256_mul_ps(s.d1, fp4_values(q1));
    return;
  }
  w0 = decode8<F>(q0, s.d0, s.m0);
  w1 = decode8<F>(q1, s.d1, s.m1);
}

// A tile prefetches the panel it will likely run next while it runs this one. In a step of at most
// kStreamRows rows, which reads each panel `once` and does little work per byte, non-temporally on
// an AMD CPU (lines so marked are meant to leave without a place in the outer levels): the weights
// stream faster (on a Zen 4, one- to three-row products over Q4_K panels that do not fit in the
// caches). Otherwise into every level, as steps with more work per byte need (there the same change
// made four and eight rows slower: presumably gone again before their use), as later passes over
// the panel re-read it, and as an Intel CPU needs at every row count (on a Cascade Lake the hint
// made one- and two-row Q4_1 and Q4_K products, and batch-1 and batch-2 decode steps, slower).
constexpr int64_t kStreamRows = 2;

bool amd_cpu() {
  static const bool amd = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    char vendor[13] = {};
    __get_cpuid(0, &eax, &ebx, &ecx, &edx);
    std::memcpy(vendor, &ebx, 4), std::memcpy(vendor + 4, &edx, 4), std::memcpy(vendor + 8, &ecx, 4);
    return std::strcmp(vendor, "AuthenticAMD") == 0;
  }();
  return amd;
}

// Whether a step of M rows prefetches its panels non-temporally (see above).
inline bool streams_once(int64_t M) { return M <= kStreamRows && amd_cpu(); }

inline void prefetch_block(const uint8_t* pf, int64_t bytes, bool once) {
  const char* p = reinterpret_cast<const char*>(pf);
  if (once) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(p + line, _MM_HINT_NTA);
  } else {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
  }
}

// Up to 6 rows of x (12 with AVX-512VL) times a whole panel of blocks, decoding into registers: the tile of
// tile_gemm.h with its sums in its order, without a decoded buffer to write and read back.
template <int64_t F, int R>
void block_tile(const float* x, int64_t ldx, const uint8_t* src, int64_t num_blocks, float* out, const uint8_t* pf,
                bool once) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
  __m256 a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  __m256 a12 = a0, a13 = a0, a14 = a0, a15 = a0, a16 = a0, a17 = a0;
  __m256 a18 = a0, a19 = a0, a20 = a0, a21 = a0, a22 = a0, a23 = a0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (pf != nullptr) prefetch_block(pf + b * block_span(F), block_span(F), once);
    BlockScales s = scales_of<F>(src, b);
    alignas(64) uint8_t unpacked[tile_layout(F) ? kBlock * kPanel : 1];
    const uint8_t* codes = row_codes<F>(src, b, unpacked);
    const float* xb = x + b * kBlock;
    for (int64_t i = 0; i < kBlock; i += 2) {
      if (i == kBlock / 2) next_half<F>(s);
      __m256 w0, w1, w2, w3;
      decode_row<F>(codes, i, s, w0, w1);
      decode_row<F>(codes, i + 1, s, w2, w3);
      if constexpr (R == 1) {  // the one-row tile's four chains: even k in a0/a1, odd k in a2/a3
        row_fma(xb + i, w0, w1, a0, a1);
        row_fma(xb + i + 1, w2, w3, a2, a3);
      } else {
        for (int64_t j = 0; j < 2; ++j) {
          const __m256 lo = j ? w2 : w0, hi = j ? w3 : w1;
          const float* xk = xb + i + j;
          row_fma(xk, lo, hi, a0, a1);
          row_fma(xk + ldx, lo, hi, a2, a3);
          if constexpr (R > 2) row_fma(xk + 2 * ldx, lo, hi, a4, a5);
          if constexpr (R > 3) row_fma(xk + 3 * ldx, lo, hi, a6, a7);
          if constexpr (R > 4) row_fma(xk + 4 * ldx, lo, hi, a8, a9);
          if constexpr (R > 5) row_fma(xk + 5 * ldx, lo, hi, a10, a11);
          if constexpr (R > 6) row_fma(xk + 6 * ldx, lo, hi, a12, a13);
          if constexpr (R > 7) row_fma(xk + 7 * ldx, lo, hi, a14, a15);
          if constexpr (R > 8) row_fma(xk + 8 * ldx, lo, hi, a16, a17);
          if constexpr (R > 9) row_fma(xk + 9 * ldx, lo, hi, a18, a19);
          if constexpr (R > 10) row_fma(xk + 10 * ldx, lo, hi, a20, a21);
          if constexpr (R > 11) row_fma(xk + 11 * ldx, lo, hi, a22, a23);
        }
      }
    }
  }
  if constexpr (R == 1) {
    a0 = _mm256_add_ps(a0, a2);
    a1 = _mm256_add_ps(a1, a3);
  }
  const __m256 acc[24] = {a0,  a1,  a2,  a3,  a4,  a5,  a6,  a7,  a8,  a9,  a10, a11,
                          a12, a13, a14, a15, a16, a17, a18, a19, a20, a21, a22, a23};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel, acc[2 * r]);
    _mm256_storeu_ps(out + r * kPanel + 8, acc[2 * r + 1]);
  }
}

// A whole panel of blocks -> float32 (K, 16) in `out`, for the float32 path's tiles to run over
// when there are too many rows to decode once per tile; prefetches the next panel (pf) meanwhile.
template <int64_t F>
void decode_panel(const uint8_t* src, int64_t num_blocks, float* out, const uint8_t* pf) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (pf != nullptr) prefetch_block(pf + b * block_span(F), block_span(F), false);
    BlockScales s = scales_of<F>(src, b);
    alignas(64) uint8_t unpacked[tile_layout(F) ? kBlock * kPanel : 1];
    const uint8_t* codes = row_codes<F>(src, b, unpacked);
    for (int64_t i = 0; i < kBlock; ++i) {
      if (i == kBlock / 2) next_half<F>(s);
      __m256 w0, w1;
      decode_row<F>(codes, i, s, w0, w1);
      _mm256_storeu_ps(out + (b * kBlock + i) * kPanel, w0);
      _mm256_storeu_ps(out + (b * kBlock + i) * kPanel + 8, w1);
    }
  }
}

using DecodeFn = void (*)(const uint8_t*, int64_t, float*, const uint8_t*);
constexpr DecodeFn kDecoders[kLastBlockFormat + 1] = {nullptr,           decode_panel<kQ4_0>, decode_panel<kQ4_1>,
                                                      decode_panel<kQ8_0>, decode_panel<kQ4F>,  decode_panel<kQ5F>,
                                                      decode_panel<kQ6F>,  decode_panel<kQ5K>, decode_panel<kMXF>};

using BlockTileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, float*, const uint8_t*, bool);
template <int64_t F>
#ifdef __AVX512VL__
constexpr BlockTileFn kBlockTilesOf[kWideRows + 1] = {
    nullptr,          block_tile<F, 1>, block_tile<F, 2>, block_tile<F, 3>,  block_tile<F, 4>,
    block_tile<F, 5>, block_tile<F, 6>, block_tile<F, 7>, block_tile<F, 8>,  block_tile<F, 9>,
    block_tile<F, 10>, block_tile<F, 11>, block_tile<F, 12>};
#else
constexpr BlockTileFn kBlockTilesOf[kRows + 1] = {nullptr,           block_tile<F, 1>, block_tile<F, 2>, block_tile<F, 3>,
                                                  block_tile<F, 4>, block_tile<F, 5>, block_tile<F, 6>};
#endif
constexpr const BlockTileFn* kBlockTiles[kLastBlockFormat + 1] = {
    nullptr, kBlockTilesOf<kQ4_0>, kBlockTilesOf<kQ4_1>, kBlockTilesOf<kQ8_0>, kBlockTilesOf<kQ4F>, kBlockTilesOf<kQ5F>,
    kBlockTilesOf<kQ6F>, kBlockTilesOf<kQ5K>, kBlockTilesOf<kMXF>};

// x (M, K) times panel p of blocks (at src). The first block of rows with more than kDecodeRows
// rows decodes the panel once into the scratch buffer that the float32 path's tiles run over,
// for it and every block after it; until then (small decode steps: one or two passes) each
// tile of rows decodes the panel anew into registers. Either way each row's sum is the float32
// panels' own. `next` (or nullptr) is prefetched by the first pass.
void block_panel(const float* xp, int64_t M, int64_t K, const uint8_t* src, const uint8_t* next, int64_t format,
                 int64_t p, tokenmill::PanelScratch& scratch, const tokenmill::PanelOut& out) {
  bool buffered = false;  // the panel decoded into the buffer (once, for every block of rows)
  // tiles restart at every kRowBlock rows, as in the float32 path: a one-row tile sums in
  // another order than a row of a bigger tile, so both paths must cut the rows alike
  for (int64_t block = 0; block < M; block += kRowBlock) {
    const int64_t block_end = std::min(M, block + kRowBlock);
    if (!buffered && block_end - block > kDecodeRows) {
      kDecoders[format](src, K / kBlock, scratch.decoded(), next);
      buffered = true;
    }
    const int64_t per_tile = tile_rows(block_end - block);
    for (int64_t m0 = block; m0 < block_end; m0 += per_tile) {
      const int64_t rows = std::min(per_tile, block_end - m0);
      if (buffered) {
        tokenmill::kTiles[rows](xp + m0 * K, K, scratch.decoded(), K, scratch.tile, kPanel, nullptr, 0);
      } else {
        kBlockTiles[format][rows](xp + m0 * K, K, src, K / kBlock, scratch.tile, m0 == 0 ? next : nullptr,
                                  streams_once(M));
      }
      store_tile(out, scratch.tile, p, m0, rows);
    }
  }
}

// ---- Small steps with x in 8-bit blocks ------------------------------------------------------
//
// Decoding every weight to float32 costs ten to twelve instructions per 16 weights, which made
// the batch-1 step bound by that work, not by memory (well over the time its blocks take to stream).
// As llama.cpp does, rows of x can instead be quantized to 8 bits per block of 32 k (a float32
// scale per block: max |x| / 127) so that the sums over a block are integer multiply-adds of the
// codes as they are, with the block's scales applied once: y += d * dx * sum(q * xq) (+ m * dx *
// sum(xq) for formats with an offset). The codes' own rounding (4 to 8 bits) is far coarser than x's;
// on the default model, decoding this way raises perplexity well within issue 28's 2% bound
// (BENCHMARKS.md, "The defaults' perplexity over 4,800 tokens on a Cascade Lake").
// Used for steps of up to `int8_rows` rows (panel_linear), up to kInt8Rows rows per pass.
// With vpmaddubsw (AVX2) the layers of the default model were faster than decoding the blocks to
// float32 at 1 to 8 rows, but slower at 64 and 512; with VNNI's vpdpbusd they are faster at every
// step size (the loader's default there: models/cpu_packing.py).

using tokenmill::Int8Pass;  // a pass's rows of x in 8-bit blocks, interleaved (panel_gemm.h)
using tokenmill::Int8Row;   // one row of x in 8-bit blocks (panel_gemm.h)

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

using tokenmill::kVnni;
#ifdef TOKENMILL_VNNI
using tokenmill::dpbusd;
#endif

// With 512-bit VNNI every format takes int8_tile_512 (kVnni512), which reads x as bytes (and, for
// Q6F, its sums per 16 k); byte codes elsewhere take vpmaddwd's tile, which reads x widened to
// int16 pairs.
constexpr bool reads_words(int64_t format) { return byte_codes(format) && !kVnni512; }
constexpr bool reads_half_sums(int64_t format) { return format == kQ6F && kVnni512; }

// A block of 32 k of x in 8 bits: xq = round(x / dx) (to nearest even), dx = max |x| / 127 (0 for
// a block of zeros, NaN where x has one), the bytes in k order, sum(xq) and its first 16 k's part.
// The offsets' sum is quantized x's too (dx * sum(xq)): the product is then exactly that of the
// dequantized weights with quantized x (with x's own sum, Q4_1's error tripled).
struct QuantizedBlock {
  __m256i bytes;
  float d;
  int32_t qsum, first_half;
};

inline QuantizedBlock quantize_block(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane interleave
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps(), nan = amax;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  QuantizedBlock out;
  out.d = _mm_cvtss_f32(m4) / 127.0f;
  const float id = out.d != 0.0f ? 1.0f / out.d : 0.0f;
  if (_mm256_movemask_ps(nan) != 0) out.d = std::numeric_limits<float>::quiet_NaN();  // NaN in, NaN out
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));  // rounds to even
  out.first_half = hsum_epi32(_mm256_add_epi32(q[0], q[1]));
  out.qsum = out.first_half + hsum_epi32(_mm256_add_epi32(q[2], q[3]));
  out.bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
  return out;
}

#ifndef TOKENMILL_VNNI_512
// x (K floats) -> Int8Row, in the layouts r has room for (those the tiles of its format read).
void quantize_row(const float* x, int64_t K, const Int8Row& r) {
  const int64_t B = K / kBlock;
  const bool words = r.words != nullptr, quads = r.quads != nullptr;
  const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  for (int64_t b = 0; b < B; ++b) {
    const QuantizedBlock q = quantize_block(x + b * kBlock);
    r.scale[b] = q.d, r.sum[b] = q.d * static_cast<float>(q.qsum), r.qsum[b] = q.qsum;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.bytes + b * kBlock), q.bytes);
    if (words) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.words + b * kBlock),
                          _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q.bytes)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.words + b * kBlock + 16),
                          _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q.bytes, 1)));
    }
    for (int j = 0; quads && j < kBlock / 4; ++j) {  // dword j of the block = xq[4j .. 4j + 3], spread out
      const __m256i quad = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(q.bytes, _mm256_set1_epi32(j)), spread);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.quads + (b * kBlock / 4 + j) * 32), quad);
    }
  }
}
#endif

// Eight int16 sums (two vectors' low and high halves) -> eight int32: (a.lo + a.hi) per lane.
inline __m256i widen_add(__m256i a) {
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)));
}

// A block's integer sums for features 0-7 (lo) and 8-15 (hi) -> y += d * dx * s (+ m * dx * sum(xq)).
template <int64_t F>
inline void add_block(__m256i lo, __m256i hi, const BlockScales& s, float dx, float xsum, float* y) {
  const __m256 dxv = _mm256_set1_ps(dx);
  __m256 y0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s.d0, dxv), _mm256_loadu_ps(y));
  __m256 y1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s.d1, dxv), _mm256_loadu_ps(y + 8));
  if constexpr (has_offset(F)) {
    const __m256 xs = _mm256_set1_ps(xsum);
    y0 = _mm256_fmadd_ps(s.m0, xs, y0);
    y1 = _mm256_fmadd_ps(s.m1, xs, y1);
  }
  _mm256_storeu_ps(y, y0);
  _mm256_storeu_ps(y + 8, y1);
}

// Up to four rows of x in 8-bit blocks times a panel of nibble blocks (Q4_0, Q4_1, Q4F), into
// out (R, 16). Four k rows of codes (32 bytes: a k row holds feature j in byte j's low nibble,
// j + 8 in its high one) make, after masking, shifting and one in-lane shuffle, 16 (feature, two
// k) byte pairs per vector, which vpmaddubsw multiplies with each row's pairs of x and adds: at
// most 8 x 2 x 15 x 127 per int16 lane in a block, no overflow. The rows share the unpacking.
#ifdef TOKENMILL_VNNI
// With VNNI: one dword permute and, per nibble half, one in-lane shuffle turn the four k rows
// into eight (feature, four k) dwords (features 0-7 from the low nibbles, 8-15 from the high),
// which vpdpbusd multiplies with the row's four bytes of x and adds into int32 lanes in feature
// order: two instructions per row where vpmaddubsw took four, and no int16 sums to widen.
template <int64_t F, int R>
void int8_tile_nibbles(const Int8Row* x, const uint8_t* src, int64_t num_blocks, float* out, const uint8_t* pf,
                       bool once) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  // dwords: k row i's features 0-3 are dword 2i, its features 4-7 dword 2i + 1; features 0-3 of
  // the four k to the low lane, 4-7 to the high one, then per feature its four k side by side
  const __m256i gather = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                             0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  std::fill(out, out + R * kPanel, 0.0f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (pf != nullptr) prefetch_block(pf + b * block_span(F), block_span(F), once);
    const uint8_t* codes = codes_of<F>(src, b);
    __m256i lo[R], hi[R];  // per row: features 0-7 and 8-15, int32
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int64_t j = 0; j < kBlock / 4; ++j) {
      const __m256i c = _mm256_permutevar8x32_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 32)), gather);
      const __m256i l = _mm256_shuffle_epi8(_mm256_and_si256(c, mask), transpose);
      const __m256i h = _mm256_shuffle_epi8(_mm256_and_si256(_mm256_srli_epi16(c, 4), mask), transpose);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, x[r].bytes + b * kBlock + 4 * j, 4);
        const __m256i xv = _mm256_set1_epi32(quad);
        lo[r] = dpbusd(lo[r], l, xv);
        hi[r] = dpbusd(hi[r], h, xv);
      }
    }
    const BlockScales s = scales_of<F>(src, b);
    for (int r = 0; r < R; ++r) {
      __m256i slo = lo[r], shi = hi[r];
      if constexpr (F == kQ4_0) {  // values are d * (q - 8)
        const __m256i shift = _mm256_set1_epi32(8 * x[r].qsum[b]);
        slo = _mm256_sub_epi32(slo, shift), shi = _mm256_sub_epi32(shi, shift);
      }
      add_block<F>(slo, shi, s, x[r].scale[b], x[r].sum[b], out + r * kPanel);
    }
  }
}
#else
template <int64_t F, int R>
void int8_tile_nibbles(const Int8Row* x, const uint8_t* src, int64_t num_blocks, float* out, const uint8_t* pf,
                       bool once) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  // in each half: bytes 0-7 are one k's features, 8-15 the next k's; pair them up per feature
  const __m256i pair_up = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                           0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  std::fill(out, out + R * kPanel, 0.0f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (pf != nullptr) prefetch_block(pf + b * block_span(F), block_span(F), once);
    const uint8_t* codes = codes_of<F>(src, b);
    __m256i lo[R], hi[R];  // per row: features 0-7 and 8-15, int16, both halves
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    // not unrolled: unrolled, GCC computed every product first and summed them in a tree, spilling
    // the products to the stack (at four rows, slower than the float32 tiles)
#pragma GCC unroll 1
    for (int64_t j = 0; j < kBlock / 4; ++j) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 32));
      const __m256i l = _mm256_shuffle_epi8(_mm256_and_si256(c, mask), pair_up);
      const __m256i h = _mm256_shuffle_epi8(_mm256_and_si256(_mm256_srli_epi16(c, 4), mask), pair_up);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r].quads + (b * 8 + j) * 32));
        lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(l, xv));
        hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(h, xv));
      }
    }
    const BlockScales s = scales_of<F>(src, b);
    for (int r = 0; r < R; ++r) {
      __m256i slo = widen_add(lo[r]), shi = widen_add(hi[r]);
      if constexpr (F == kQ4_0) {  // values are d * (q - 8)
        const __m256i shift = _mm256_set1_epi32(8 * x[r].qsum[b]);
        slo = _mm256_sub_epi32(slo, shift), shi = _mm256_sub_epi32(shi, shift);
      }
      add_block<F>(slo, shi, s, x[r].scale[b], x[r].sum[b], out + r * kPanel);
    }
  }
}
#endif

// The same for byte codes (Q8_0, Q5F, Q6F): two k rows of 16 codes widened to int16 and
// interleaved per feature, so that vpmaddwd multiplies each (feature, two k) pair with a row's
// pair of x and adds into int32; the lanes come out as features 0-3, 8-11 and 4-7, 12-15, put
// back in order per block. Q6F's second 16 k have scales of their own: its sums go per half.
template <int64_t F, int R>
void int8_tile_bytes(const Int8Row* x, const uint8_t* src, int64_t num_blocks, float* out, const uint8_t* pf,
                     bool once) {
  constexpr int64_t kParts = F == kQ6F ? 2 : 1;  // runs of k with one scale
  std::fill(out, out + R * kPanel, 0.0f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (pf != nullptr) prefetch_block(pf + b * block_span(F), block_span(F), once);
    const uint8_t* codes = codes_of<F>(src, b);
    BlockScales s = scales_of<F>(src, b);
    for (int64_t part = 0; part < kParts; ++part) {
      if (part == 1) next_half<F>(s);
      __m256i a[R], c[R];  // per row: features 0-3, 8-11 and 4-7, 12-15
      for (int r = 0; r < R; ++r) a[r] = c[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int64_t i = part * kBlock / kParts; i < (part + 1) * kBlock / kParts; i += 2) {
        const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * kPanel));
        const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (i + 1) * kPanel));
        __m256i w0, w1;
        if constexpr (unsigned_bytes(F)) {
          w0 = _mm256_cvtepu8_epi16(r0), w1 = _mm256_cvtepu8_epi16(r1);
        } else {
          w0 = _mm256_cvtepi8_epi16(r0), w1 = _mm256_cvtepi8_epi16(r1);
        }
        const __m256i first = _mm256_unpacklo_epi16(w0, w1), second = _mm256_unpackhi_epi16(w0, w1);
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, x[r].words + b * kBlock + i, 4);
          const __m256i xv = _mm256_set1_epi32(pair);
          a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(first, xv));
          c[r] = _mm256_add_epi32(c[r], _mm256_madd_epi16(second, xv));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256i lo = _mm256_permute2x128_si256(a[r], c[r], 0x20), hi = _mm256_permute2x128_si256(a[r], c[r], 0x31);
        add_block<F>(lo, hi, s, x[r].scale[b], F == kQ6F ? 0.0f : x[r].sum[b], out + r * kPanel);
      }
    }
  }
}

#ifdef TOKENMILL_VNNI_512

// What vpdpbusd's unsigned side adds to each code: Q8_0's signed codes go in as c + 128 (an xor);
// Q4_0's codes are q where its values are d * (q - 8), Q6F's 6-bit ones q for q - 32. That times
// sum(xq) comes off a run of k with one scale (a block; Q6F's halves).
constexpr int32_t code_offset(int64_t f) { return f == kQ8_0 ? 128 : f == kQ6F ? 32 : f == kQ4_0 ? 8 : 0; }

// Four k rows (j-th group of a block) of byte codes -> the 16 features' (four k) unsigned dwords.
template <int64_t F>
inline __m512i code_quads(const uint8_t* codes, int64_t j) {
  static_assert(byte_codes(F), "nibbles are laid out for the tile already (nibble_quads)");
  const __m512i c = transpose_quads<false>(_mm512_loadu_si512(codes + 4 * j * kPanel));
  return code_offset(F) == 128 ? _mm512_xor_si512(c, _mm512_set1_epi8(static_cast<char>(0x80))) : c;
}

// The pass's finished rows y of panel p into `out`, as store_tile writes them (bias, row scales,
// a last panel's fewer columns), with no tile in PanelScratch for int8_panel to copy out.
template <int R>
inline void store_rows(const __m512 (&y)[R], const Int8Pass& x, int64_t p, const tokenmill::PanelOut& out) {
  const int64_t n0 = p * kPanel, width = std::min(kPanel, out.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
  const __m512 bias = out.bias != nullptr ? _mm512_maskz_loadu_ps(mask, out.bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    __m512 v = _mm512_add_ps(y[r], bias);
    if (out.row_scale != nullptr) v = _mm512_mul_ps(v, _mm512_set1_ps(out.row_scale[x.m0 + r]));
    _mm512_mask_storeu_ps(out.y + (x.m0 + r) * out.ldy + n0, mask, v);
  }
}

// Every format with 512-bit VNNI: a group of four k rows becomes the 16 features' dwords
// once (code_quads; Q6F's 6-bit codes two groups at a time, six_bit_quads, or over a spread copy
// already), which one vpdpbusd a row multiplies with the row's four bytes of x (from the pass's
// interleaved copy), into one register of int32 sums a row in feature order; the block's scales
// go on as add_block's, 16 lanes at a time, once a block (for Q6F, whose halves of 16 k have
// scales of their own, once a half), into a register of float sums a row that store_rows writes.
template <int64_t F, int R, bool Spread = false>
void int8_tile_512(const Int8Pass* x, const uint8_t* src, int64_t num_blocks, int64_t p,
                   const tokenmill::PanelOut& out, const uint8_t* pf, bool once) {
  constexpr int64_t kParts = F == kQ6F ? 2 : 1, kQuads = kBlock / 4 / kParts;  // runs of k with one scale
  constexpr int64_t kStep = tile_layout(F) && !Spread ? 2 : 1;                   // groups decoded at once
  __m512 y[R];  // the rows' outputs, in registers through the blocks
  for (int r = 0; r < R; ++r) y[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (pf != nullptr) prefetch_block(pf + b * block_span(F), block_span(F), once);
    const uint8_t* unit = Spread ? src + b / kSuper * kSpreadUnitBytes : nullptr;  // spread_six_bits' copy
    const uint8_t* codes = Spread ? unit + codes_at(F) + b % kSuper * kBlock * kPanel : codes_of<F>(src, b);
    BlockScales s = Spread ? super_block_scales<F>(unit, b % kSuper) : scales_of<F>(src, b);
    const int8_t* xb = x->bytes + b * kBlock * R;  // the block's x: per four k, the R rows' bytes
    for (int64_t part = 0; part < kParts; ++part) {
      if (part == 1) next_half<F>(s);
      __m512i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int64_t j = part * kQuads; j < (part + 1) * kQuads; j += kStep) {
        __m512i q[kStep];
        if constexpr (Spread) {
          q[0] = _mm512_loadu_si512(codes + 4 * j * kPanel);
        } else if constexpr (six_bit_codes(F)) {
          six_bit_quads(codes, j / 2, q[0], q[kStep - 1]);
        } else if constexpr (quad_nibbles(F)) {
          nibble_quads(codes, j / 2, q[0], q[kStep - 1]);
        } else {
          q[0] = code_quads<F>(codes, j);
        }
        for (int64_t t = 0; t < kStep; ++t) {
          for (int r = 0; r < R; ++r) {
            int32_t quad;
            std::memcpy(&quad, xb + 4 * ((j + t) * R + r), 4);
            acc[r] = _mm512_dpbusd_epi32(acc[r], q[t], _mm512_set1_epi32(quad));
          }
        }
      }
      const __m512 d = _mm512_insertf32x8(_mm512_castps256_ps512(s.d0), s.d1, 1);
      const __m512 m = _mm512_insertf32x8(_mm512_castps256_ps512(s.m0), s.m1, 1);
      for (int r = 0; r < R; ++r) {
        __m512i sums = acc[r];
        if constexpr (code_offset(F) != 0) {
          const int32_t qsum = kParts == 2 ? x->half_qsum[(kParts * b + part) * R + r] : x->qsum[b * R + r];
          sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(code_offset(F) * qsum));
        }
        y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(x->scale[b * R + r])), y[r]);
        if constexpr (has_offset(F)) y[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->sum[b * R + r]), y[r]);
      }
    }
  }
  store_rows(y, *x, p, out);
}

// A panel of Q6F's 6-bit codes -> `spread`: each unit's header, then its blocks' codes as
// code_quads gives them (unsigned q, the 16 features' dwords per four k, 512 bytes a block), for
// steps of more than one pass (spreads_codes), whose passes then only multiply instead of each
// decoding the six bits again. Prefetches `pf` meanwhile. The copy fits PanelScratch's buffer:
static_assert(kSpreadUnitBytes <= kSuper * kBlock * kPanel * static_cast<int64_t>(sizeof(float)));
void spread_six_bits(const uint8_t* src, int64_t num_blocks, uint8_t* spread, const uint8_t* pf) {
  for (int64_t u = 0; u < num_blocks / kSuper; ++u) {
    const uint8_t* unit = src + u * unit_bytes(kQ6F);
    uint8_t* to = spread + u * kSpreadUnitBytes;
    std::memcpy(to, unit, codes_at(kQ6F));
    for (int64_t j = 0; j < kSuper; ++j) {
      if (pf != nullptr) prefetch_block(pf + (u * kSuper + j) * block_span(kQ6F), block_span(kQ6F), false);
      uint8_t* quads = to + codes_at(kQ6F) + j * kBlock * kPanel;
      for (int64_t o = 0; o < kBlock / 8; ++o) {
        __m512i first, second;
        six_bit_quads(unit + codes_at(kQ6F) + j * code_bytes(kQ6F), o, first, second);
        _mm512_storeu_si512(quads + 8 * o * kPanel, first);  // k 8o.. as four k rows of byte codes take
        _mm512_storeu_si512(quads + (8 * o + 4) * kPanel, second);
      }
    }
  }
}
#endif

// The 8-bit tile of R rows for format F. With 512-bit VNNI it reads a pass (Int8Pass) and writes
// panel p of the output; the others read the pass's first row and write a tile that int8_panel stores.
#ifdef TOKENMILL_VNNI_512
using Int8TileFn = void (*)(const Int8Pass*, const uint8_t*, int64_t, int64_t, const tokenmill::PanelOut&,
                            const uint8_t*, bool);
template <int64_t F, int R>
constexpr Int8TileFn int8_tile = int8_tile_512<F, R>;
#else
using Int8TileFn = void (*)(const Int8Row*, const uint8_t*, int64_t, float*, const uint8_t*, bool);
template <int64_t F, int R>
constexpr Int8TileFn int8_tile = byte_codes(F) ? int8_tile_bytes<F, R> : int8_tile_nibbles<F, R>;
#endif

// Most rows of x per pass over a panel: 12 for the 512-bit tile (one register of sums a row;
// faster than 8 on the default workload, measured: BENCHMARKS.md, "Float weights in bfloat16
// panels on a Zen 4 (issue 28), 2026-11-27, eleventh session"), 8 for the others where VNNI and
// AVX-512VL's 32 registers hold their sums (a row's few instructions per four k against those the
// rows share), else 4.
#if defined(TOKENMILL_VNNI) && defined(__AVX512VL__)
constexpr int64_t kInt8Rows = kVnni512 ? 12 : 8;
#else
constexpr int64_t kInt8Rows = 4;
#endif
template <int64_t F, size_t... R>
constexpr std::array<Int8TileFn, sizeof...(R) + 1> int8_tiles(std::index_sequence<R...>) {
  return {nullptr, int8_tile<F, static_cast<int>(R) + 1>...};
}
template <int64_t F>
constexpr auto kInt8TilesOf = int8_tiles<F>(std::make_index_sequence<kInt8Rows>());
#ifdef TOKENMILL_VNNI_512
// Whether a step of `rows` rows spreads each panel's 6-bit codes once for its passes (spread_six_bits).
constexpr bool spreads_codes(int64_t format, int64_t rows) { return six_bit_codes(format) && rows > kInt8Rows; }
template <size_t... R>
constexpr std::array<Int8TileFn, sizeof...(R) + 1> spread_tiles(std::index_sequence<R...>) {
  return {nullptr, int8_tile_512<kQ6F, static_cast<int>(R) + 1, true>...};
}
constexpr auto kSpreadTiles = spread_tiles(std::make_index_sequence<kInt8Rows>());  // over spread_six_bits' copy
#endif
constexpr const Int8TileFn* kInt8Tiles[kLastBlockFormat + 1] = {
    nullptr, kInt8TilesOf<kQ4_0>.data(), kInt8TilesOf<kQ4_1>.data(), kInt8TilesOf<kQ8_0>.data(),
    kInt8TilesOf<kQ4F>.data(), kInt8TilesOf<kQ5F>.data(), kInt8TilesOf<kQ6F>.data(), kInt8TilesOf<kQ5K>.data(),
    nullptr};  // MXF: never in 8 bits (panel_rows)

// x (M, K), in 8-bit blocks, times panel p of blocks (at src), in even passes of at most
// kInt8Rows rows (the default workload ran faster than with passes of the most rows and a
// remainder). The first pass prefetches `next` (or nullptr): unlike the float32 decoding, these
// passes outrun the hardware prefetcher (at one row the default model's layers ran faster with
// it, and its Q8_0 head went from slower than the float32 decoding without it to faster with it).
void int8_panel(const tokenmill::PanelRows& x, const uint8_t* src, const uint8_t* next, int64_t format, int64_t p,
                tokenmill::PanelScratch& scratch, const tokenmill::PanelOut& out) {
  const int64_t M = x.M, K = x.K;
  const Int8TileFn* tiles = kInt8Tiles[format];
#ifdef TOKENMILL_VNNI_512
  if (spreads_codes(format, M)) {
    uint8_t* spread = reinterpret_cast<uint8_t*>(scratch.decoded());
    spread_six_bits(src, K / kBlock, spread, next);
    src = spread, next = nullptr, tiles = kSpreadTiles.data();
  }
  for (const Int8Pass& pass : x.passes)
    tiles[pass.n](&pass, src, K / kBlock, p, out, pass.m0 == 0 ? next : nullptr, streams_once(M));
#else
  even_passes(M, kInt8Rows, [&](int64_t m0, int64_t n) {
    tiles[n](x.int8.data() + m0, src, K / kBlock, scratch.tile, m0 == 0 ? next : nullptr, streams_once(M));
    store_tile(out, scratch.tile, p, m0, n);
  });
#endif
}
#endif

// ---- bfloat16 panels ------------------------------------------------------------------------
//
// A float checkpoint's weights rounded once to bfloat16 (to nearest even, by torch, at load), in
// panels of 16 features where each pair of k (2i, 2i + 1) holds the 16 features' two weights side
// by side: 64 bytes, the operand of one vdpbf16ps, which multiplies it with a pair of x broadcast
// to every lane and adds both products into 16 float32 sums. x is rounded to bfloat16 once per
// product (panel_rows); the sums, the outputs and everything between the products stay float32.
// Half the bytes of float32 panels to stream, twice the products per instruction.
constexpr int64_t kPairBytes = 2 * kPanel * 2;  // a pair of k across a panel's 16 features

#ifdef TOKENMILL_BF16
// Most rows of x per pass over a panel, a register of sums each, every vdpbf16ps taking its pair
// of x straight from memory as a broadcast. On a Zen 4 core, passes of 8 to 12 rows ran vdpbf16ps
// at its full rate and passes of fewer or more rows did not (a stand-alone loop over cached panels:
// BENCHMARKS.md, "Float weights in bfloat16 panels on a Zen 4 (issue 28), 2026-11-27, eleventh
// session"): a step's rows go in even passes of at most 12.
constexpr int64_t kBf16Rows = 12;

// R rows of x in bfloat16 (rows K apart) times one bf16 panel -> out (R, 16); `pf` (or nullptr):
// the next panel, a line of it prefetched per pair of k (non-temporally where `once`: prefetch_block).
template <int R>
void bf16_tile(const uint16_t* x, int64_t K, const uint8_t* panel, float* out, const uint8_t* pf, bool once) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < K / 2; ++i) {
    if (pf != nullptr) prefetch_block(pf + i * kPairBytes, kPairBytes, once);
    const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + i * kPairBytes);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * i, 4);
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
}

using Bf16TileFn = void (*)(const uint16_t*, int64_t, const uint8_t*, float*, const uint8_t*, bool);
template <size_t... R>
constexpr std::array<Bf16TileFn, sizeof...(R) + 1> bf16_tiles(std::index_sequence<R...>) {
  return {nullptr, bf16_tile<static_cast<int>(R) + 1>...};
}
constexpr auto kBf16Tiles = bf16_tiles(std::make_index_sequence<kBf16Rows>());

// x (K floats) -> bfloat16, rounded to nearest even (16 at a time with denormals flushed to zero,
// the last few as torch rounds them: vdpbf16ps reads denormals as zero either way).
void bf16_row(const float* x, int64_t K, uint16_t* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
  }
  for (; k < K; ++k) out[k] = c10::BFloat16(x[k]).x;
}

// x (M rows in bfloat16) times bf16 panel p (at src), in even passes of at most kBf16Rows rows;
// the first pass prefetches `next` (or nullptr).
void bf16_panel(const uint16_t* x, int64_t M, int64_t K, const uint8_t* src, const uint8_t* next, int64_t p,
                float* tile, const tokenmill::PanelOut& out) {
  even_passes(M, kBf16Rows, [&](int64_t m0, int64_t n) {
    kBf16Tiles[n](x + m0 * K, K, src, tile, m0 == 0 ? next : nullptr, streams_once(M));
    store_tile(out, tile, p, m0, n);
  });
}
#else
constexpr int64_t kBf16Rows = 0;
#endif

// ---- bfloat16 panels on AMX tiles ---------------------------------------------------------------
//
// A bf16 panel's 16 pairs of k from pair 16 c on (32 k, 1 KiB) are exactly an AMX B tile: 16 rows
// of 64 bytes, each the 16 features' two weights side by side. So where the CPU has AMX-BF16, a
// step of kAmxMinRows rows or more multiplies each panel by tdpbf16ps: 16 rows of x (an A tile,
// 32 k of each) times that B tile into 16 x 16 float32 sums, 8,192 products an instruction against
// vdpbf16ps's 32. A pass takes 32 rows into two tiles of sums sharing each B tile; the pairs past
// the last 32 k are added by vdpbf16ps. A step of fewer rows pads a tile of 16 with zero rows, so
// it costs what 16 rows cost: on a Xeon with AMX that beat bf16_tile's passes from 8 rows but not
// at 4 (BENCHMARKS.md); the fewest rows, bound by streaming the panels from memory either way, stay
// on bf16_tile.
#ifdef TOKENMILL_AMX
constexpr int64_t kAmxMinRows = 8;
constexpr int64_t kAmxRows = 16;                // rows of an A tile and of a tile of sums
constexpr int64_t kAmxPassRows = 2 * kAmxRows;  // rows of x a pass over the panel takes
constexpr int64_t kAmxK = 32;                   // k of an A tile's row: 64 bytes of bfloat16

// ldtilecfg's 64-byte operand, palette 1: tiles 0 and 1 hold sums, 2 and 3 rows of x, 4 the panel's
// 32 k; every one 16 rows of 64 bytes.
struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16};
};

// Linux lends a process the AMX tiles' 8 KiB of state only once it asks (arch_prctl, kernel 5.16
// and later); asked once per process, false where refused (the products then stay on bf16_tile).
bool amx_permitted() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// Adds the pairs of k from pair `first` on (fewer than 16, past the tiles' last 32 k) to the n
// rows of sums in `tile`.
void bf16_tail(const uint16_t* x, int64_t K, int64_t first, const uint8_t* panel, int64_t n, float* tile) {
  for (int64_t r = 0; r < n; ++r) {
    __m512 acc = _mm512_loadu_ps(tile + r * kPanel);
    for (int64_t i = first; i < K / 2; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * i, 4);
      const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + i * kPairBytes);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), w);
    }
    _mm512_storeu_ps(tile + r * kPanel, acc);
  }
}

// x (M rows in bfloat16, padded with zero rows to a multiple of 32: panel_rows) times bf16 panel p
// (at src) on AMX tiles, 32 rows a pass; the first pass prefetches `next` (or nullptr) a B tile's
// 16 lines per 32 k. The tiles are configured on entry and released on return: the calling thread
// may run other code between two panels that configures them its own way.
void amx_panel(const uint16_t* x, int64_t M, int64_t K, const uint8_t* src, const uint8_t* next, int64_t p,
               float* tile, const tokenmill::PanelOut& out) {
  static const AmxConfig config;
  _tile_loadconfig(&config);
  const int64_t chunks = K / kAmxK, ldx = K * 2, chunk_bytes = kAmxK / 2 * kPairBytes;
  for (int64_t m0 = 0; m0 < M; m0 += kAmxPassRows) {
    const int64_t n = std::min(kAmxPassRows, M - m0);
    const uint16_t* x0 = x + m0 * K;
    const uint16_t* x1 = x0 + kAmxRows * K;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < chunks; ++c) {
      if (m0 == 0 && next != nullptr) {
        for (int64_t line = 0; line < kAmxK / 2; ++line) {
          _mm_prefetch(reinterpret_cast<const char*>(next + c * chunk_bytes + line * kPairBytes), _MM_HINT_T0);
        }
      }
      _tile_loadd(4, src + c * chunk_bytes, kPairBytes);
      _tile_loadd(2, x0 + c * kAmxK, ldx);
      _tile_dpbf16ps(0, 2, 4);
      if (n > kAmxRows) {
        _tile_loadd(3, x1 + c * kAmxK, ldx);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    _tile_stored(0, tile, kPanel * sizeof(float));
    _tile_stored(1, tile + kAmxRows * kPanel, kPanel * sizeof(float));
    if (chunks * kAmxK < K) bf16_tail(x0, K, chunks * kAmxK / 2, src, n, tile);
    store_tile(out, tile, p, m0, n);
  }
  _tile_release();
}
#else
constexpr int64_t kAmxPassRows = 0;
#endif

// The first 64-byte boundary in rows' arena (allocated 64 bytes over what it holds).
uint8_t* aligned_arena(const tokenmill::PanelRows& rows) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(rows.arena.get()) + 63) & ~uintptr_t{63});
}

constexpr int64_t up64(int64_t n) { return (n + 63) & ~int64_t{63}; }

#ifdef TOKENMILL_VNNI_512
// Lays out the passes of rows' M rows (even_passes of kInt8Rows) from `at`, each part 64-byte
// aligned, with room for half sums where `halves`: returns the bytes they take (with `at` null,
// lays out nothing).
int64_t lay_out_passes(tokenmill::PanelRows& rows, uint8_t* at, bool halves) {
  const int64_t B = rows.K / kBlock;
  int64_t bytes = 0;
  even_passes(rows.M, kInt8Rows, [&](int64_t m0, int64_t n) {
    const int64_t codes = up64(n * rows.K), part = up64(4 * n * B);  // part: a float or int32 per row and block
    if (at != nullptr) {
      uint8_t* p = at + bytes + codes;
      rows.passes.push_back(Int8Pass{m0, n, reinterpret_cast<int8_t*>(at + bytes), reinterpret_cast<float*>(p),
                                     reinterpret_cast<float*>(p + part), reinterpret_cast<int32_t*>(p + 2 * part),
                                     halves ? reinterpret_cast<int32_t*>(p + 3 * part) : nullptr});
    }
    bytes += codes + (halves ? 5 : 3) * part;
  });
  return bytes;
}

// The pass that holds row m of rows.
const Int8Pass& pass_of(const tokenmill::PanelRows& rows, int64_t m) {
  return *std::prev(std::upper_bound(rows.passes.begin(), rows.passes.end(), m,
                                     [](int64_t row, const Int8Pass& p) { return row < p.m0; }));
}

// Row r of `pass` from x (K floats), quantized as quantize_row quantizes, straight into the pass's
// interleaved layout: a block's eight dwords of bytes 4n bytes apart, in one scatter.
void quantize_into_pass(const float* x, int64_t K, const Int8Pass& pass, int64_t r) {
  const int64_t n = pass.n;
  const __m256i apart = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32(static_cast<int32_t>(n)));
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const QuantizedBlock q = quantize_block(x + b * kBlock);
    _mm256_i32scatter_epi32(pass.bytes + 4 * (kBlock / 4 * b * n + r), apart, q.bytes, 4);
    pass.scale[b * n + r] = q.d, pass.sum[b * n + r] = q.d * static_cast<float>(q.qsum), pass.qsum[b * n + r] = q.qsum;
    if (pass.half_qsum != nullptr) {
      pass.half_qsum[2 * b * n + r] = q.first_half;
      pass.half_qsum[(2 * b + 1) * n + r] = q.qsum - q.first_half;
    }
  }
}

// Row m of rows copied from row `from` of source, pass to pass (gather_panel_rows).
void copy_pass_row(const tokenmill::PanelRows& source, int64_t from, const tokenmill::PanelRows& rows, int64_t m) {
  const Int8Pass &in = pass_of(source, from), &out = pass_of(rows, m);
  const int64_t i = from - in.m0, r = m - out.m0;
  for (int64_t q = 0; q < rows.K / 4; ++q) std::memcpy(out.bytes + 4 * (q * out.n + r), in.bytes + 4 * (q * in.n + i), 4);
  for (int64_t b = 0; b < rows.K / kBlock; ++b) {
    out.scale[b * out.n + r] = in.scale[b * in.n + i], out.sum[b * out.n + r] = in.sum[b * in.n + i];
    out.qsum[b * out.n + r] = in.qsum[b * in.n + i];
    for (int64_t h = 0; out.half_qsum != nullptr && h < 2; ++h)
      out.half_qsum[(2 * b + h) * out.n + r] = in.half_qsum[(2 * b + h) * in.n + i];
  }
}
#endif

}  // namespace

static_assert(kWideRows * kPanel <= tokenmill::kMostTileFloats && kInt8Rows <= kWideRows &&
                  kBf16Rows * kPanel <= tokenmill::kMostTileFloats &&
                  kAmxPassRows * kPanel <= tokenmill::kMostTileFloats,
              "PanelScratch's tile holds the widest tile's outputs");

namespace tokenmill {

bool takes_int8(int64_t format, int64_t M, int64_t int8_rows) {
#ifdef TOKENMILL_AVX2
  return block_format(format) && format != kMXF && M <= int8_rows;  // FP4 codes have no integer form here
#else
  return false;
#endif
}

PanelRows panel_rows(const float* x, int64_t M, int64_t K, int64_t format, int64_t int8_rows, bool fill) {
  PanelRows rows(x, M, K);
#ifdef TOKENMILL_BF16
  if (format == kBF16) {
#ifdef TOKENMILL_AMX
    rows.amx = M >= kAmxMinRows && amx_permitted();
#endif
    // AMX's passes read whole tiles of 16 rows: zero rows pad x to a multiple of 32
    const int64_t padded = rows.amx ? (M + kAmxPassRows - 1) / kAmxPassRows * kAmxPassRows : M;
    rows.arena.reset(new uint8_t[padded * K * 2 + 64]);
    rows.bf16 = reinterpret_cast<uint16_t*>(aligned_arena(rows));
    std::memset(rows.bf16 + M * K, 0, (padded - M) * K * 2);
    if (fill) fill_panel_rows(rows);
    return rows;
  }
#endif
#ifdef TOKENMILL_AVX2
  if (takes_int8(format, M, int8_rows)) {
#ifdef TOKENMILL_VNNI_512
    // the rows straight into their passes (quantize_into_pass); not zeroed: every byte read is written
    const bool halves = reads_half_sums(format);
    rows.arena.reset(new uint8_t[lay_out_passes(rows, nullptr, halves) + 64]);
    lay_out_passes(rows, aligned_arena(rows), halves);
#else
    // per row, 64-byte aligned parts: scale, sum, qsum (B each), bytes (K), words (K int16), quads (8K)
    const bool words = reads_words(format), quads = !byte_codes(format) && !kVnni;
    const int64_t part = up64(4 * (K / kBlock));
    const int64_t row = 3 * part + up64(K) + (words ? up64(2 * K) : 0) + (quads ? 8 * K : 0);
    rows.arena.reset(new uint8_t[M * row + 64]);  // not zeroed: quantize_row writes every byte read
    uint8_t* base = aligned_arena(rows);
    rows.int8.resize(M);
    for (int64_t m = 0; m < M; ++m) {
      uint8_t* p = base + m * row;
      uint8_t* tail = p + 3 * part + up64(K);
      rows.int8[m] = Int8Row{reinterpret_cast<float*>(p), reinterpret_cast<float*>(p + part),
                             reinterpret_cast<int32_t*>(p + 2 * part), reinterpret_cast<int8_t*>(p + 3 * part),
                             words ? reinterpret_cast<int16_t*>(tail) : nullptr, quads ? tail : nullptr};
    }
#endif
    if (fill) fill_panel_rows(rows);
  }
#endif
  return rows;
}

void fill_panel_row(const PanelRows& rows, int64_t m) {
#ifdef TOKENMILL_VNNI_512
  if (rows.in_8_bits()) {
    const Int8Pass& pass = pass_of(rows, m);
    quantize_into_pass(rows.x + m * rows.K, rows.K, pass, m - pass.m0);
  }
#elif defined(TOKENMILL_AVX2)
  if (rows.in_8_bits()) quantize_row(rows.x + m * rows.K, rows.K, rows.int8[m]);
#endif
#ifdef TOKENMILL_BF16
  if (rows.bf16 != nullptr) bf16_row(rows.x + m * rows.K, rows.K, rows.bf16 + m * rows.K);
#endif
}

// the threads fill rows in parallel from 16 rows (prompt chunks): serially, on one thread, it
// held the other back
void fill_panel_rows(const PanelRows& rows) {
  if (!rows.in_8_bits() && rows.bf16 == nullptr) return;
  at::parallel_for(0, rows.M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) fill_panel_row(rows, m);
  });
}

PanelRows gather_panel_rows(const PanelRows& source, const int64_t* picks, int64_t M) {
  TM_CHECK(source.in_8_bits(), "gather_panel_rows: the source rows must be in 8-bit blocks");
  PanelRows rows(nullptr, M, source.K);
#ifdef TOKENMILL_VNNI_512
  const bool halves = source.passes.front().half_qsum != nullptr;
  rows.arena.reset(new uint8_t[lay_out_passes(rows, nullptr, halves) + 64]);
  lay_out_passes(rows, aligned_arena(rows), halves);
  for (int64_t m = 0; m < M; ++m) copy_pass_row(source, picks[m], rows, m);
#else
  for (int64_t m = 0; m < M; ++m) rows.int8.push_back(source.int8[picks[m]]);
#endif
  return rows;
}

int64_t panel_stride(int64_t K, int64_t format) {
  if (format == kFloat32) return K * kPanel * static_cast<int64_t>(sizeof(float));
  return format == kBF16 ? K / 2 * kPairBytes : K / unit_k(format) * unit_bytes(format);
}

bool decodes_panels(const PanelRows& x, int64_t format) {
  if (!block_format(format)) return false;
#ifdef TOKENMILL_VNNI_512
  if (x.in_8_bits()) return spreads_codes(format, x.M);
#endif
  return !x.in_8_bits() && x.M > kDecodeRows;
}

int64_t panel_chunk_for(int64_t rows) { return panel_chunk(rows); }

int64_t amx_min_rows() {
#ifdef TOKENMILL_AMX
  return amx_permitted() ? kAmxMinRows : 0;
#else
  return 0;
#endif
}

void run_panel(const PanelRows& x, const uint8_t* panel, int64_t format, int64_t p, const uint8_t* next,
               PanelScratch& scratch, const PanelOut& out) {
  if (format == kFloat32) {
    for (int64_t block = 0; block < x.M; block += kRowBlock) {
      float_panel(x.x, block, std::min(x.M, block + kRowBlock), x.K, reinterpret_cast<const float*>(panel),
                  reinterpret_cast<const float*>(next), scratch.tile, out, p);
    }
    return;
  }
#ifdef TOKENMILL_BF16
  if (format == kBF16) {
#ifdef TOKENMILL_AMX
    if (x.amx) {
      amx_panel(x.bf16, x.M, x.K, panel, next, p, scratch.tile, out);
      return;
    }
#endif
    bf16_panel(x.bf16, x.M, x.K, panel, next, p, scratch.tile, out);
    return;
  }
#endif
#ifdef TOKENMILL_AVX2
  if (x.in_8_bits()) {
    int8_panel(x, panel, next, format, p, scratch, out);
  } else {
    block_panel(x.x, x.M, x.K, panel, next, format, p, scratch, out);
  }
#endif
}

}  // namespace tokenmill

bool streams_weights_non_temporally() { return amd_cpu(); }

// The shape of the panels of an (N, K) matrix in `format`: (ceil(N / 16), K, 16) float32,
// (ceil(N / 16), K / 2, 64) uint8 for bf16 (pairs of k), or (ceil(N / 16), K / (32 or 256),
// panel unit bytes) uint8, for the loader to lay out every matrix's panels in one arena before
// packing them into it.
std::vector<int64_t> panel_shape(int64_t N, int64_t K, int64_t format) {
  TM_CHECK(format == kFloat32 || (format == kBF16 && K % 2 == 0) || (block_format(format) && K % unit_k(format) == 0),
           "panel_shape: unknown format " + std::to_string(format) + " or K not a multiple of its blocks");
  const int64_t P = (N + kPanel - 1) / kPanel;
  if (format == kFloat32) return {P, K, kPanel};
  if (format == kBF16) return {P, K / 2, kPairBytes};
  return {P, K / unit_k(format), unit_bytes(format)};
}

// `out` given: zero it (it must have the panels' shape and dtype) and pack into it; else a new tensor.
static at::Tensor panels_tensor(c10::optional<at::Tensor> out, std::vector<int64_t> shape, at::ScalarType dtype) {
  if (!out.has_value()) return at::zeros(shape, at::TensorOptions().dtype(dtype));
  TM_CHECK(out->dtype() == dtype && out->sizes() == c10::IntArrayRef(shape) && out->is_contiguous(),
           "pack: out must be contiguous, of the panels' shape and dtype");
  return out->zero_();
}

// W (N, K) bfloat16 -> bf16 panels (ceil(N / 16), K / 2, 64) uint8, the last panel zero-padded.
at::Tensor pack_bf16_panels(const at::Tensor& w, c10::optional<at::Tensor> out) {
#ifndef TOKENMILL_BF16
  TM_CHECK(false, "pack_panels: bfloat16 panels need AVX512-BF16");
#endif
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  TM_CHECK(K % 2 == 0, "pack_panels: bfloat16 panels take an even number of columns");
  auto panels = panels_tensor(out, panel_shape(N, K, kBF16), at::kByte);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(panels.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const uint16_t* row = src + (p * kPanel + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[((p * K + k - k % 2) * kPanel + 2 * j) + k % 2] = row[k];
      }
    }
  });
  return panels;
}

// W (N, K) float32 -> (ceil(N / 16), K, 16), the last panel zero-padded; bfloat16 -> bf16 panels.
at::Tensor pack_panels(at::Tensor weight, c10::optional<at::Tensor> out) {
  TM_CHECK((weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16) && weight.dim() == 2,
           "pack_panels: a float32 or bfloat16 matrix");
  auto w = weight.contiguous();
  if (w.dtype() == at::kBFloat16) return pack_bf16_panels(w, out);
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  auto panels = panels_tensor(out, panel_shape(N, K, kFloat32), at::kFloat);
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

// Row j's scales (and offsets) from its unit into the panel unit `out`.
void put_scales(int64_t format, const uint8_t* row, int64_t j, uint8_t* out) {
  if (format == kQ4F || format == kQ5K) {  // d and dmin, then per block its scale, then per block its min
    std::memcpy(out + 2 * j, row, 2);
    std::memcpy(out + kDminAt + 2 * j, row + 2, 2);
    for (int64_t b = 0; b < 2 * kSuper; ++b) {  // b < 8: block b's scale, else block b - 8's min
      if (!six_bit_scales(format)) {
        out[super_scales_at(format) + b * kPanel + j] = row[4 + b];
        continue;
      }
      TM_CHECK(row[4 + b] < 64, "pack_block_panels: a Q4_K scale or min past 6 bits");
      const int64_t bit = (b % kSuper * kSixBitScaleBytes + b / kSuper * kPanel * 6 / 8) * 8 + 6 * j;
      uint8_t* at = out + super_scales_at(format) + bit / 8;  // the 6 bits, from bit `bit % 8` of at[0] on
      const unsigned value = static_cast<unsigned>(row[4 + b]) << (bit % 8);
      at[0] |= static_cast<uint8_t>(value);
      if (value > 0xFF) at[1] |= static_cast<uint8_t>(value >> 8);
    }
  } else if (format == kQ6F) {  // d, then per 16 k its scale
    std::memcpy(out + 2 * j, row, 2);
    for (int64_t t = 0; t < 2 * kSuper; ++t) out[super_scales_at(format) + t * kPanel + j] = row[2 + t];
  } else {  // scale d, and offset m
    const int64_t sb = scale_bytes(format) / kPanel;
    std::memcpy(out + sb * j, row, sb);
    if (offset_bytes(format)) std::memcpy(out + sb * (kPanel + j), row + sb, sb);
  }
}

// One block's codes of `rows` rows (qs[j]: row j's) into a panel's layout at `codes`: k by k, the
// 16 features side by side, or where the 512-bit tile runs, its layouts (tile_layout). Nibbles come
// as in GGUF, byte i holding weight i (low nibble) and weight i + 16 (high), and go to panel bytes
// holding feature j in the low nibble, j + 8 in the high (or as nibble_quads reads them).
void put_codes(int64_t format, const uint8_t* const* qs, int64_t rows, uint8_t* codes) {
  if (six_bit_codes(format)) {  // qs: signed bytes q - 32, into six_bit_quads' layout
    for (int64_t i = 0; i < kBlock; ++i) {
      uint8_t* octet = codes + i / 8 * octet_bytes(format);
      for (int64_t j = 0; j < rows; ++j) {
        const int q = static_cast<int8_t>(qs[j][i]) + 32, at = 4 * j + i % 4;  // at: its byte in its half's dwords
        if (i % 8 < 4) {
          octet[at] |= static_cast<uint8_t>(q);
        } else {
          octet[at] |= static_cast<uint8_t>((q & 0x03) << 6);
          octet[64 + at % 32] |= static_cast<uint8_t>((q >> 2) << (4 * (at / 32)));
        }
      }
    }
    return;
  }
  if (byte_codes(format)) {
    for (int64_t i = 0; i < kBlock; ++i) {
      for (int64_t j = 0; j < rows; ++j) codes[i * kPanel + j] = qs[j][i];
    }
    return;
  }
  for (int64_t i = 0; i < kBlock; ++i) {
    const int64_t at = i % (kBlock / 2), shift = i < kBlock / 2 ? 0 : 4;
    for (int64_t j = 0; j < rows; ++j) {
      const int q = (qs[j][at] >> shift) & 0x0F;
      if (quad_nibbles(format)) {  // into nibble_quads' layout: octet i / 8, byte 4j + i % 4
        codes[i / 8 * octet_bytes(format) + 4 * j + i % 4] |= static_cast<uint8_t>(q << (4 * (i % 8 / 4)));
      } else {
        codes[i * kPanel / 2 + j % 8] |= static_cast<uint8_t>(q << (j < 8 ? 0 : 4));
      }
    }
  }
}

// A GGUF tensor's rows (N, K / 32 * block bytes) in Q4_0, Q4_1, Q8_0, or re-cut (N, K / 32 or 256
// * unit bytes) -> panels (ceil(N / 16), K / 32 or 256, panel unit bytes), the last panel padded
// with zero scales.
at::Tensor pack_block_panels(at::Tensor rows, int64_t format, int64_t K, c10::optional<at::Tensor> out) {
#ifndef TOKENMILL_AVX2
  TM_CHECK(false, "pack_block_panels: the block formats need AVX2, FMA and F16C");
#endif
  TM_CHECK(block_format(format), "pack_block_panels: unknown format " + std::to_string(format));
  TM_CHECK(rows.dtype() == at::kByte && rows.dim() == 2 && K % unit_k(format) == 0 &&
               rows.size(1) == K / unit_k(format) * row_unit_bytes(format),
           "pack_block_panels: rows must be (N, K / 32 or 256 * unit bytes) uint8");
  const int64_t N = rows.size(0), P = (N + kPanel - 1) / kPanel, U = K / unit_k(format);
  const int64_t rb = row_unit_bytes(format), ub = unit_bytes(format);
  auto r = rows.contiguous();
  auto panels = panels_tensor(out, panel_shape(N, K, format), at::kByte);
  const uint8_t* src = r.data_ptr<uint8_t>();
  uint8_t* dst = panels.data_ptr<uint8_t>();
  const int64_t row_bytes = rows.size(1);
  // panel by panel, unit by unit, each panel unit written in order from its 16 rows' units (rows
  // past N stay zero: zero scales)
  at::parallel_for(0, P, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t rows_here = std::min(kPanel, N - p * kPanel);
      for (int64_t u = 0; u < U; ++u) {
        uint8_t* unit = dst + (p * U + u) * ub;
        const uint8_t* row_units[kPanel];
        for (int64_t j = 0; j < rows_here; ++j) {
          row_units[j] = src + (p * kPanel + j) * row_bytes + u * rb;
          put_scales(format, row_units[j], j, unit);
        }
        for (int64_t b = 0; b < unit_blocks(format); ++b) {
          const uint8_t* qs[kPanel];
          for (int64_t j = 0; j < rows_here; ++j) qs[j] = row_units[j] + row_codes_at(format) + b * row_block_codes(format);
          put_codes(format, qs, rows_here, unit + codes_at(format) + b * code_bytes(format));
        }
      }
    }
  });
  return panels;
}

// The bytes of a GGUF Q4_K, Q5_K or Q6_K super-block (format kQ4F, kQ5K or kQ6F), 256 weights.
constexpr int64_t k_quant_bytes(int64_t format) { return format == kQ4F ? 144 : format == kQ5K ? 176 : 210; }

// A GGUF Q4_K, Q5_K or Q6_K super-block (format kQ4F, kQ5K or kQ6F, what the kernels re-cut it
// into) -> its 256 codes in gguf's order of the values (Q6_K: 0..63, the value being q - 32);
// for Q4_K and Q5_K also each 32 values' 6-bit scale and min.
void k_quant_codes(int64_t format, const uint8_t* sb, uint8_t* q, uint8_t* scale, uint8_t* min) {
  if (format == kQ6F) {  // ql (128), qh (64), 16 int8 scales, fp16 d
    for (int g = 0; g < 2; ++g) {  // gguf's order: 128 values per half, from 64 bytes of ql, 32 of qh
      const uint8_t *ql = sb + g * 64, *qh = sb + 128 + g * 32;
      uint8_t* v = q + g * 128;
      for (int j = 0; j < 64; ++j) v[j] = ql[j] & 0x0F, v[64 + j] = ql[j] >> 4;
      for (int s = 0; s < 4; ++s) {
        for (int j = 0; j < 32; ++j) v[s * 32 + j] |= ((qh[j] >> (2 * s)) & 0x03) << 4;
      }
    }
    return;
  }
  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits,) nibbles
  const uint8_t* sc = sb + 4;
  const uint8_t* qs = sb + k_quant_bytes(format) - 128;
  for (int i = 0; i < 8; ++i) {
    scale[i] = i < 4 ? sc[i] & 0x3F : (sc[i + 4] & 0x0F) | ((sc[i - 4] >> 2) & 0x30);
    min[i] = i < 4 ? sc[i + 4] & 0x3F : (sc[i + 4] >> 4) | ((sc[i] >> 2) & 0x30);
  }
  for (int c = 0; c < 8; ++c) {  // sub-block c: nibbles of 32 bytes (c / 2), fifth bits at bit c
    const uint8_t* bytes = qs + c / 2 * 32;
    for (int j = 0; j < 32; ++j) q[c * 32 + j] = (bytes[j] >> (4 * (c % 2))) & 0x0F;
    if (format == kQ5K) {
      for (int j = 0; j < 32; ++j) q[c * 32 + j] |= ((sb[16 + j] >> c) & 0x01) << 4;
    }
  }
}

float half_at(const uint8_t* p) { return c10::detail::fp16_ieee_to_fp32_value(p[0] | p[1] << 8); }

// One GGUF block of a row -> its float32 values at o, with gguf's arithmetic; the formats as
// embed_rows takes them. Every product is exact, or one rounding of the same product as gguf's,
// so fused into an FMA or not the result has the same bits.
void dequantize_block(int64_t format, const uint8_t* blk, float* o) {
  if (format == kQ4F || format == kQ5K || format == kQ6F) {  // the K-quants: 256 values
    uint8_t q[256], scale[8], min[8];
    k_quant_codes(format, blk, q, scale, min);
    if (format == kQ6F) {  // (d * scale) * (q - 32), a scale per 16 values
      const float d = half_at(blk + 208);
      for (int e = 0; e < 256; ++e) {
        const float ds = d * static_cast<float>(static_cast<int8_t>(blk[192 + e / 16]));
        o[e] = ds * static_cast<float>(static_cast<int>(q[e]) - 32);
      }
      return;
    }
    const float d = half_at(blk), dmin = half_at(blk + 2);  // (d * scale) * q - dmin * min, per 32 values
    for (int e = 0; e < 256; ++e) {
      const float ds = d * static_cast<float>(scale[e / 32]), dm = dmin * static_cast<float>(min[e / 32]);
      o[e] = ds * static_cast<float>(q[e]) - dm;
    }
    return;
  }
  const float d = half_at(blk);
  if (format == kQ8_0) {
    for (int64_t i = 0; i < kBlock; ++i) o[i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
    return;
  }
  const float m = format == kQ4_1 ? half_at(blk + 2) : 0.0f;
  const uint8_t* codes = blk + (format == kQ4_1 ? 4 : 2);
  for (int64_t j = 0; j < kBlock / 2; ++j) {  // byte j: weight j in its low nibble, j + 16 in its high
    const int lo = codes[j] & 0x0F, hi = codes[j] >> 4;
    if (format == kQ4_0) {
      o[j] = static_cast<float>(lo - 8) * d, o[j + 16] = static_cast<float>(hi - 8) * d;
    } else {
      o[j] = d * static_cast<float>(lo) + m, o[j + 16] = d * static_cast<float>(hi) + m;
    }
  }
}

// GGUF rows (V, bytes) of Q4_0, Q4_1 or Q8_0 blocks (format 1-3), or of Q4_K, Q6_K or Q5_K
// super-blocks (format 4, 6, 7: the formats the panels re-cut them into), the ones at `ids`
// dequantized to float32 (T, K) with gguf's arithmetic (dequantize_block: the same bits, tested):
// the token-embedding lookup in a GGUF file's own rows, where gguf's numpy spends a batch-1 step's
// lookup mostly in per-call overhead (BENCHMARKS.md).
at::Tensor embed_rows(at::Tensor rows, at::Tensor ids, int64_t format) {
  TM_CHECK(rows.dtype() == at::kByte && rows.dim() == 2 && rows.is_contiguous(),
           "embed_rows: rows must be contiguous uint8 (V, bytes)");
  TM_CHECK(format >= kQ4_0 && format <= kQ5K && format != kQ5F,
           "embed_rows: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K or Q5_K only");
  TM_CHECK(ids.dtype() == at::kLong && ids.dim() == 1, "embed_rows: ids must be int64 (T,)");
  const bool k_quant = super_blocks(format);
  const int64_t V = rows.size(0), bytes = rows.size(1), values = k_quant ? 256 : kBlock;
  const int64_t block = k_quant ? k_quant_bytes(format) : row_unit_bytes(format);
  TM_CHECK(bytes % block == 0, "embed_rows: rows of whole blocks");
  const int64_t B = bytes / block, T = ids.size(0);
  const at::Tensor idx = ids.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TM_CHECK(ip[t] >= 0 && ip[t] < V, "embed_rows: token id " + std::to_string(ip[t]) + " out of range");
  }
  auto out = at::empty({T, B * values}, rows.options().dtype(at::kFloat));
  const uint8_t* rp = rows.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < B; ++b) dequantize_block(format, rp + ip[t] * bytes + b * block, op + (t * B + b) * values);
  }
  return out;
}

// Q4_K, Q5_K or Q6_K rows (N, K / 256 * super-block bytes) -> rows in the kernel's format Q4F, Q5K
// or Q6F (row_unit_bytes): what gguf_loader.k_quant_rows makes with numpy, byte for byte (tested),
// in one pass over the rows instead of numpy's several.
at::Tensor recut_k_quant(at::Tensor raw, int64_t format) {
  TM_CHECK(format == kQ4F || format == kQ5K || format == kQ6F, "recut_k_quant: format Q4F, Q5K or Q6F");
  const int64_t super_bytes = k_quant_bytes(format);
  TM_CHECK(raw.dtype() == at::kByte && raw.dim() == 2 && raw.size(1) % super_bytes == 0,
           "recut_k_quant: rows (N, K / 256 * super-block bytes) uint8");
  auto r = raw.contiguous();
  const int64_t supers = r.numel() / super_bytes, out_unit = row_unit_bytes(format);
  auto out = at::empty({raw.size(0), raw.size(1) / super_bytes * out_unit}, r.options());
  const uint8_t* src = r.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, supers, 64, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const uint8_t* sb = src + s * super_bytes;
      uint8_t* o = dst + s * out_unit;
      uint8_t q[256], scale[8], min[8];  // the codes in gguf's order of the values; Q4_K/Q5_K's 6-bit scales
      k_quant_codes(format, sb, q, scale, min);
      if (format == kQ6F) {  // ql (128), qh (64), 16 int8 scales, fp16 d -> d, the scales, q - 32
        std::memcpy(o, sb + 208, 2);
        std::memcpy(o + 2, sb + 192, 16);
        for (int e = 0; e < 256; ++e) o[18 + e] = static_cast<uint8_t>(static_cast<int8_t>(q[e]) - 32);
        continue;
      }
      // d, dmin, the scales, the mins, then the codes: Q5K's bytes, or per block Q4_1's nibbles
      // (byte j holds weight j and weight j + 16)
      std::memcpy(o, sb, 4);
      std::memcpy(o + 4, scale, 8);
      std::memcpy(o + 12, min, 8);
      if (format == kQ5K) {
        std::memcpy(o + 20, q, 256);
        continue;
      }
      for (int i = 0; i < 8; ++i) {
        for (int j = 0; j < kBlock / 2; ++j) o[20 + i * 16 + j] = q[i * kBlock + j] | q[i * kBlock + j + 16] << 4;
      }
    }
  });
  return out;
}

// y = x @ W.T + bias for x (M, K), with W given as panels from pack_panels (format 0, or 9 for
// bfloat16) or pack_block_panels (formats 1-8) and N its row count. With `out` (M, N), rows any distance
// apart, y is written there: a column range of a wider output (a fused projection whose parts
// came in different block formats).
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t N,
                        int64_t format, c10::optional<at::Tensor> out, int64_t int8_rows) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TM_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "panel_linear: x must be a float32 matrix");
#ifndef TOKENMILL_BF16
  TM_CHECK(format != kBF16, "panel_linear: bfloat16 panels need AVX512-BF16");
#endif
#ifndef TOKENMILL_AVX2
  TM_CHECK(!block_format(format), "panel_linear: the block formats need AVX2, FMA and F16C");
#endif
  TM_CHECK((format == kFloat32 || format == kBF16 || block_format(format)) && panels.is_contiguous() &&
               panels.dtype() == (format == kFloat32 ? at::kFloat : at::kByte) &&
               panels.sizes() == c10::IntArrayRef(panel_shape(N, K, format)),
           "panel_linear: panels of an (N, K) matrix in format " + std::to_string(format) +
               " expected (float32 (P, K, 16), bfloat16 (P, K / 2, 64), block panels (P, K / 32 or 256, unit bytes))");
  auto xc = x.contiguous();
  const float* b = nullptr;
  if (bias.has_value()) {
    TM_CHECK(bias->is_contiguous() && bias->numel() == N, "panel_linear: bias shape");
    b = bias->data_ptr<float>();
  }
  if (out.has_value()) {
    TM_CHECK(out->dtype() == at::kFloat && out->dim() == 2 && out->size(0) == M && out->size(1) == N &&
                 out->stride(1) == 1 && (M <= 1 || out->stride(0) >= N),
             "panel_linear: out must be a float32 (M, N) matrix with contiguous rows");
  }
  auto y = out.has_value() ? *out : at::empty({M, N}, x.options());
  const int64_t ldy = y.stride(0);
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const tokenmill::PanelOut o{yp, ldy, N, b, nullptr};
  if (format != kFloat32) {  // a panel at a time, each over every row
    const tokenmill::PanelRows rows = tokenmill::panel_rows(xp, M, K, format, int8_rows);
    const uint8_t* wp = static_cast<const uint8_t*>(panels.data_ptr());
    const int64_t stride = tokenmill::panel_stride(K, format);
    tokenmill::parallel_chunks(P, rows.in_8_bits() ? 0 : panel_chunk(M), [&](tokenmill::ThreadChunks& chunks) {
      tokenmill::PanelScratch scratch(K, tokenmill::decodes_panels(rows, format));
      for (int64_t begin, end; chunks.next(begin, end);)
      for (int64_t p = begin; p < end; ++p) {
        const uint8_t* next = chunks.comes_next(p + 1, end) ? wp + (p + 1) * stride : nullptr;
        tokenmill::run_panel(rows, wp + p * stride, format, p, next, scratch, o);
      }
    });
    return y;
  }
  // float32: a block of rows at a time, so that it stays in cache while the panels stream past
  const float* wp = panels.data_ptr<float>();
  for (int64_t block = 0; block < M; block += kRowBlock) {
    const int64_t block_end = std::min(M, block + kRowBlock);
    tokenmill::parallel_chunks(P, panel_chunk(block_end - block), [&](tokenmill::ThreadChunks& chunks) {
      float tile[kWideRows * kPanel];
      for (int64_t begin, end; chunks.next(begin, end);)
      for (int64_t p = begin; p < end; ++p) {
        const float* next = chunks.comes_next(p + 1, end) ? wp + (p + 1) * K * kPanel : nullptr;
        float_panel(xp, block, block_end, K, wp + p * K * kPanel, next, tile, o, p);
      }
    });
  }
  return y;
}
