// A layer's routed experts in one call: the grouped computation of models/moe.py's
// SparseMoeBlock._routed_experts (rows grouped by expert, each chosen expert's SwiGLU MLP over
// its run of rows, each token's weighted outputs added in the order of its experts) without a
// call from Python per expert product.
//
//   (token, slot) pairs, T * k    grouped by expert:  e0 e0 | e2 | e3 e3 e3 | ...
//   gate_up    one parallel region over (chosen expert, panel) pairs   -> (T * k, 2 * width)
//   silu_mul   as fused_cpu.cpp                                        -> (T * k, width)
//   down       one parallel region over (chosen expert, panel) pairs, each row times its weight
//   sum        each token's k rows, in ascending expert order          -> (T, hidden)
//
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
#include <cstring>

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
std::vector<const uint8_t*> panel_table(const std::vector<torch::Tensor>& panels, int64_t format, int64_t N,
                                        int64_t K, const char* name) {
  std::vector<const uint8_t*> table;
  const auto shape = panel_shape(N, K, format);
  for (const auto& t : panels) {
    TM_CHECK(t.is_contiguous() && t.sizes() == c10::IntArrayRef(shape) &&
                 t.dtype() == (format == 0 ? torch::kFloat32 : torch::kUInt8),
             std::string("MoeExperts: every expert's ") + name + " must be panels of its shape in format " +
                 std::to_string(format));
    table.push_back(static_cast<const uint8_t*>(t.data_ptr()));
  }
  return table;
}

}  // namespace

CpuMoeExperts::CpuMoeExperts(std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                             int64_t gate_up_format, int64_t down_format, int64_t hidden, int64_t width)
    : gate_up_(std::move(gate_up)), down_(std::move(down)), gate_up_format_(gate_up_format),
      down_format_(down_format), hidden_(hidden), width_(width) {
  TM_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(), "MoeExperts: one gate_up and one down per expert");
  gate_up_panels_ = panel_table(gate_up_, gate_up_format_, 2 * width_, hidden_, "gate_up");
  down_panels_ = panel_table(down_, down_format_, hidden_, width_, "down");
}

// rows (R, K), grouped as `groups`, times each group's expert's panels (of an (N, K) matrix) ->
// (R, N), row r times row_scale[r] where given: one parallel region over (group, panel) pairs.
torch::Tensor CpuMoeExperts::project(const std::vector<const uint8_t*>& panels, int64_t format,
                                     const torch::Tensor& rows, int64_t N, const std::vector<Group>& groups,
                                     const float* row_scale) const {
  const int64_t R = rows.size(0), K = rows.size(1), P = (N + kPanel - 1) / kPanel;
  const int64_t stride = tokenmill::panel_stride(K, format), items = static_cast<int64_t>(groups.size()) * P;
  auto y = torch::empty({R, N}, rows.options());
  const float* xp = rows.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<tokenmill::PanelRows> x;  // each group's rows, as its product reads them
  int64_t most = 0;
  bool decode = false;
  for (const Group& g : groups) {
    x.push_back(tokenmill::panel_rows(xp + g.start * K, g.count, K, format, int8_rows));
    most = std::max(most, g.count);
    decode = decode || tokenmill::decodes_panels(x.back(), format);
  }
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
      const tokenmill::PanelOut out{yp + g.start * N, N, N, nullptr, row_scale ? row_scale + g.start : nullptr};
      tokenmill::run_panel(x[a], panel, format, p, next, scratch, out);
    }
  });
  return y;
}

std::tuple<torch::Tensor, torch::Tensor> CpuMoeExperts::route(torch::Tensor logits, int64_t k, bool renormalise) {
  check_rows(logits, "MoeExperts.route(logits)");
  const int64_t T = logits.size(0), E = logits.size(1), stride = logits.stride(0);
  TM_CHECK(k >= 1 && k <= E, "MoeExperts.route: k must be 1 to the number of experts");
  auto weights = torch::empty({T, k}, logits.options());
  auto ids = torch::empty({T, k}, logits.options().dtype(torch::kInt64));
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

torch::Tensor CpuMoeExperts::forward(torch::Tensor x, torch::Tensor experts, torch::Tensor weights) const {
  check_rows(x, "MoeExperts(x)");
  const int64_t T = x.size(0), E = static_cast<int64_t>(gate_up_.size());
  TM_CHECK(x.size(1) == hidden_, "MoeExperts: x must have the experts' hidden size");
  TM_CHECK(experts.dtype() == torch::kInt64 && experts.dim() == 2 && experts.size(0) == T,
           "MoeExperts: experts must be int64 (T, k)");
  TM_CHECK(weights.dtype() == torch::kFloat32 && weights.sizes() == experts.sizes(),
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
  auto rows = torch::empty({R, H}, xc.options());  // (T * k, hidden) grouped by expert
  std::vector<float> scale(R);                      // each grouped row's weight
  const float *xp = xc.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* rp = rows.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(rp + row_of[i] * H, xp + i / k * H, H * sizeof(float));
      scale[row_of[i]] = wp[i];
    }
  });
  const torch::Tensor h = silu_mul(project(gate_up_panels_, gate_up_format_, rows, 2 * width_, groups, nullptr));
  const torch::Tensor y = project(down_panels_, down_format_, h, H, groups, scale.data());  // weighted rows
  // each token's rows added to zeros in ascending expert order, which is their grouped order: as
  // index_add_ over the grouped rows adds them
  auto out = torch::zeros({T, H}, xc.options());
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
