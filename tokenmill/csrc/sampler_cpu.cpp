// The CPU sampler's sampled rows in one call: temperature, top-k, top-p and min-p, then one draw,
// each row in a few passes over its logits and without sorting it.
//
// In torch (sampler.py) a row took a division, a softmax and a two-level draw, each a few passes
// and a temporary of the row's size, plus topk/sort calls for top-k and top-p: a noticeable part of
// a batch-1 decode step for one row of the default model's logits at temperature 1, and a large
// part of the step for 64 rows with top-p over flat distributions (sets of thousands of tokens;
// BENCHMARKS.md, "Speed work, every attempt (CPU, default model)").
//
// The kept set of a row is defined by values, never by positions in a sort, so ties are kept
// together and the set depends on the row alone (a seeded request draws the same alone or in a
// batch): with s = logits / temperature and e = exp(s - max s),
//   top-k: s >= the k-th largest s;
//   top-p: among those, every token whose strictly larger tokens hold less than top_p of their
//          mass (the smallest set of best tokens reaching top_p, ties with its last token kept);
//   min-p: e >= min_p (its probability at least min_p times the best token's).
// Then the token is the first whose running sum of e over the kept set passes u times their total.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_ops.h"
#include "parallel.h"
#include "simd.h"

namespace {

constexpr int64_t kSortMax = 512;    // candidates few enough to sort; more are cut by a histogram
constexpr int64_t kBins = 1024;      // histogram bins, by value
constexpr int64_t kDrawBlock = 256;  // tokens per block of the draw's first level
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Candidate {
  float s, e;
};

// A row's scratch, one per thread: its s and e, and room for all of its tokens as candidates (not
// zeroed: 1.2 MB for the default model's rows, whose clearing took much of a row's time at temperature 1).
struct RowBuffers {
  std::unique_ptr<float[]> s, e;
  std::unique_ptr<Candidate[]> candidates, copy;
  std::vector<double> blocks;
  explicit RowBuffers(int64_t V)
      : s(new float[V]), e(new float[V]), candidates(new Candidate[V]), copy(new Candidate[V]) {}
};

// Bins by value, largest first: floor((hi - s) * scale), monotone in s, so every value of a bin is
// at least every value of the bins after it; the largest value is in bin 0, the smallest in the
// last. In double: a float scale overflows for values a few ulps apart near 0.
struct Bins {
  double hi, scale;
  Bins(float lo, float hi_) : hi(hi_), scale(static_cast<double>(kBins) / (static_cast<double>(hi_) - lo)) {}
  int64_t operator()(float s) const { return std::min<int64_t>(kBins - 1, static_cast<int64_t>((hi - s) * scale)); }
};

// c[0, n) cut, in place, to the candidates of the bin `pick` chooses from the bins' counts or
// masses (pick(counts, masses) -> bin; the masses are summed only when kMasses), while there are
// more than kSortMax; returns the new n, or 0 when all values are equal (nothing left to cut:
// c[0].s is the answer).
template <bool kMasses, class Pick>
int64_t cut_to_bin(Candidate* c, int64_t n, Pick pick) {
  std::vector<int64_t> counts(kBins);
  std::vector<double> masses(kBins);
  while (n > kSortMax) {
    float lo = c[0].s, hi = c[0].s;
    for (int64_t i = 1; i < n; ++i) lo = std::min(lo, c[i].s), hi = std::max(hi, c[i].s);
    if (lo == hi) return 0;
    const Bins bin(lo, hi);
    std::fill(counts.begin(), counts.end(), 0);
    std::fill(masses.begin(), masses.end(), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = bin(c[i].s);
      ++counts[b];
      if constexpr (kMasses) masses[b] += c[i].e;
    }
    const int64_t b = pick(counts, masses);
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      c[m] = c[i];
      m += bin(c[i].s) == b;
    }
    n = m;
  }
  return n;
}

