// Python bindings of the CPU kernels: one extension module, built on first use.
// pybind11 with torch's conversions of tensors, without the rest of <torch/extension.h> (cpu_ops.h)
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <sched.h>

#include "cpu_ops.h"
#include "decoder_layer_cpu.h"
#include "moe_cpu.h"
#include "panel_gemm.h"
#include "simd.h"

// omp_pause_resource_all is OpenMP 5.0: GCC has it from version 9 (while still reporting an
// older _OPENMP); elsewhere release_threads does nothing.
#if defined(_OPENMP) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 9
#define TOKENMILL_OMP_PAUSE 1
#include <omp.h>
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Paged attention for short queries (float32 queries, float32, float16 or bfloat16 pool)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("out") = py::none());
  m.def("write_kv", &write_kv, "Store a step's K/V into the block pool");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place; returns rms_norm(residual) * weight", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("out") = py::none());
  m.def("rotary_qkv_", &rotary_qkv_, "Rotate the q and k heads of a fused qkv row in place (after their RMSNorm)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("num_q_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("eps") = 1e-6);
  m.def("silu_mul", &silu_mul, "silu(gate) * up from a fused gate_up row", py::arg("gate_up"),
        py::arg("out") = py::none());
  m.def("argmax_rows", &argmax_rows, "Each row's argmax, as torch.argmax(x, dim=-1) gives it");
  m.def("sample_rows", &sample_rows,
        "One token per row: temperature (0: argmax), top-k, top-p, min-p, then a draw at u (see sampler_cpu.cpp)",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
        py::arg("floors") = py::none());
  m.def("streams_weights_non_temporally", &streams_weights_non_temporally,
        "Whether one- and two-row products prefetch their panels non-temporally (on AMD CPUs)");
  m.def("panel_shape", &panel_shape, "The panels' shape for an (N, K) matrix in a format (0: float32)");
  m.def("pack_panels", &pack_panels, "W (N, K) -> panels for panel_linear: float32 (ceil(N/16), K, 16), bfloat16 format 9",
        py::arg("weight"), py::arg("out") = py::none());
  m.def("pack_block_panels", &pack_block_panels,
        "GGUF Q4_0/Q4_1/Q8_0 (or re-cut Q5_0/Q5_1/K-quant) rows (N, bytes) -> block panels for panel_linear", py::arg("rows"),
        py::arg("format"), py::arg("K"), py::arg("out") = py::none());
  m.def("recut_k_quant", &recut_k_quant, "Q4_K/Q5_K/Q6_K rows -> rows of super-blocks of 256 in format Q4F/Q5K/Q6F");
  m.def("embed_rows", &embed_rows, "GGUF Q4_0/Q4_1/Q8_0 rows at ids -> float32 (T, K), as gguf dequantizes them");
  m.def("panel_linear", &panel_linear, "x @ W.T + b, W as 16-feature panels (format 0: float32; 1-8: Q4_0, Q4_1, Q8_0, Q4F, Q5F, Q6F, Q5K, MXF; 9: bfloat16)",
        py::arg("x"), py::arg("panels"), py::arg("bias"), py::arg("N"), py::arg("format") = 0,
        py::arg("out") = py::none(), py::arg("int8_rows") = 0);
  // libgomp gives each thread that starts a parallel region a team of workers of its own, kept
  // for its next regions; this lets the calling thread's workers exit (they start again with its
  // next parallel kernel). See LLMEngine.release_threads.
  m.def("release_threads", [] {
#ifdef TOKENMILL_OMP_PAUSE
    omp_pause_resource_all(omp_pause_soft);
#endif
  }, "Let the OpenMP worker threads started by the calling thread exit");
  // The calling thread's team (itself as thread 0, then its OpenMP workers): thread t pinned to
  // cpus[t % n] when one_each, else every thread allowed all of cpus (cpu_threads.ThreadGovernor).
  m.def("bind_threads", [](const std::vector<int64_t>& cpus, bool one_each) {
    TM_CHECK(!cpus.empty(), "bind_threads: no CPUs given");
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      cpu_set_t set;
      CPU_ZERO(&set);
      if (one_each) {
        CPU_SET(cpus[at::get_thread_num() % static_cast<int64_t>(cpus.size())], &set);
      } else {
        for (const int64_t cpu : cpus) CPU_SET(cpu, &set);
      }
      sched_setaffinity(0, sizeof(set), &set);  // 0: this thread
    });
  }, "Pin the calling thread's OpenMP team to CPUs", py::arg("cpus"), py::arg("one_each"));
  py::class_<CpuDecoderLayer, std::shared_ptr<CpuDecoderLayer>>(m, "DecoderLayer",
                                                                 "A Llama decoder layer whose attention runs in the kernel, in one call")
      .def(py::init<at::Tensor, at::Tensor, double, std::vector<Projection>, int64_t, int64_t, int64_t, double,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>>(),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("projections"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none())
      .def("set_moe", &CpuDecoderLayer::set_moe, py::arg("router"), py::arg("experts"), py::arg("top_k"),
           py::arg("renormalise"))
      .def("set_shared_expert", &CpuDecoderLayer::set_shared_expert, py::arg("gate_up"), py::arg("down"),
           py::arg("gate"))
      .def_readwrite("int8_rows", &CpuDecoderLayer::int8_rows)
      .def_readwrite("window", &CpuDecoderLayer::window);
  py::class_<CpuDecoderStack>(m, "DecoderStack", "A model's DecoderLayers and final norm, in one call")
      .def(py::init<std::vector<std::shared_ptr<CpuDecoderLayer>>, at::Tensor, double>(), py::arg("layers"),
           py::arg("final_norm"), py::arg("eps"))
      .def("forward", &CpuDecoderStack::forward);
  py::class_<CpuMoeExperts, std::shared_ptr<CpuMoeExperts>>(m, "MoeExperts",
                                                             "A layer's routed SwiGLU experts in one call (see moe_cpu.cpp)")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, int64_t, int64_t>(),
           py::arg("gate_up"), py::arg("down"), py::arg("gate_up_format"), py::arg("down_format"), py::arg("hidden"),
           py::arg("width"))
      .def_readwrite("int8_rows", &CpuMoeExperts::int8_rows)
      .def("forward", &CpuMoeExperts::forward, py::arg("x"), py::arg("experts"), py::arg("weights"))
      .def_static("route", &CpuMoeExperts::route, py::arg("logits"), py::arg("k"), py::arg("renormalise"));
#ifdef TOKENMILL_AVX2
  m.attr("block_formats") = true;
  m.attr("vnni") = tokenmill::kVnni;  // the 8-bit tiles multiply with vpdpbusd (panel_linear's int8_rows)
  m.attr("bf16") = tokenmill::kBf16;  // bfloat16 panels (format 9) multiply with vdpbf16ps
#else
  m.attr("block_formats") = false;
  m.attr("vnni") = false;
  m.attr("bf16") = false;
#endif
  m.attr("amx_min_rows") = tokenmill::amx_min_rows();  // bf16 panels' steps from this many rows on AMX tiles
}
