"""`tokenmill bench roofline`: how close the engine runs to what this machine can do.

Two ceilings are measured here, with the engine's own thread count:
  * compute: the float32 matrix-product rate on a large square GEMM, and the engine's own on the
    model's layer shapes at a prefill-sized M (through its linear backend: float32, or bfloat16
    where the weights are in bfloat16 panels, and then torch's bfloat16 GEMM too); where the
    engine's products take x in 8-bit blocks (llama.cpp's arithmetic: `gguf_int8_rows`), the int8
    rate too, on torch's int8 GEMM (oneDNN) and on the same layer shapes with 8-bit x;
  * memory: the read bandwidth of a 1 GiB tensor.
Each is the best of three trials, and the compute peak is the highest of the GEMM rates: the
arithmetic the engine chose sets the bar it is measured against.
The engine is then timed on the default workload: its required model FLOPs (every prompt
and output token once, logits only where a token is sampled, attention over each token's
context) over wall time, as a share of the compute peak; and a batch-1 decode step against
the time to stream the weights once at the read bandwidth measured beside it, in alternation
(the bytes the step actually streams: GGUF blocks or bfloat16 panels where the kernel reads those).
"""

from __future__ import annotations

import time

import torch

from tokenmill.bench.workloads import BenchRequest, random_workload
from tokenmill.config import ModelConfig


