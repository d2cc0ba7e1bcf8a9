// See decoder_layer_cpu.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>

#include "moe_cpu.h"
#include <tuple>
#include <vector>

// A projection as panel_linear takes it: panels, bias, output features, format; or several, each
// writing its columns of one output (a ConcatLinear: parts that came in different GGUF types).
using ProjectionPart = std::tuple<at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t>;
using Projection = std::vector<ProjectionPart>;

// A sparse layer's feed-forward (models/moe.py's SparseMoeBlock without a router bias or gpt-oss's
// softmax over the top k): the router's projection, then the chosen experts, then Qwen2-MoE's
// shared expert where there is one.
struct MoeFeedForward {
  Projection router;
  std::shared_ptr<CpuMoeExperts> experts;
  int64_t top_k;
  bool renormalise;  // the k weights divided by their sum
  // set_shared_expert: a SwiGLU expert every token takes, times the sigmoid of its gate's one
  // output (all three empty: none)
  Projection shared_gate_up, shared_down, shared_gate;
};

// The rows a layer's kernels write, kept for the next layer of the same pass: the layers run one
// after another, and each buffer's rows are dead once the next kernel has read them. A pass then
// allocates them once, not once a layer: at batch 1 those allocations and frees, each through
// ATen's dispatcher and posix_memalign, were a visible share of a step (BENCHMARKS.md).
struct LayerRows {
  at::Tensor normed, qkv, attn, attended, gate_up, act, out;
  // `buffer` as a (T, cols) float32 tensor, allocated again only where its shape changes
  static const at::Tensor& fit(at::Tensor& buffer, int64_t T, int64_t cols);
};

struct CpuDecoderLayer {
  CpuDecoderLayer(at::Tensor input_norm, at::Tensor post_norm, double eps, std::vector<Projection> projections,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                  c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm);

  void set_moe(Projection router, std::shared_ptr<CpuMoeExperts> experts, int64_t top_k, bool renormalise);
  // after set_moe: Qwen2-MoE's shared expert and its gate (hidden -> 1)
  void set_shared_expert(Projection gate_up, Projection down, Projection gate);

  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, c10::optional<at::Tensor> residual,
                                             at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                                             at::Tensor v_cache, at::Tensor slot_block,
                                             at::Tensor slot_offset, at::Tensor block_tables,
                                             at::Tensor query_start, at::Tensor seq_lens, LayerRows& rows) const;

  at::Tensor input_norm, post_norm;
  double eps;
  Projection qkv, o, gate_up, down;  // gate_up and down empty in a sparse layer
  c10::optional<MoeFeedForward> moe;  // set_moe: the layer's feed-forward is a mixture of experts
  // q and k norms as rotary_qkv_ takes them: Qwen3's on every head (head_dim weights), OLMoE's over
  // all of q and all of k (num_heads * head_dim and num_kv_heads * head_dim)
  c10::optional<at::Tensor> q_norm, k_norm;
  int64_t num_heads, num_kv_heads, head_dim;
  double scale;
  int64_t int8_rows = 0;  // see panel_linear
  int64_t window = 0;     // the layer's sliding window (0: none), see paged_attention

 private:
  at::Tensor project(const Projection& p, const at::Tensor& x, c10::optional<at::Tensor> out = c10::nullopt) const;
  at::Tensor feed_forward(const at::Tensor& h, LayerRows& rows) const;
};

// A model's decoder layers run in one call and followed by the final norm: the loop of
// LlamaForCausalLM.forward over them, without a call from Python per layer.
struct CpuDecoderStack {
  CpuDecoderStack(std::vector<std::shared_ptr<CpuDecoderLayer>> layers, at::Tensor final_norm, double eps);

  // x: the token embeddings (T, hidden); one K and one V pool per layer -> the final norm's
  // output (T, hidden)
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_caches,
                     std::vector<at::Tensor> v_caches, at::Tensor slot_block, at::Tensor slot_offset,
                     at::Tensor block_tables, at::Tensor query_start, at::Tensor seq_lens) const;

  std::vector<std::shared_ptr<CpuDecoderLayer>> layers;
  at::Tensor final_norm;
  double eps;
};
