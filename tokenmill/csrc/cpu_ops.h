// The CPU kernels' entry points, defined in paged_attention_cpu.cpp, fused_cpu.cpp, gemm_cpu.cpp
// and sampler_cpu.cpp: bound to Python in bindings.cpp, and composed into a whole layer by
// decoder_layer_cpu.cpp.
#pragma once

// ATen's tensor and the factories the kernels call, no more: pybind11 is bindings.cpp's alone,
// and torch's C++ API (<torch/extension.h>) no file's, since parsing those headers was most of
// each file's compile time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

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

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor query_start,
                           at::Tensor seq_lens, double scale, int64_t window, double softcap = 0.0,
                           c10::optional<at::Tensor> sinks = c10::nullopt,
                           c10::optional<at::Tensor> out = c10::nullopt);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_block, at::Tensor slot_offset);
at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                        double eps, c10::optional<at::Tensor> out = c10::nullopt);
void rotary_qkv_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t num_q_heads,
                 int64_t num_kv_heads, int64_t head_dim, c10::optional<at::Tensor> q_norm = c10::nullopt,
                 c10::optional<at::Tensor> k_norm = c10::nullopt, double eps = 1e-6);
at::Tensor silu_mul(at::Tensor gate_up, c10::optional<at::Tensor> out = c10::nullopt);
at::Tensor argmax_rows(at::Tensor x);
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, c10::optional<at::Tensor> top_k,
                       c10::optional<at::Tensor> top_p, c10::optional<at::Tensor> min_p, at::Tensor u,
                       c10::optional<at::Tensor> floors);
// shared between the kernels' files
void check_rows(const at::Tensor& t, const char* name);  // float32, 2-d, contiguous rows
// A kernel's result: `out` where the caller gives one (checked: contiguous float32 of `shape`), else
// a new tensor. The decoder stack passes buffers it reuses layer after layer.
at::Tensor out_or_empty(const c10::optional<at::Tensor>& out, at::IntArrayRef shape, const char* name);
float row_max(const float* row, int64_t V, bool* has_nan);
int64_t row_argmax(const float* row, int64_t V);
void silu_mul_row(const float* gate_up, int64_t I, float* out);  // silu_mul's row: 2 * I in, I out
std::vector<int64_t> panel_shape(int64_t N, int64_t K, int64_t format);
bool streams_weights_non_temporally();  // one- and two-row steps' weights: prefetchnta (AMD) or prefetcht0
at::Tensor pack_panels(at::Tensor weight, c10::optional<at::Tensor> out);
at::Tensor pack_block_panels(at::Tensor rows, int64_t format, int64_t K, c10::optional<at::Tensor> out);
at::Tensor recut_k_quant(at::Tensor raw, int64_t format);
at::Tensor embed_rows(at::Tensor rows, at::Tensor ids, int64_t format);
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t N,
                        int64_t format, c10::optional<at::Tensor> out, int64_t int8_rows);
