"""tokenmill's side of llama-bench's tg and pp on one GGUF file (issue 32).

llama-bench's `-n 32` (tg32) times 32 single-token decodes from an empty context, `-p 128`
(pp128) one 128-token prompt; this script times the same in the engine, at a fixed thread count:

    python benchmarks/moe_vs_llamacpp.py PATH [--threads 2] [--reps 3] [--int8-rows 16] [--per-expert | --alternate]
                                              [--llama-bench BIN] [--tokenizer DIR]

tg: a one-token prompt, then the median of 32 decode steps, `reps` times (a new request each
time); pp: a step holding one whole 128-token prompt (new token ids each time, so no prefix is
cached), `reps` times. Prints ms and tokens/s as medians over the reps. With --int8-rows N both
are repeated with the layers' products in steps of up to N rows taking x in 8-bit blocks
(EngineConfig's gguf_int8_rows, set on the loaded model), as llama.cpp's do.

--per-expert (after each of the runs above) compares all the layers run as one C++ call (the
default on a CPU), the Python layers with each layer's experts as one C++ call
(SparseMoeBlock.fused_experts), and the Python layers with one product per chosen expert: first
the first sparse layer's MoE block alone (200 calls each way, alternating, at 1 and 16 tokens),
then tg and pp, alternating rep by rep in the same engine; with --llama-bench (the path of
llama.cpp's llama-bench) each rep also runs `llama-bench -m PATH -t THREADS -r 1` for tg32 and
pp128, so that the three are timed side by side under the same load (the other agents' work on
a shared machine swings every figure by several times).

--batch N instead times decode steps of N requests at once (16-token prompts, then the median
of 32 steps), all the layers in one C++ call and the Python layers alternating rep by rep, and
with --llama-batched-bench (the path of llama.cpp's llama-batched-bench) each rep also runs
`llama-batched-bench -npp 16 -ntg 32 -npl N`, whose T_TG / 32 is its step.

--alternate (with --int8-rows N and --llama-bench) instead times tg32 three ways rep by rep:
the engine with float32 x, the same engine with 8-bit x (set_int8_rows), and llama-bench's tg32
(one repetition), so that the three share each moment's load; the batch-1 comparison in
llama.cpp's own arithmetic as well as in tokenmill's default.

--profile instead splits the batch-1 decode step of the Python layers by hand (the one-call
stack cannot be timed piece by piece): each piece's forward is wrapped in a
timer (the C++ kernels are invisible to torch.profiler), and the products' weight bytes are
counted per call, so each piece shows the rate at which it read them.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.models.cpu_packing import set_int8_rows  # noqa: E402
from tokenmill.models.packed_linear import PackedLinear  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

TG, PP = 32, 128
PROMPT = 16  # the prompt of each request in the batched decode


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def tg_step(engine: LLMEngine, rep: int) -> float:
    """Median decode step of one request over TG tokens after a one-token prompt."""
    rid = f"tg{rep}-{time.monotonic_ns()}"
    engine.add_request(rid, [1000 + rep], SamplingParams(max_tokens=TG + 2, ignore_eos=True, temperature=0.0))
    engine.step()  # the prompt
    times = [timed_step(engine) for _ in range(TG)]
    engine.abort(rid)
    return statistics.median(times)


def pp_step(engine: LLMEngine, rep: int) -> float:
    """One step computing a whole PP-token prompt (and sampling its first token)."""
    rid = f"pp{rep}-{time.monotonic_ns()}"
    prompt = [(7 * rep + 3 * i) % 30000 + 100 for i in range(PP)]
    engine.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
    step = timed_step(engine)
    engine.abort(rid)
    return step


def batch_step(engine: LLMEngine, rep: int, batch: int) -> float:
    """Median decode step of `batch` requests decoding together over TG tokens, after their
    PROMPT-token prompts (computed in one step beforehand, as llama-batched-bench's PP is)."""
    ids = [f"b{rep}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for i, rid in enumerate(ids):
        prompt = [(11 * rep + 5 * i + 3 * j) % 30000 + 100 for j in range(PROMPT)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=TG + 2, ignore_eos=True, temperature=0.0))
    while engine.scheduler.waiting or any(r.num_computed_tokens < PROMPT for r in engine.scheduler.running):
        engine.step()
    times = [timed_step(engine) for _ in range(TG)]
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times)