def linear_flops_per_token(cfg: ModelConfig) -> int:
    """Matrix-product FLOPs of one token through every layer (not the output head): in a
    mixture-of-experts layer the router, the top_k experts the token is routed to and any shared
    expert, not the experts it skips."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    dense = 3 * cfg.hidden_size * cfg.intermediate_size
    moe = cfg.moe
    total = 0
    for layer in range(cfg.num_layers):
        if moe is None or not moe.is_sparse(layer):
            total += attention + dense
        else:
            width = moe.top_k * moe.expert_intermediate_size + moe.shared_expert_intermediate_size
            total += attention + cfg.hidden_size * moe.num_experts + 3 * cfg.hidden_size * width
    return 2 * total


def workload_flops(cfg: ModelConfig, workload: list[BenchRequest]) -> float:
    """FLOPs the workload requires: each token computed once, logits only for sampled tokens."""
    head = 2 * cfg.hidden_size * cfg.vocab_size
    attn_per_ctx = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers  # QK^T and PV, per context token
    total = 0.0
    for r in workload:
        processed = len(r.prompt_token_ids) + r.max_tokens - 1  # the last token is sampled, never fed
        total += processed * linear_flops_per_token(cfg) + r.max_tokens * head
        total += attn_per_ctx * processed * (processed + 1) / 2
    return total


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes a decode step must read: every projection and the output head once (norms are noise)."""
    return (linear_flops_per_token(cfg) // 2 + cfg.hidden_size * cfg.vocab_size) * itemsize


def streamed_weight_bytes(model: torch.nn.Module) -> int | None:
    """Bytes a batch-1 step streams when its projections are GGUF blocks or bfloat16 panels
    (packed_linear.py), or None when they are float32: every projection's panels, of a layer's routed experts the share
    one token reads (top_k of them, taken as the experts' average size)."""
    from tokenmill.models.moe import SparseMoeBlock
    from tokenmill.models.packed_linear import PackedLinear
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not any(m.format for m in linears):
        return None
    total = sum(m.panels.nbytes for m in linears)
    for block in (m for m in model.modules() if isinstance(m, SparseMoeBlock)):
        experts = sum(m.panels.nbytes for m in block.experts.modules() if isinstance(m, PackedLinear))
        total -= experts - experts * block.top_k // len(block.experts)
    return total


def _time(fn, min_time: float = 1.0, trials: int = 3) -> float:
    """Best of a few trials of mean seconds per call: a ceiling is what the machine can reach,
    and a shared machine only ever makes a trial slower."""
    fn()
    best = float("inf")
    for _ in range(trials):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_time:
            fn()
            n += 1
        best = min(best, (time.perf_counter() - start) / n)
    return best


def gemm_peak(size: int = 2048, min_time: float = 1.0) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _time(lambda: torch.mm(a, b), min_time) / 1e9


def int8_gemm_peak(size: int = 2048, min_time: float = 1.0) -> float:
    """GOP/s of torch's int8 matrix product with int32 sums (oneDNN: VNNI or AMX where the CPU has
    them), two operations a multiply-add as for floats."""
    a = torch.randint(-127, 128, (size, size), dtype=torch.int8)
    b = torch.randint(-127, 128, (size, size), dtype=torch.int8)
    return 2 * size**3 / _time(lambda: torch._int_mm(a, b), min_time) / 1e9


def bf16_gemm_peak(size: int = 2048, min_time: float = 1.0) -> float:
    """GFLOP/s of torch's bfloat16 matrix product (oneDNN: AMX or AVX512-BF16 where the CPU has them)."""
    a, b = torch.randn(size, size, dtype=torch.bfloat16), torch.randn(size, size, dtype=torch.bfloat16)
    return 2 * size**3 / _time(lambda: torch.mm(a, b), min_time) / 1e9


def layer_rate_name(model: torch.nn.Module) -> str:
    """The name of the engine's own layer rate (without 8-bit x) among compute_ceilings'."""
    from tokenmill.models.cpu_packing import bf16_weights_of
    return f"{'bf16' if bf16_weights_of(model) else 'fp32'} layer projections, M=512 (engine)"


def compute_ceilings(model: torch.nn.Module, min_time: float = 1.0) -> dict[str, float]:
    """The compute ceilings by name, GFLOP/s (GOP/s for int8): float32's; bfloat16's where the
    weights are in bfloat16 panels (the layers' shapes then in bfloat16); and where the layers take
    x in 8-bit blocks (set_int8_rows) int8's too, the layers' shapes in both arithmetics.
    min_time: seconds of each of a rate's three trials."""
    from tokenmill.models.cpu_packing import bf16_weights_of, int8_rows_of, set_int8_rows
    rows = int8_rows_of(model)
    set_int8_rows(model, 0)
    try:
        out = {"fp32 GEMM 2048^3": gemm_peak(min_time=min_time),
               layer_rate_name(model): layer_gemm_rate(model, min_time=min_time)}
    finally:
        set_int8_rows(model, rows)
    if bf16_weights_of(model):
        out["bf16 GEMM 2048^3 (torch)"] = bf16_gemm_peak(min_time=min_time)
    if rows:
        out["int8 GEMM 2048^3 (torch._int_mm)"] = int8_gemm_peak(min_time=min_time)
        m = min(512, rows)
        out[f"8-bit x layer projections, M={m} (engine)"] = layer_gemm_rate(model, m, min_time)
    return out


def layer_gemm_rate(model: torch.nn.Module, m: int = 512, min_time: float = 1.0) -> float:
    """GFLOP/s of one layer's projections at M tokens, through the model's own linear modules."""
    layer = model.layers[0]
    mods = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    inputs = [torch.randn(m, mod.in_features) for mod in mods]

    def run():
        for mod, x in zip(mods, inputs):
            mod(x)
    flops = sum(2 * m * mod.in_features * mod.out_features for mod in mods)
    with torch.inference_mode():
        return flops / _time(run, min_time) / 1e9


def read_bandwidth(buffer: torch.Tensor | None = None, min_time: float = 1.0, trials: int = 3) -> float:
    """GB/s of summing `buffer` (default: a new 1 GiB float32 tensor)."""
    a = torch.ones((1 << 30) // 4) if buffer is None else buffer
    return a.numel() * a.element_size() / _time(lambda: a.sum(), min_time, trials) / 1e9


def batch1_against_bandwidth(engine, wbytes: int, rounds: int = 5, steps: int = 16,
                             prompt_len: int = 32) -> tuple[float, float, float]:
    """Batch-1 decode step against `wbytes` / read bandwidth, the two measured in alternation
    (a bandwidth trial, then `steps` decode steps, `rounds` times) so the machine's drift hits
    both alike. Returns the median round's (ratio, step seconds, bandwidth GB/s)."""
    from tokenmill.sampling_params import SamplingParams
    engine.add_request("roofline-b1", list(range(100, 100 + prompt_len)),
                       SamplingParams(max_tokens=rounds * steps + 2, ignore_eos=True, temperature=0.0))
    engine.step()  # the prompt
    a = torch.ones((1 << 30) // 4)
    results = []
    for _ in range(rounds):
        bandwidth = read_bandwidth(a, min_time=0.5, trials=2)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        step = sorted(times)[steps // 2]
        results.append((step * bandwidth * 1e9 / wbytes, step, bandwidth))
    while engine.has_unfinished_requests():
        engine.step()
    return sorted(results)[rounds // 2]


def bench_roofline(args) -> dict:
    import dataclasses

    from tokenmill.bench.throughput import run_engine
    from tokenmill.cli_args import engine_config_from_args
    from tokenmill.device import activation_dtype
    from tokenmill.engine import LLMEngine

    config = dataclasses.replace(engine_config_from_args(args), model=args.model)
    if config.device.split(":")[0] != "cpu" or activation_dtype(config, torch.device("cpu")) != torch.float32:
        raise ValueError("bench roofline measures the CPU's peaks for float32 activations (bfloat16 weights or "
                         "8-bit x where the engine takes them): run it with --device cpu and dtype unset or float32")
    engine = LLMEngine(config)
    model, cfg = engine.runner.worker.model, engine.model_config
    threads = torch.get_num_threads()
    ceilings = compute_ceilings(model)
    peak_name = max(ceilings, key=ceilings.get)
    peak = ceilings[peak_name]
    bandwidth = read_bandwidth()
    workload = random_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.dataset_seed,
                               vocab=min(10000, cfg.vocab_size))
    run = run_engine(engine, workload, "tokenmill", progress=True)
    flops = workload_flops(cfg, workload)
    achieved = flops / run.wall / 1e9
    wbytes = weight_bytes(cfg, engine.dtype.itemsize)
    block_bytes = streamed_weight_bytes(model)  # what batch-1 steps stream instead, if GGUF blocks or bf16
    streamed = block_bytes or wbytes
    ratio_b1, step_b1, bandwidth_b1 = batch1_against_bandwidth(engine, streamed)

    print()
    print(f"threads {threads}; model {cfg.architecture} {cfg.num_layers} layers, weights {wbytes / 1e6:.0f} MB; "
          f"arithmetic {engine.arithmetic}")
    print(f"{'ceiling':<48} {'measured':>12}")
    for name, rate in ceilings.items():
        unit = "GOP/s" if name.startswith(("int8", "8-bit")) else "GFLOP/s"
        print(f"{name:<48} {rate:>8.1f} {unit}{'  (the peak)' if name == peak_name else ''}")
    print(f"{'memory read bandwidth':<48} {bandwidth:>8.1f} GB/s")
    print()
    print(f"workload of {len(workload)} requests: {flops / 1e12:.2f} TFLOP in {run.wall:.1f} s "
          f"= {achieved:.1f} GFLOP/s = {achieved / peak:.0%} of the peak, {peak_name} "
          f"({run.output_tps:.1f} output tok/s; "
          f"ceiling at peak {run.output_tokens / (flops / (peak * 1e9)):.0f} tok/s)")
    print(f"batch-1 decode step: {step_b1 * 1e3:.1f} ms vs weights/bandwidth {streamed / bandwidth_b1 / 1e6:.1f} ms "
          f"= {ratio_b1:.2f}x (median of 5 rounds, each a bandwidth trial ({bandwidth_b1:.1f} GB/s) "
          f"beside 16 steps)")
    if block_bytes:
        print(f"  (the step streams {block_bytes / 1e6:.0f} MB of packed panels; the float32 weights, "
              f"{wbytes / 1e6:.0f} MB, would take {wbytes / bandwidth_b1 / 1e6:.1f} ms to stream: "
              f"{step_b1 * bandwidth_b1 * 1e9 / wbytes:.2f}x that)")
    return {"threads": threads, "arithmetic": engine.arithmetic, "ceilings": ceilings, "peak_ceiling": peak_name,
            "gemm_2048_gflops": ceilings["fp32 GEMM 2048^3"],
            "layer_gemm_gflops": ceilings[layer_rate_name(model)], "peak_gflops": peak,
            "read_bandwidth_gbs": bandwidth, "workload_tflop": flops / 1e12, "wall_s": run.wall,
            "achieved_gflops": achieved, "share_of_peak": achieved / peak, "num_requests": len(workload),
            "output_tokens": run.output_tokens, "output_tok_s": run.output_tps,
            "batch1_step_ms": step_b1 * 1e3, "batch1_floor_ms": streamed / bandwidth_b1 / 1e6, "batch1_ratio": ratio_b1,
            "batch1_streamed_mb": streamed / 1e6, "float32_weights_mb": wbytes / 1e6}