// The k-th largest value among c[0, n) (1 <= k <= n), which it reorders and overwrites.
float kth_value(Candidate* c, int64_t n, int64_t k) {
  n = cut_to_bin<false>(c, n, [&k](const std::vector<int64_t>& counts, const std::vector<double>&) {
    int64_t b = 0;
    for (; k > counts[b]; ++b) k -= counts[b];
    return b;
  });
  if (n == 0) return c[0].s;
  std::nth_element(c, c + (k - 1), c + n, [](const Candidate& a, const Candidate& b) { return a.s > b.s; });
  return c[k - 1].s;
}

// The smallest value that top-p keeps among c[0, n), which it reorders and overwrites: the last
// value (largest first, equal values as one) whose strictly larger candidates hold less than
// `mass` of e.
float mass_threshold(Candidate* c, int64_t n, double mass) {
  n = cut_to_bin<true>(c, n, [&mass](const std::vector<int64_t>&, const std::vector<double>& masses) {
    // the last bin whose larger bins hold less than the mass: all before it kept, all after dropped
    int64_t b = 0;
    while (b + 1 < kBins && masses[b] < mass) mass -= masses[b++];
    return b;
  });
  if (n == 0) return c[0].s;
  std::sort(c, c + n, [](const Candidate& a, const Candidate& b) { return a.s > b.s; });
  float kept = c[0].s;
  double before = 0.0;  // mass of the candidates larger than c[i]
  for (int64_t i = 0; i < n && before < mass;) {
    kept = c[i].s;
    for (; i < n && c[i].s == kept; ++i) before += c[i].e;
  }
  return kept;
}

// take(j) for the tokens j of a row in order: every one with s[j] >= floor, and maybe others
// (take checks). Few pass: with AVX2 most groups of eight are skipped whole. `floor` is read
// anew for each group, so a take that raises it skips more.
template <class Take>
void scan_at_or_above(const float* s, int64_t V, const float& floor, Take take) {
  int64_t i = 0;
#ifdef TOKENMILL_AVX2
  for (; i + 8 <= V; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(floor), _CMP_GE_OQ));
    for (; mask != 0; mask &= mask - 1) take(i + __builtin_ctz(mask));
  }
#endif
  for (; i < V; ++i) take(i);
}

// The tokens with s >= floor and e > 0 (s finite), as candidates into out (room for V); returns
// how many.
int64_t gather(const float* s, const float* e, int64_t V, float floor, Candidate* out) {
  int64_t n = 0;
  scan_at_or_above(s, V, floor, [&](int64_t j) {
    out[n] = {s[j], e[j]};
    n += s[j] >= floor && e[j] > 0.0f;
  });
  return n;
}

// The k-th largest s of a row (-inf when it has fewer than k finite ones), in one pass that
// keeps only the tokens at or above a floor, raised to the k-th largest of those kept whenever
// they pile up.
float top_k_floor(const float* s, const float* e, int64_t V, int64_t k, RowBuffers& buf) {
  Candidate* kept = buf.candidates.get();
  int64_t n = 0, limit = std::max<int64_t>(2 * k, 1024);
  float floor = kNegInf;
  scan_at_or_above(s, V, floor, [&](int64_t j) {
    if (!(s[j] >= floor && e[j] > 0.0f)) return;
    kept[n++] = {s[j], e[j]};
    if (n < limit) return;
    std::copy(kept, kept + n, buf.copy.get());
    floor = kth_value(buf.copy.get(), n, k);
    n = std::remove_if(kept, kept + n, [floor](const Candidate& c) { return c.s < floor; }) - kept;
    limit = std::max(limit, 2 * n);  // many ties at the floor: not a compaction at every token
  });
  return n >= k ? kth_value(kept, n, k) : kNegInf;
}