def report(name: str, tokens: int, steps: list[float]) -> None:
    ms = statistics.median(steps) * 1e3
    print(f"{name:<14} {ms:>9.1f} ms {tokens * 1e3 / ms:>8.2f} tok/s   (reps: "
          f"{', '.join(f'{s * 1e3:.1f}' for s in steps)} ms)", flush=True)


def weight_bytes(module: nn.Module) -> int:
    return sum(m.panels.nbytes for m in module.modules() if isinstance(m, PackedLinear) and m.panels is not None)


def wrap(module: nn.Module, key: str, seconds: dict[str, float], nbytes: dict[str, int],
         size: int | None = None) -> None:
    """module.forward, timed into seconds[key], its weights' bytes (or `size`) added to nbytes[key] per call."""
    inner, size = module.forward, weight_bytes(module) if size is None else size

    def forward(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        seconds[key] += time.perf_counter() - start
        nbytes[key] += size
        return out
    module.forward = forward


def profile(engine: LLMEngine, steps: int) -> None:
    """Where a batch-1 decode step's time goes, per step, summed over the layers."""
    model = engine.runner.worker.model
    model.fused_stack = None  # the Python layers, whose pieces can be timed one by one
    seconds: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    for layer in model.layers:
        attn, moe = layer.self_attn, layer.mlp
        wrap(attn.qkv_proj, "attention projections", seconds, nbytes)
        wrap(attn.o_proj, "attention projections", seconds, nbytes)
        wrap(attn, "attention block", seconds, nbytes)
        wrap(moe.gate, "router product", seconds, nbytes)
        for expert in moe.experts:
            wrap(expert, "expert products", seconds, nbytes)
        if moe.fused_experts is not None:  # one C++ call, which at batch 1 reads top_k experts' weights
            moe.fused_experts = SimpleNamespace(forward=moe.fused_experts.forward)
            wrap(moe.fused_experts, "expert products", seconds, nbytes, moe.top_k * weight_bytes(moe.experts[0]))
        wrap(moe, "moe block", seconds, nbytes)
        wrap(layer, "layers", seconds, nbytes)
    wrap(model, "model forward", seconds, nbytes)
    wrap(model.packed_lm_head, "head", seconds, nbytes)
    rid = "profile"
    engine.add_request(rid, [1000], SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0.0))
    engine.step()
    engine.step()
    seconds.clear()
    nbytes.clear()
    step = sum(timed_step(engine) for _ in range(steps)) / steps
    engine.abort(rid)
    per = {k: v / steps for k, v in seconds.items()}
    split = [  # (piece, seconds a step, the bytes counter it read)
        ("attention projections (qkv, o)", per["attention projections"], "attention projections"),
        ("attention itself (rope, q/k norms, paged attention)", per["attention block"] - per["attention projections"],
         None),
        ("router product", per["router product"], "router product"),
        ("8 experts' products (gate_up, silu, down)", per["expert products"], "expert products"),
        ("routing and expert dispatch in Python", per["moe block"] - per["router product"] - per["expert products"],
         None),
        ("norms and residual adds", per["layers"] - per["attention block"] - per["moe block"], None),
        ("embedding, final norm", per["model forward"] - per["layers"], None),
        ("head", per["head"], "head"),
        ("engine (schedule, inputs, sampling)", step - per["model forward"] - per["head"], None),
    ]
    layers = len(model.layers)
    print(f"batch-1 decode step {step * 1e3:.1f} ms (mean of {steps}), {layers} layers", flush=True)
    for i, (name, sec, key) in enumerate(split):
        read = nbytes[key] / steps if key else 0
        per_layer = f"{sec / layers * 1e3:6.2f}" if i < 6 else ""
        rate = f"  {read / 1e6:6.1f} MB at {read / sec / 1e9:5.1f} GB/s" if key else ""
        print(f"{name:<52} {sec * 1e3:8.2f} ms {sec / step * 100:5.1f}% {per_layer:>6} ms/layer{rate}", flush=True)


def llama_bench(binary: Path, path: Path, threads: int, test: str) -> float:
    """Seconds a token of llama-bench's tg32 or pp128 (one repetition) on the file."""
    args = ["-p", "0", "-n", str(TG)] if test == f"tg{TG}" else ["-p", str(PP), "-n", "0"]
    out = subprocess.run([str(binary), "-m", str(path), "-t", str(threads), "-r", "1", *args], capture_output=True,
                         text=True, check=True).stdout
    return 1.0 / float(re.search(rf"\|\s*{test}\s*\|\s*([\d.]+)", out).group(1))


