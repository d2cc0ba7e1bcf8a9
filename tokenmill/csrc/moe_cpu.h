// See moe_cpu.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include "panel_gemm.h"

#include <cstdint>
#include <functional>
#include <tuple>
#include <vector>

// A layer's routed SwiGLU experts (models/moe.py, SparseMoeBlock) in one call: every expert's
// gate_up panels and down panels, each set in one format (panel_linear's: 0 float32, 1-7 GGUF
// blocks), and no biases.
struct CpuMoeExperts {
  CpuMoeExperts(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t gate_up_format,
                int64_t down_format, int64_t hidden, int64_t width);

  // Router logits (T, E) float32 -> (weights (T, k) float32, expert ids (T, k) int64): models/moe.py's
  // route (a softmax over all E, the k most probable in descending order, divided by their sum
  // where `renormalise`), a token at a time in plain loops, ties to the lower id.
  static std::tuple<at::Tensor, at::Tensor> route(at::Tensor logits, int64_t k, bool renormalise);

  // x (T, hidden) float32; experts (T, k) int64, each token's chosen experts; weights (T, k)
  // float32, their weights -> (T, hidden), each token's sum of weight * expert(x).
  at::Tensor forward(at::Tensor x, at::Tensor experts, at::Tensor weights) const;

  int64_t int8_rows = 0;  // see panel_linear: an expert's products over up to this many rows take x in 8-bit blocks

 private:
  struct Group {  // an expert chosen in this step, and its run of the rows grouped by expert
    int64_t expert, start, count;
  };
  void project(const std::vector<const uint8_t*>& panels, int64_t format, const std::vector<tokenmill::PanelRows>& x,
               int64_t K, float* y, int64_t N, const std::vector<Group>& groups, const float* row_scale,
               const std::function<void(size_t)>& group_done) const;

  std::vector<at::Tensor> gate_up_, down_;  // held: the panels the pointers below point into
  std::vector<const uint8_t*> gate_up_panels_, down_panels_;
  int64_t gate_up_format_, down_format_, hidden_, width_;
};
