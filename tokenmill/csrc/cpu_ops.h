// The CPU kernels' entry points, defined in paged_attention_cpu.cpp, fused_cpu.cpp, gemm_cpu.cpp
// and sampler_cpu.cpp: bound to Python in bindings.cpp, and composed into a whole layer by
// decoder_layer_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <vector>

// The kernels' argument checks: RuntimeError in Python, its message one string built without
// std::ostringstream (which TORCH_CHECK formats its arguments with). In an extension built on the
// GPU machines' image (torch 2.11.0+cu130, GCC 13) any std::ostringstream crashed the process,
// while a std::runtime_error of a std::string was raised as it should be
// (benchmarks/results/gpu_h100/19_cpp_exception_probe.txt).
#define TM_CHECK(cond, message)                                  \
  do {                                                           \
    if (!(cond)) throw std::runtime_error(std::string(message)); \
  } while (0)

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor query_start,
                              torch::Tensor seq_lens, double scale, int64_t window, double softcap = 0.0,
                              c10::optional<torch::Tensor> sinks = c10::nullopt);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_block, torch::Tensor slot_offset);
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight,
                           double eps);
void rotary_qkv_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_q_heads,
                 int64_t num_kv_heads, int64_t head_dim, c10::optional<torch::Tensor> q_norm = c10::nullopt,
                 c10::optional<torch::Tensor> k_norm = c10::nullopt, double eps = 1e-6);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, c10::optional<torch::Tensor> top_k,
                          c10::optional<torch::Tensor> top_p, c10::optional<torch::Tensor> min_p, torch::Tensor u,
                          c10::optional<torch::Tensor> floors);
// shared between the kernels' files
void check_rows(const torch::Tensor& t, const char* name);  // float32, 2-d, contiguous rows
float row_max(const float* row, int64_t V, bool* has_nan);
int64_t row_argmax(const float* row, int64_t V);
void silu_mul_row(const float* gate_up, int64_t I, float* out);  // silu_mul's row: 2 * I in, I out
std::vector<int64_t> panel_shape(int64_t N, int64_t K, int64_t format);
torch::Tensor pack_panels(torch::Tensor weight, c10::optional<torch::Tensor> out);
torch::Tensor pack_block_panels(torch::Tensor rows, int64_t format, int64_t K, c10::optional<torch::Tensor> out);
torch::Tensor recut_k_quant(torch::Tensor raw, int64_t format);
torch::Tensor embed_rows(torch::Tensor rows, torch::Tensor ids, int64_t format);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias, int64_t N,
                           int64_t format, c10::optional<torch::Tensor> out, int64_t int8_rows);