// Total e of the tokens with s >= floor and e >= min_e; by blocks of kDrawBlock tokens too, into
// `blocks`, when given.
double kept_mass(const float* s, const float* e, int64_t V, float floor, float min_e, std::vector<double>* blocks) {
  if (blocks != nullptr) blocks->assign((V + kDrawBlock - 1) / kDrawBlock, 0.0);
  double total = 0.0;
  for (int64_t b = 0; b * kDrawBlock < V; ++b) {
    const int64_t end = std::min(V, (b + 1) * kDrawBlock);
    int64_t i = b * kDrawBlock;
    double sum = 0.0;
#ifdef TOKENMILL_AVX2
    const __m256 fv = _mm256_set1_ps(floor), mv = _mm256_set1_ps(min_e);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; i + 8 <= end; i += 8) {
      const __m256 ev = _mm256_loadu_ps(e + i);
      const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), fv, _CMP_GE_OQ),
                                        _mm256_cmp_ps(ev, mv, _CMP_GE_OQ));
      const __m256 kept = _mm256_and_ps(keep, ev);
      a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(kept)));
      a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1)));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
    sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
    for (; i < end; ++i)
      if (s[i] >= floor && e[i] >= min_e) sum += e[i];
    if (blocks != nullptr) (*blocks)[b] = sum;
    total += sum;
  }
  return total;
}

// s = logits / temperature and e = exp(s - max s) into the row's buffers: 0 for s = -inf, and
// for finite s at least exp(-87) (exp256's clamp, here in both paths), so e > 0 exactly where s
// is finite. Returns max s, or NaN when the row holds a NaN.
float scale_and_exp(const float* logits, int64_t V, float temperature, float* s, float* e) {
  int64_t i = 0;
#ifdef TOKENMILL_AVX2
  for (const __m256 tv = _mm256_set1_ps(temperature); i + 8 <= V; i += 8)
    _mm256_storeu_ps(s + i, _mm256_div_ps(_mm256_loadu_ps(logits + i), tv));
#endif
  for (; i < V; ++i) s[i] = logits[i] / temperature;
  bool nan;
  const float mx = row_max(s, V, &nan);
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  i = 0;
#ifdef TOKENMILL_AVX2
  const __m256 mv = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(kNegInf);
  for (; i + 8 <= V; i += 8) {
    const __m256 sv = _mm256_loadu_ps(s + i);
    const __m256 ev = tokenmill::exp256(_mm256_sub_ps(sv, mv));  // clamped: -inf would give 1e-38
    _mm256_storeu_ps(e + i, _mm256_andnot_ps(_mm256_cmp_ps(sv, ninf, _CMP_EQ_OQ), ev));
  }
#endif
  for (; i < V; ++i) e[i] = s[i] == kNegInf ? 0.0f : std::exp(std::max(s[i] - mx, -87.0f));
  return mx;
}

struct RowParams {
  float temperature;
  int64_t top_k;  // >= V: off
  float top_p;    // 1: off
  float min_p;    // 0: off
};

// One sampled row: its token for u in [0, 1), and in *floor_out the smallest s it may keep (min-p
// may drop more).
int64_t sample_row(const float* logits, int64_t V, const RowParams& p, double u, RowBuffers& buf, float* floor_out) {
  const float* s = buf.s.get();
  const float* e = buf.e.get();
  const float mx = scale_and_exp(logits, V, p.temperature, buf.s.get(), buf.e.get());
  *floor_out = kNegInf;
  // a NaN, nothing to draw from (all -inf), or +inf (a logit, or a temperature so small that s
  // overflows; e would be NaN): torch.argmax's answer, the limit of a vanishing temperature
  if (!std::isfinite(mx)) return row_argmax(logits, V);
  float floor = p.top_k < V ? top_k_floor(s, e, V, p.top_k, buf) : kNegInf;
  if (p.top_p < 1.0f) {
    const double mass = static_cast<double>(p.top_p) * kept_mass(s, e, V, floor, 0.0f, nullptr);
    // the best tokens often hold that mass: then only they are candidates (e >= 2^-10, else 2^-20)
    float near = floor;
    for (const float nats : {6.931472f, 13.862944f}) {
      if (mx - nats > floor && kept_mass(s, e, V, mx - nats, 0.0f, nullptr) >= mass) {
        near = mx - nats;
        break;
      }
    }
    floor = mass_threshold(buf.candidates.get(), gather(s, e, V, near, buf.candidates.get()), mass);
  }
  *floor_out = floor;
  // e > 0 always: -inf tokens are never drawn
  const float min_e = p.min_p > 0.0f ? p.min_p : std::numeric_limits<float>::min();
  std::vector<double>& blocks = buf.blocks;
  const double x = u * kept_mass(s, e, V, floor, min_e, &blocks);
  // the block where the running sum passes x (never one without mass), then the token inside it
  double before = 0.0;
  int64_t b = 0;
  const int64_t last_block = static_cast<int64_t>(blocks.size()) - 1;
  while (b < last_block && (blocks[b] == 0.0 || before + blocks[b] <= x)) before += blocks[b++];
  while (b > 0 && blocks[b] == 0.0) before -= blocks[--b];  // x past every block's sum: the last with mass
  double run = before;
  int64_t last = -1;
  for (int64_t i = b * kDrawBlock, end = std::min(V, i + kDrawBlock); i < end; ++i) {
    if (!(s[i] >= floor && e[i] >= min_e)) continue;
    last = i;
    run += e[i];
    if (run > x) break;
  }
  return last;  // the block's last kept token where rounding left x past its sum
}

}  // namespace