def llama_batched(binary: Path, path: Path, threads: int, batch: int) -> float:
    """Seconds a decode step of `batch` sequences in llama-batched-bench (PROMPT-token prompts, TG
    tokens each): its T_TG over TG."""
    out = subprocess.run([str(binary), "-m", str(path), "-t", str(threads), "-c", "4096", "-npp", str(PROMPT),
                          "-ntg", str(TG), "-npl", str(batch)], capture_output=True, text=True, check=True).stdout
    row = re.search(rf"\|\s*{PROMPT}\s*\|\s*{TG}\s*\|\s*{batch}\s*\|(.*)", out).group(1).split("|")
    return float(row[3]) / TG  # columns after B: N_KV, T_PP s, S_PP t/s, T_TG s


def batched(engine: LLMEngine, reps: int, batch: int, binary: Path | None, path: Path, threads: int) -> None:
    """Batch-`batch` decode steps, all the layers in one C++ call (where the model has the stack)
    and the Python layers alternating rep by rep, and llama-batched-bench's beside them where its
    binary is given."""
    model = engine.runner.worker.model
    stack = model.fused_stack
    paths = (("one call", stack), ("python layers", None)) if stack is not None else (("python layers", None),)
    times: dict[str, list[float]] = defaultdict(list)
    for rep in range(reps):
        for name, layers in paths:
            model.fused_stack = layers
            times[f"batch-{batch} {name}"].append(batch_step(engine, rep, batch))
        model.fused_stack = stack
        if binary is not None:
            times[f"batch-{batch} llama"].append(llama_batched(binary, path, threads, batch))
    for key, steps in times.items():
        report(key, batch, steps)


def per_expert(engine: LLMEngine, reps: int, mode: str, bench: tuple[Path, Path, int] | None) -> None:
    """tg and pp three ways, alternating rep by rep in one engine: all the layers in one C++ call
    (fused_stack, the default on a CPU), the Python layers with each layer's experts in one call,
    and the Python layers with one product per chosen expert; and llama-bench's where `bench` (its
    binary, the file, threads) is given; `mode` names the engine's settings in the labels."""
    model = engine.runner.worker.model
    blocks = [layer.mlp for layer in model.layers if getattr(layer.mlp, "fused_experts", None) is not None]
    fused, stack = [block.fused_experts for block in blocks], model.fused_stack
    paths = (("one call", stack, True), ("python layers", None, True), ("per-expert", None, False))
    times: dict[str, list[float]] = defaultdict(list)
    for rep in range(reps):
        for name, layers, on in paths if stack is not None else paths[1:]:
            model.fused_stack = layers
            for block, experts in zip(blocks, fused):
                block.fused_experts = experts if on else None
            times[f"tg{TG}{mode} {name}"].append(tg_step(engine, 100 + rep))
            times[f"pp{PP}{mode} {name}"].append(pp_step(engine, 100 + rep))
        if bench is not None:  # llama.cpp has no such setting: its figures beside each mode's
            beside = f" (beside{mode or ' float32 x'})"
            times[f"tg{TG} llama-bench{beside}"].append(llama_bench(*bench, f"tg{TG}"))
            times[f"pp{PP} llama-bench{beside}"].append(llama_bench(*bench, f"pp{PP}") * PP)
    model.fused_stack = stack
    for block, experts in zip(blocks, fused):
        block.fused_experts = experts
    for key in sorted(times, key=lambda k: (not k.startswith("tg"), k)):
        report(key, 1 if key.startswith("tg") else PP, times[key])


def alternate(engine: LLMEngine, reps: int, int8_rows: int, bench: tuple[Path, Path, int]) -> None:
    """tg32 with float32 x, with 8-bit x in steps of up to `int8_rows` rows, and llama-bench's tg32
    (`bench`: its binary, the file, threads), one after the other in each rep."""
    model = engine.runner.worker.model
    times: dict[str, list[float]] = defaultdict(list)
    for rep in range(reps):
        for name, rows in (("float32 x", 0), ("8-bit x", int8_rows)):
            set_int8_rows(model, rows)
            times[f"tg{TG} {name}"].append(tg_step(engine, 200 + rep))
        times[f"tg{TG} llama-bench"].append(llama_bench(*bench, f"tg{TG}"))
        print(f"rep {rep}: " + ", ".join(f"{key} {steps[-1] * 1e3:.1f} ms" for key, steps in times.items()), flush=True)
    set_int8_rows(model, 0)
    for key, steps in times.items():
        report(key, 1, steps)
    ours, theirs = times[f"tg{TG} 8-bit x"], times[f"tg{TG} llama-bench"]
    ahead = sum(a < b for a, b in zip(ours, theirs))
    print(f"8-bit x against llama-bench: {statistics.median(theirs) / statistics.median(ours):.2f}x its speed "
          f"(medians), ahead in {ahead} of {reps} reps", flush=True)


