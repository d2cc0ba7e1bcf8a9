// One panel of a panel product at a time (gemm_cpu.cpp), for callers that share out the panels
// of several products among the threads themselves: a layer's routed experts (moe_cpu.cpp) run
// every chosen expert's panels in one parallel region. panel_linear runs its own panels through
// the same run_panel, so a panel computed either way gives the same bits.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace tokenmill {

// One row of x in 8-bit blocks, laid out for the 8-bit tiles' two inner loops where the build has
// no 512-bit VNNI (gemm_cpu.cpp): views into the arena of the PanelRows that holds it.
struct Int8Row {
  float* scale;    // per block of 32 k: dx
  float* sum;      // per block: dx * sum(xq), for the offsets
  int32_t* qsum;   // per block: sum(xq), for Q4_0 (its values are d * (q - 8))
  int8_t* bytes;   // xq as it is (the VNNI tiles read four k at a time)
  int16_t* words;  // for vpmaddwd's byte tile: xq widened to int16, each int32 a pair (xq[2i], xq[2i + 1]);
                   // else null
  uint8_t* quads;  // nibbles without VNNI: per four k, 32 bytes: the pair (xq[4i], xq[4i + 1]) eight
                   // times, then (xq[4i + 2], xq[4i + 3]) eight times; else null
};

// The rows of one pass of the 512-bit 8-bit tile (gemm_cpu.cpp) in 8-bit blocks, interleaved, so
// that the tile addresses all of them from one pointer: a row's own pointers (as Int8Row's) are
// more than the registers left, and reloading them cost it a load beside each broadcast of x.
struct Int8Pass {
  int64_t m0, n;       // rows [m0, m0 + n) of x
  int8_t* bytes;       // per block of 32 k, per four k: the n rows' four bytes one after another
  float* scale;        // per block: the n rows' dx side by side, as are
  float* sum;          //   dx * sum(xq),
  int32_t* qsum;       //   sum(xq)
  int32_t* half_qsum;  //   and, per 16 k, their halves, for Q6F (its halves' own scales; else null)
};

// The rows of x one product reads: M rows of K floats, contiguous; for block panels in a step of
// up to int8_rows rows, the same rows in 8-bit blocks too (then the product reads those), for
// bf16 panels in bfloat16. All rows' blocks sit in one arena: one allocation a product, not a few
// per row.
struct PanelRows {
  const float* x;
  int64_t M, K;
  std::vector<Int8Row> int8;     // without the 512-bit tile: the rows in 8-bit blocks, or none
  std::vector<Int8Pass> passes;  // with the 512-bit tile: the rows in 8-bit blocks, pass by pass, or none
  uint16_t* bf16 = nullptr;      // for bf16 panels: the rows rounded to bfloat16, M x K
  bool amx = false;              // bf16 rows the panels multiply on AMX tiles (then padded with zero rows)
  std::unique_ptr<uint8_t[]> arena;

  PanelRows(const float* x, int64_t M, int64_t K) : x(x), M(M), K(K) {}
  PanelRows(PanelRows&&) = default;  // the arena moves with its views
  PanelRows(const PanelRows&) = delete;
  bool in_8_bits() const { return !int8.empty() || !passes.empty(); }  // else x in float32 (or bf16)
};
// With `fill` false the rows are laid out but not yet computed: fill_panel_row(rows, m) computes
// row m from x's (a caller that makes x's rows one by one), fill_panel_rows all of them.
PanelRows panel_rows(const float* x, int64_t M, int64_t K, int64_t format, int64_t int8_rows, bool fill = true);
void fill_panel_row(const PanelRows& rows, int64_t m);
void fill_panel_rows(const PanelRows& rows);
// Whether a product of M rows over panels in `format` takes x in 8-bit blocks (panel_rows).
bool takes_int8(int64_t format, int64_t M, int64_t int8_rows);
// The rows picks[0..M) of `source` (rows in 8-bit blocks), for a product that reads only those:
// their blocks shared with source, which must outlive them (with the 512-bit tile copied into
// passes of their own), not computed again.
PanelRows gather_panel_rows(const PanelRows& source, const int64_t* picks, int64_t M);

// Where a panel's outputs go: columns [16 p, 16 p + 16) of y (N columns, rows ldy floats apart),
// plus bias[n] where given, then times row_scale[m] where given: y = (x @ W.T + b) * scale.
struct PanelOut {
  float* y;
  int64_t ldy, N;
  const float* bias;
  const float* row_scale;
};

// The most outputs a pass holds: AMX's two tiles of sums (gemm_cpu.cpp checks it).
constexpr int64_t kMostTileFloats = 32 * 16;

// What one thread needs to run panels: a tile of outputs, and where `decode` a 64-byte aligned
// buffer for a panel of K k decoded to float32 (steps too big to decode in registers), or for
// its 6-bit codes spread out (gemm_cpu.cpp's spread_six_bits).
class PanelScratch {
 public:
  PanelScratch(int64_t K, bool decode) : buffer_(decode ? K * 16 + 16 : 0) {}
  float* decoded() {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer_.data()) + 63) & ~uintptr_t{63});
  }
  float tile[kMostTileFloats];

 private:
  std::vector<float> buffer_;
};

// Bytes from one panel to the next of a (N, K) matrix's panels in `format` (0: float32, 9: bfloat16).
int64_t panel_stride(int64_t K, int64_t format);
// Whether running panels over `x` needs PanelScratch's decode buffer.
bool decodes_panels(const PanelRows& x, int64_t format);
// The fewest rows of a step whose bf16 panels multiply on AMX tiles; 0 where they never do (a
// build without AMX-BF16, or Linux refused the tiles' state).
int64_t amx_min_rows();
// Panels per take when threads share out the panels of products of up to `rows` rows (parallel.h).
int64_t panel_chunk_for(int64_t rows);
// Panel p (at `panel`) times every row of x into `out`; `next`, the panel this thread is likely to
// run next (or nullptr), is prefetched meanwhile.
void run_panel(const PanelRows& x, const uint8_t* panel, int64_t format, int64_t p, const uint8_t* next,
               PanelScratch& scratch, const PanelOut& out);

}  // namespace tokenmill