at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, c10::optional<at::Tensor> top_k,
                       c10::optional<at::Tensor> top_p, c10::optional<at::Tensor> min_p, at::Tensor u,
                       c10::optional<at::Tensor> floors) {
  check_rows(logits, "sample_rows(logits)");
  const int64_t S = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  TM_CHECK(V > 0, "sample_rows: empty rows");
  const auto per_row = [S](const c10::optional<at::Tensor>& t, at::ScalarType dtype, const char* name) {
    if (!t.has_value()) return at::Tensor();
    TM_CHECK(t->dim() == 1 && t->size(0) == S && t->scalar_type() == dtype,
             std::string("sample_rows: ") + name + " must be one " + c10::toString(dtype) + " per row");
    return t->contiguous();
  };
  const at::Tensor temps = per_row(temperature, at::kFloat, "temperature");
  const at::Tensor us = per_row(u, at::kDouble, "u");
  const at::Tensor ks = per_row(top_k, at::kLong, "top_k"), ps = per_row(top_p, at::kFloat, "top_p");
  const at::Tensor mps = per_row(min_p, at::kFloat, "min_p"), fl = per_row(floors, at::kFloat, "floors");
  TM_CHECK(!floors.has_value() || floors->is_contiguous(), "sample_rows: floors must be contiguous");
  for (int64_t r = 0; r < S; ++r) {  // what the selection and the draw rely on
    const float t = temps.data_ptr<float>()[r];
    const double x = us.data_ptr<double>()[r];
    TM_CHECK(t >= 0.0f, "sample_rows: temperature must be >= 0");
    TM_CHECK(x >= 0.0 && x < 1.0, "sample_rows: u must be in [0, 1)");
    TM_CHECK(!ks.defined() || ks.data_ptr<int64_t>()[r] >= 1, "sample_rows: top_k must be >= 1");
    TM_CHECK(!ps.defined() || (ps.data_ptr<float>()[r] > 0.0f && ps.data_ptr<float>()[r] <= 1.0f),
             "sample_rows: top_p must be in (0, 1]");
    TM_CHECK(!mps.defined() || (mps.data_ptr<float>()[r] >= 0.0f && mps.data_ptr<float>()[r] <= 1.0f),
             "sample_rows: min_p must be in [0, 1]");
  }
  auto out = at::empty({S}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  tokenmill::parallel_chunks(S, 1, [&](tokenmill::ThreadChunks& chunks) {
    RowBuffers buf(V);
    for (int64_t begin, end; chunks.next(begin, end);)
      for (int64_t r = begin; r < end; ++r) {
        const float t = temps.data_ptr<float>()[r];
        float floor = kNegInf;
        if (t == 0.0f) {  // greedy
          op[r] = row_argmax(lp + r * stride, V);
        } else {
          const RowParams p{t, ks.defined() ? ks.data_ptr<int64_t>()[r] : V,
                         ps.defined() ? ps.data_ptr<float>()[r] : 1.0f,
                         mps.defined() ? mps.data_ptr<float>()[r] : 0.0f};
          op[r] = sample_row(lp + r * stride, V, p, us.data_ptr<double>()[r], buf, &floor);
        }
        if (fl.defined()) fl.data_ptr<float>()[r] = floor;
      }
  });
  return out;
}
