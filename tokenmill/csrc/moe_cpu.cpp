// A layer's routed experts in one call: the grouped computation of models/moe.py's
// SparseMoeBlock._routed_experts (rows grouped by expert, each chosen expert's SwiGLU MLP over
// its run of rows, each token's weighted outputs added in the order of its experts) without a
// call from Python per expert product.
//
//   (token, slot) pairs, T * k    grouped by expert:  e0 e0 | e2 | e3 e3 e3 | ...
//   gate_up    one parallel region over (chosen expert, panel) pairs   -> (T * k, 2 * width)
//     silu_mul   an expert's rows, by the thread that wrote its last panel, in the same region,
//                with down's 8-bit rows of them                       -> (T * k, width)
//   down       one parallel region over (chosen expert, panel) pairs, each row times its weight
//   sum        each token's k rows, in ascending expert order          -> (T, hidden)
//
// Where gate_up takes x in 8-bit blocks, each token's blocks are made once, for all k of its
// experts (gather_panel_rows).
// A batch-1 step of a 128-expert, top-8 model makes 16 products of one row each, too small to
// keep two threads busy one at a time: here the two threads share all 8 experts' panels, with
// stealing (parallel.h), and each prefetches the next panel it will run, across experts too.
// Each panel runs as panel_linear runs it (panel_gemm.h), so the outputs are the per-expert
// products' bits, and the weighting and sums are the Python path's float32 operations in its order
// (tested equal). Before it, `route` picks each token's experts and weights from the router's logits
// in plain loops (route in models/moe.py is the torch reference), used by the Python layer and the
// C++ one alike.
#include "moe_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>

#include "cpu_ops.h"
#include "panel_gemm.h"
#include "parallel.h"
#include "simd.h"

namespace {

constexpr int64_t kPanel = 16;  // output features per panel
// Panels per take for small steps. A thread's first take would otherwise be three quarters of
// its range (parallel.h), three of the eight experts at batch 1, which the other thread cannot
// steal while the first waits for its core (on a shared machine, often); taken 16 at a time
// (a few microseconds of work each), a stalled thread holds back at most that.
constexpr int64_t kSmallChunk = 16;

// The panels' data as a table of pointers, each checked to be a (N, K) matrix's panels in `format`.
std::vector<const uint8_t*> panel_table(const std::vector<at::Tensor>& panels, int64_t format, int64_t N,
                                        int64_t K, const char* name) {
  std::vector<const uint8_t*> table;
  const auto shape = panel_shape(N, K, format);
  for (const auto& t : panels) {
    TM_CHECK(t.is_contiguous() && t.sizes() == c10::IntArrayRef(shape) &&
                 t.dtype() == (format == 0 ? at::kFloat : at::kByte),
             std::string("MoeExperts: every expert's ") + name + " must be panels of its shape in format " +
                 std::to_string(format));
    table.push_back(static_cast<const uint8_t*>(t.data_ptr()));
  }
  return table;
}

}  // namespace

CpuMoeExperts::CpuMoeExperts(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
                             int64_t gate_up_format, int64_t down_format, int64_t hidden, int64_t width)
    : gate_up_(std::move(gate_up)), down_(std::move(down)), gate_up_format_(gate_up_format),
      down_format_(down_format), hidden_(hidden), width_(width) {
  TM_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(), "MoeExperts: one gate_up and one down per expert");
  gate_up_panels_ = panel_table(gate_up_, gate_up_format_, 2 * width_, hidden_, "gate_up");
  down_panels_ = panel_table(down_, down_format_, hidden_, width_, "down");
}