def block_ab(engine: LLMEngine, trials: int) -> None:
    """The first sparse layer's MoE block alone on random rows, fused and per expert, alternating
    call by call, at 1 and 16 tokens: min and median of `trials` calls each. Calls of a few ms, so
    that some run while no other process takes a core: the min is that uncontended time."""
    model = engine.runner.worker.model
    block = next(layer.mlp for layer in model.layers if getattr(layer.mlp, "fused_experts", None) is not None)
    fused = block.fused_experts
    for tokens in (1, 16):
        x = torch.randn(tokens, block.gate.in_features)
        times: dict[str, list[float]] = defaultdict(list)
        with torch.no_grad():
            for _ in range(trials):
                for name, experts in (("fused", fused), ("per-expert", None)):
                    block.fused_experts = experts
                    start = time.perf_counter()
                    block.forward(x, model.ops)
                    times[name].append(time.perf_counter() - start)
        block.fused_experts = fused
        print("  ".join(f"MoE block, {tokens} tokens, {name}: min {min(t) * 1e3:.2f} ms, median "
                        f"{statistics.median(t) * 1e3:.2f} ms" for name, t in times.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--int8-rows", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--per-expert", action="store_true")
    ap.add_argument("--alternate", action="store_true", help="tg32 with float32 x, 8-bit x and llama-bench, "
                                                             "rep by rep (needs --int8-rows and --llama-bench)")
    ap.add_argument("--llama-bench", type=Path, help="llama-bench's path: timed beside each --per-expert rep")
    ap.add_argument("--batch", type=int, default=0, help="instead: decode steps of this many requests at once")
    ap.add_argument("--llama-batched-bench", type=Path, help="timed beside each --batch rep")
    ap.add_argument("--tokenizer", help="a Hugging Face tokenizer directory instead of the file's own "
                                        "(EngineConfig.tokenizer)")
    args = ap.parse_args()
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(args.path), kv_cache_memory="1GiB", max_model_len=4096,
                                    num_threads=args.threads, enable_prefix_caching=False, tokenizer=args.tokenizer))
    print(f"{args.path}: loaded in {time.perf_counter() - start:.0f} s, {args.threads} threads", flush=True)
    if args.profile:
        profile(engine, TG)
        return
    if args.alternate:
        if not (args.int8_rows and args.llama_bench):
            ap.error("--alternate needs --int8-rows and --llama-bench")
        tg_step(engine, -1)  # warm-up
        alternate(engine, args.reps, args.int8_rows, (args.llama_bench, args.path, args.threads))
        return
    if args.batch:
        batch_step(engine, -1, args.batch)  # warm-up
        batched(engine, args.reps, args.batch, args.llama_batched_bench, args.path, args.threads)
        if args.int8_rows:
            set_int8_rows(engine.runner.worker.model, args.int8_rows)
            times = [batch_step(engine, 100 + r, args.batch) for r in range(args.reps)]
            report(f"batch-{args.batch} int8 x", args.batch, times)
        return
    tg_step(engine, -1)  # warm-up
    report(f"tg{TG} step", 1, [tg_step(engine, r) for r in range(args.reps)])
    report(f"pp{PP} step", PP, [pp_step(engine, r) for r in range(args.reps)])
    bench = (args.llama_bench, args.path, args.threads) if args.llama_bench else None
    if args.per_expert:
        block_ab(engine, 200)
        per_expert(engine, args.reps, "", bench)
    if args.int8_rows:
        set_int8_rows(engine.runner.worker.model, args.int8_rows)
        tg_step(engine, -2)
        report(f"tg{TG} int8 x", 1, [tg_step(engine, r) for r in range(args.reps)])
        report(f"pp{PP} int8 x", PP, [pp_step(engine, r) for r in range(args.reps)])
        if args.per_expert:
            block_ab(engine, 200)
            per_expert(engine, args.reps, " int8 x", bench)


if __name__ == "__main__":
    main()
