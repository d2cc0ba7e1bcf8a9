// A whole Llama decoder layer in one call, for CPU steps whose attention runs entirely in the
// paged-attention kernel (decodes, and prompt chunks of up to 32 tokens, or of any length when the
// head size is a multiple of 32: see attention/cpu.py). It calls the same kernels in the same
// order as the Python layer (models/llama.py), so the results are the same bit for bit (tested):
// what it saves is the Python between them. A batch-1 decode step of the default model spent a
// sizeable part of its time in that glue (30 layers, ten kernel calls each, with their views,
// attribute lookups and argument parsing; BENCHMARKS.md, "Speed work, every attempt (CPU, default
// model)").
#include "decoder_layer_cpu.h"

#include <ATen/ops/sigmoid.h>
#include <Python.h>

#include "cpu_ops.h"

CpuDecoderLayer::CpuDecoderLayer(at::Tensor input_norm, at::Tensor post_norm, double eps,
                                 std::vector<Projection> projections, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, double scale, c10::optional<at::Tensor> q_norm,
                                 c10::optional<at::Tensor> k_norm)
    : input_norm(std::move(input_norm)), post_norm(std::move(post_norm)), eps(eps), q_norm(std::move(q_norm)),
      k_norm(std::move(k_norm)), num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), scale(scale) {
  TM_CHECK(projections.size() == 4 || projections.size() == 2,
           "DecoderLayer: qkv, o, gate_up and down projections (qkv and o alone for a sparse layer)");
  for (const auto& p : projections) TM_CHECK(!p.empty(), "DecoderLayer: a projection without parts");
  TM_CHECK(this->q_norm.has_value() == this->k_norm.has_value(), "DecoderLayer: q and k norms go together");
  qkv = projections[0], o = projections[1];
  if (projections.size() == 4) gate_up = projections[2], down = projections[3];
}

void CpuDecoderLayer::set_moe(Projection router, std::shared_ptr<CpuMoeExperts> experts, int64_t top_k,
                              bool renormalise) {
  TM_CHECK(!router.empty() && experts && top_k > 0, "DecoderLayer.set_moe: a router, the experts and k >= 1");
  moe = MoeFeedForward{std::move(router), std::move(experts), top_k, renormalise};
  gate_up.clear(), down.clear();
}

void CpuDecoderLayer::set_shared_expert(Projection gate_up, Projection down, Projection gate) {
  TM_CHECK(moe.has_value(), "DecoderLayer.set_shared_expert: after set_moe");
  TM_CHECK(!gate_up.empty() && !down.empty() && !gate.empty() && gate.size() == 1 && std::get<2>(gate[0]) == 1,
           "DecoderLayer.set_shared_expert: gate_up, down and a gate of one output");
  moe->shared_gate_up = std::move(gate_up), moe->shared_down = std::move(down), moe->shared_gate = std::move(gate);
}

namespace {
int64_t width(const Projection& p) {  // the output features of all its parts
  int64_t n = 0;
  for (const auto& part : p) n += std::get<2>(part);
  return n;
}
}  // namespace

const at::Tensor& LayerRows::fit(at::Tensor& buffer, int64_t T, int64_t cols) {
  if (!buffer.defined() || buffer.size(0) != T || buffer.size(1) != cols) buffer = at::empty({T, cols}, at::kFloat);
  return buffer;
}

// The dense SwiGLU MLP, or as SparseMoeBlock.forward with the experts' C++ call: the router's
// logits routed by CpuMoeExperts::route, and the shared expert's output times the sigmoid of its
// gate added (the same torch operations, so the same bits).
at::Tensor CpuDecoderLayer::feed_forward(const at::Tensor& h, LayerRows& rows) const {
  const int64_t T = h.size(0);
  if (!moe.has_value()) {
    TM_CHECK(!gate_up.empty(), "DecoderLayer: a layer without its feed-forward (set_moe)");
    const at::Tensor gu = project(gate_up, h, LayerRows::fit(rows.gate_up, T, width(gate_up)));
    const at::Tensor act = silu_mul(gu, LayerRows::fit(rows.act, T, gu.size(1) / 2));
    return project(down, act, LayerRows::fit(rows.out, T, width(down)));
  }
  const auto [weights, experts] = CpuMoeExperts::route(project(moe->router, h), moe->top_k, moe->renormalise);
  at::Tensor out = moe->experts->forward(h, experts, weights);
  if (moe->shared_down.empty()) return out;
  at::Tensor shared = project(moe->shared_down, silu_mul(project(moe->shared_gate_up, h)));  // (T, hidden)
  return out.add(at::sigmoid(project(moe->shared_gate, h)).mul(shared));  // out + gate (T, 1) * shared
}