// Each group's rows (x[a], K wide, as its product reads them) times its expert's panels (of an
// (N, K) matrix) into y (R, N), row r times row_scale[r] where given: one parallel region over
// (group, panel) pairs. Where given, group_done(a) runs as soon as group a's rows of y are all
// written, on the thread that wrote its last panel.
void CpuMoeExperts::project(const std::vector<const uint8_t*>& panels, int64_t format,
                            const std::vector<tokenmill::PanelRows>& x, int64_t K, float* y, int64_t N,
                            const std::vector<Group>& groups, const float* row_scale,
                            const std::function<void(size_t)>& group_done) const {
  const int64_t P = (N + kPanel - 1) / kPanel, stride = tokenmill::panel_stride(K, format);
  const int64_t items = static_cast<int64_t>(groups.size()) * P;
  int64_t most = 0;
  bool decode = false;
  for (size_t a = 0; a < groups.size(); ++a) {
    most = std::max(most, groups[a].count);
    decode = decode || tokenmill::decodes_panels(x[a], format);
  }
  // each group's panels written so far, counted only for group_done
  std::unique_ptr<std::atomic<int64_t>[]> done(group_done ? new std::atomic<int64_t>[groups.size()] : nullptr);
  for (size_t a = 0; done && a < groups.size(); ++a) done[a].store(0, std::memory_order_relaxed);
  const int64_t chunk = tokenmill::panel_chunk_for(most) > 0 ? tokenmill::panel_chunk_for(most) : kSmallChunk;
  tokenmill::parallel_chunks(items, chunk, [&](tokenmill::ThreadChunks& chunks) {
    tokenmill::PanelScratch scratch(K, decode);
    for (int64_t begin, end; chunks.next(begin, end);)
    for (int64_t i = begin; i < end; ++i) {
      const int64_t a = i / P, p = i % P;
      const Group& g = groups[a];
      const uint8_t* panel = panels[g.expert] + p * stride;
      const uint8_t* next = nullptr;  // the next item's panel: this expert's next, or the next expert's first
      if (i + 1 < items && chunks.comes_next(i + 1, end)) next = p + 1 < P ? panel + stride : panels[groups[a + 1].expert];
      const tokenmill::PanelOut out{y + g.start * N, N, N, nullptr, row_scale ? row_scale + g.start : nullptr};
      tokenmill::run_panel(x[a], panel, format, p, next, scratch, out);
      // the last panel's writer sees every other writer's panels (acquire-release)
      if (group_done && done[a].fetch_add(1, std::memory_order_acq_rel) == P - 1) group_done(a);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> CpuMoeExperts::route(at::Tensor logits, int64_t k, bool renormalise) {
  check_rows(logits, "MoeExperts.route(logits)");
  const int64_t T = logits.size(0), E = logits.size(1), stride = logits.stride(0);
  TM_CHECK(k >= 1 && k <= E, "MoeExperts.route: k must be 1 to the number of experts");
  auto weights = at::empty({T, k}, logits.options());
  auto ids = at::empty({T, k}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(E);
    for (int64_t t = begin; t < end; ++t) {
      float most;
      std::copy(lp + t * stride, lp + t * stride + E, probs.begin());
      const float sum = tokenmill::softmax_numerator(probs.data(), E, &most);
      for (float& p : probs) p /= sum;
      int64_t* top = ip + t * k;  // the most probable so far, in descending order (ties: lower id first)
      int64_t n = 0;
      for (int64_t e = 0; e < E; ++e) {
        const float p = probs[e];
        if (n == k && !(p > probs[top[k - 1]])) continue;
        int64_t j = std::min(n, k - 1);  // insert, dropping the last when all k are taken
        for (; j > 0 && p > probs[top[j - 1]]; --j) top[j] = top[j - 1];
        top[j] = e, n = std::min(n + 1, k);
      }
      float chosen = 0.0f;
      for (int64_t j = 0; j < k; ++j) chosen += wp[t * k + j] = probs[top[j]];
      if (renormalise)
        for (int64_t j = 0; j < k; ++j) wp[t * k + j] /= chosen;
    }
  });
  return {weights, ids};
}

at::Tensor CpuMoeExperts::forward(at::Tensor x, at::Tensor experts, at::Tensor weights) const {
  check_rows(x, "MoeExperts(x)");
  const int64_t T = x.size(0), E = static_cast<int64_t>(gate_up_.size());
  TM_CHECK(x.size(1) == hidden_, "MoeExperts: x must have the experts' hidden size");
  TM_CHECK(experts.dtype() == at::kLong && experts.dim() == 2 && experts.size(0) == T,
           "MoeExperts: experts must be int64 (T, k)");
  TM_CHECK(weights.dtype() == at::kFloat && weights.sizes() == experts.sizes(),
           "MoeExperts: weights must be float32, of the experts' shape");
  const auto xc = x.contiguous(), ids = experts.contiguous(), w = weights.contiguous();
  const int64_t k = ids.size(1), R = T * k, H = hidden_;
  const int64_t* id = ids.data_ptr<int64_t>();
  // the pairs grouped by expert, in pair order within an expert (as a stable sort by expert)
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < R; ++i) {
    TM_CHECK(id[i] >= 0 && id[i] < E, "MoeExperts: expert id " + std::to_string(id[i]) + " out of range");
    ++start[id[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> row_of(R), cursor(start.begin(), start.end() - 1);  // row_of: pair -> its grouped row
  for (int64_t i = 0; i < R; ++i) row_of[i] = cursor[id[i]]++;
  std::vector<Group> groups;
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1] > start[e]) groups.push_back({e, start[e], start[e + 1] - start[e]});
  }
  std::vector<float> scale(R);       // each grouped row's weight
  std::vector<int64_t> token_of(R);  // each grouped row's token
  const float *xp = xc.data_ptr<float>(), *wp = w.data_ptr<float>();
  for (int64_t i = 0; i < R; ++i) scale[row_of[i]] = wp[i], token_of[row_of[i]] = i / k;
  // gate_up's rows: where they take x in 8-bit blocks, each token's blocks made once and shared by
  // its k experts' products; else x's rows copied into their grouped order
  const bool shared = tokenmill::takes_int8(gate_up_format_, T, int8_rows);
  const tokenmill::PanelRows tokens =
      shared ? tokenmill::panel_rows(xp, T, H, gate_up_format_, int8_rows) : tokenmill::PanelRows(nullptr, 0, H);
  std::vector<tokenmill::PanelRows> gate_up_x;
  at::Tensor rows;
  if (shared) {
    for (const Group& g : groups)
      gate_up_x.push_back(tokenmill::gather_panel_rows(tokens, &token_of[g.start], g.count));
  } else {
    rows = at::empty({R, H}, xc.options());  // (T * k, hidden) grouped by expert
    float* rp = rows.data_ptr<float>();
    at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) std::memcpy(rp + r * H, xp + token_of[r] * H, H * sizeof(float));
    });
    for (const Group& g : groups)
      gate_up_x.push_back(tokenmill::panel_rows(rp + g.start * H, g.count, H, gate_up_format_, int8_rows));
  }
  // gate_up, then each group's silu(gate) * up and down's rows of it made by the thread that
  // finishes the group's gate_up, in the same region
  auto gate_up = at::empty({R, 2 * width_}, xc.options());
  auto h = at::empty({R, width_}, xc.options());
  float *gp = gate_up.data_ptr<float>(), *hp = h.data_ptr<float>();
  std::vector<tokenmill::PanelRows> down_x;
  for (const Group& g : groups)
    down_x.push_back(tokenmill::panel_rows(hp + g.start * width_, g.count, width_, down_format_, int8_rows, false));
  project(gate_up_panels_, gate_up_format_, gate_up_x, H, gp, 2 * width_, groups, nullptr, [&](size_t a) {
    for (int64_t m = 0; m < groups[a].count; ++m) {
      const int64_t r = groups[a].start + m;
      silu_mul_row(gp + r * 2 * width_, width_, hp + r * width_);
      tokenmill::fill_panel_row(down_x[a], m);
    }
  });
  auto y = at::empty({R, H}, xc.options());  // weighted rows
  project(down_panels_, down_format_, down_x, width_, y.data_ptr<float>(), H, groups, scale.data(), nullptr);
  // each token's rows added to zeros in ascending expert order, which is their grouped order: as
  // index_add_ over the grouped rows adds them
  auto out = at::zeros({T, H}, xc.options());
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> mine(k);
    for (int64_t t = begin; t < end; ++t) {
      std::copy(row_of.begin() + t * k, row_of.begin() + (t + 1) * k, mine.begin());
      std::sort(mine.begin(), mine.end());
      float* o = op + t * H;
      for (int64_t r : mine) {
        const float* yr = yp + r * H;
        for (int64_t j = 0; j < H; ++j) o[j] += yr[j];
      }
    }
  });
  return out;
}