// As PackedLinear.forward, or ConcatLinear.forward for several parts; into `out` where given.
at::Tensor CpuDecoderLayer::project(const Projection& p, const at::Tensor& x, c10::optional<at::Tensor> out) const {
  const auto run = [&](const ProjectionPart& part, c10::optional<at::Tensor> out) {
    return panel_linear(x, std::get<0>(part), std::get<1>(part), std::get<2>(part), std::get<3>(part), out, int8_rows);
  };
  if (p.size() == 1) return run(p[0], out);
  at::Tensor y = out.has_value() ? *out : at::empty({x.size(0), width(p)}, x.options());
  int64_t start = 0;
  for (const auto& part : p) {
    run(part, y.narrow(1, start, std::get<2>(part)));
    start += std::get<2>(part);
  }
  return y;
}

// x: the previous layer's output (T, hidden); residual: the residual stream, updated in place
// (None for the first layer: it starts as x). Returns (this layer's output, the residual stream).
std::tuple<at::Tensor, at::Tensor> CpuDecoderLayer::forward(
    at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor cos, at::Tensor sin,
    at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_block, at::Tensor slot_offset,
    at::Tensor block_tables, at::Tensor query_start, at::Tensor seq_lens, LayerRows& rows) const {
  const int64_t T = x.size(0), hidden = x.size(1);
  at::Tensor stream = residual.has_value() ? *residual : x;
  at::Tensor h = add_rms_norm(x, residual, input_norm, eps, LayerRows::fit(rows.normed, T, hidden));
  at::Tensor qkv_rows = project(qkv, h, LayerRows::fit(rows.qkv, T, width(qkv)));
  at::Tensor heads = qkv_rows.view({T, num_heads + 2 * num_kv_heads, head_dim});
  at::Tensor q = heads.narrow(1, 0, num_heads);
  rotary_qkv_(qkv_rows, cos, sin, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps);  // norms too: as CpuFusedOps
  write_kv(heads.narrow(1, num_heads, num_kv_heads), heads.narrow(1, num_heads + num_kv_heads, num_kv_heads),
           k_cache, v_cache, slot_block, slot_offset);
  const at::Tensor& attn = LayerRows::fit(rows.attn, T, num_heads * head_dim);
  paged_attention(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, window, 0.0, c10::nullopt,
                  attn.view({T, num_heads, head_dim}));
  const at::Tensor attended = project(o, attn, LayerRows::fit(rows.attended, T, width(o)));
  h = add_rms_norm(attended, stream, post_norm, eps, LayerRows::fit(rows.normed, T, hidden));
  return {feed_forward(h, rows), stream};
}

CpuDecoderStack::CpuDecoderStack(std::vector<std::shared_ptr<CpuDecoderLayer>> layers, at::Tensor final_norm,
                                 double eps)
    : layers(std::move(layers)), final_norm(std::move(final_norm)), eps(eps) {}

namespace {
// Releases the GIL for its lifetime where this thread holds it, through Python's C API (this file
// does without pybind11's headers: see cpu_ops.h).
class GilReleased {
 public:
  GilReleased() : state_(PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilReleased() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};
}  // namespace

at::Tensor CpuDecoderStack::forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                    std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                                    at::Tensor slot_block, at::Tensor slot_offset, at::Tensor block_tables,
                                    at::Tensor query_start, at::Tensor seq_lens) const {
  TM_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
           "DecoderStack: one K and one V pool per layer");
  // The GIL is released for the whole pass, so that the server's event loop sends the last step's
  // tokens as soon as it is scheduled. Yielding it between layers instead starved the loop: each
  // release woke the waiting thread, and each wake restarted its 5 ms wait before it may ask the
  // holder to let go, so with layers shorter than that it got the GIL only after the pass.
  const GilReleased released;
  c10::optional<at::Tensor> residual;
  LayerRows rows;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto [out, stream] = layers[i]->forward(x, residual, cos, sin, k_caches[i], v_caches[i], slot_block, slot_offset,
                                            block_tables, query_start, seq_lens, rows);
    x = std::move(out), residual = std::move(stream);
  }
  return add_rms_norm(x, residual, final_norm, eps);
}
