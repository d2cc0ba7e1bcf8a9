"""GPU checks and the nano-vllm workload, for a machine with CUDA (run from the repo root).

    python benchmarks/gpu_bench.py check              # CUDA path vs transformers on tiny models
    python benchmarks/gpu_bench.py kernels            # attention kernels timed at the model's shapes
    python benchmarks/gpu_bench.py bench [--hf-cb] [--modes graphs,eager]  # 256 requests, prompts/outputs 100..1024

`check`: greedy generation on CUDA (float32) equals transformers' on each prompt alone, with
chunked prefill and forced preemption, by recompute and by swap; bfloat16 runs too.
`bench`: a Qwen3-0.6B-shaped model with random weights (no hub access needed), nano-vllm's
workload (256 requests, prompt and output lengths uniform in 100..1024, EOS ignored), through
tokenmill and, with --hf-cb, through transformers' own continuous batching on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit"))

OUT = Path(os.environ.get("OUT", "/tmp"))


def build_qwen3_0_6b(path: Path) -> Path:
    """Qwen3-0.6B's shape with random weights, saved as a Hugging Face directory."""
    from conftest import _save_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM
    if (path / "config.json").exists():
        return path
    config = AutoConfig.for_model(
        "qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    _save_tokenizer(path, 151936)
    return path


def check() -> dict:
    from conftest import build_tiny_model
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM, SamplingParams

    results = {"attention": check_attention()}
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 384) for _ in range(n)] for n in (1, 5, 17, 64, 100, 150, 200, 300)]
    for arch in ("llama", "qwen2", "qwen3"):
        # head_dim 32 for qwen3 (the tests' 24 is no tile Triton takes, so it would run the torch backend)
        path = build_tiny_model(Path(f"/tmp/tiny-{arch}"), arch, **({"head_dim": 32} if arch == "qwen3" else {}))
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
        refs = []
        for p in prompts:
            with torch.no_grad():
                out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                                  eos_token_id=1, pad_token_id=1, attention_mask=torch.ones(1, len(p), device="cuda"))
            refs.append(out[0, len(p):].tolist())
        for mode, eager, ahead in (("recompute", False, True), ("swap", False, True), ("recompute", True, True),
                                   ("recompute", False, False)):
            llm = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                      num_kv_blocks=24, preemption_mode=mode, swap_space=1 << 26, enforce_eager=eager,
                      async_scheduling=ahead,
                      long_prefill_token_threshold=0)  # whole-budget chunks: the small pool fills, forcing preemptions
            mode += (" eager" if eager else " graphs") + ("" if ahead else " no-ahead")
            greedy = SamplingParams(max_tokens=24, temperature=0)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
            same = [o.outputs[0].token_ids == r for o, r in zip(outs, refs)]
            sched = llm.engine.scheduler
            backend = llm.engine.runner.worker.backend.name
            results[f"{arch}/{mode}"] = {"equal": all(same), "preemptions": sched.num_preemptions,
                                         "swapped_out": sched.num_swapped_out, "backend": backend,
                                         "graphs": llm.engine.runner.worker.graphs is not None}
            print(f"{arch:6s} {mode:25s} {backend} equal to transformers: {all(same)} {same} preemptions "
                  f"{sched.num_preemptions} swapped {sched.num_swapped_out}", flush=True)
        llm = LLM(str(path), device="cuda")  # bfloat16 default
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8), use_tqdm=False)
        results[f"{arch}/bf16"] = {"ok": all(len(o.outputs[0].token_ids) >= 1 for o in out),
                                   "dtype": str(llm.engine.dtype)}
    return results


def check_attention() -> dict:
    """Triton kernels (decodes and long prompt chunks) against the reference backend computed in
    float32 on the same pool, at the shapes of the benchmark model (D = 128, G = 2)."""
    from test_attention import _to, build_case

    from tokenmill.attention import make_backend

    results = {}
    query_lens = [1] * 8 + [700, 64, 1500, 3]
    seq_lens = [5, 17, 300, 1000, 1, 64, 2049, 900] + [1700, 64, 1500, 2003]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 1e-2)):
        case = build_case(query_lens, seq_lens, seed=4, hkv=8, hq=16, d=128)
        q, k, v, k_cache, v_cache = (x.cuda().to(dtype) for x in case[:5])
        meta = _to(case[5], "cuda")
        triton_out = make_backend("triton", torch.device("cuda"), 16, 128).forward(
            q, k, v, k_cache.clone(), v_cache.clone(), meta, 128 ** -0.5)
        ref = make_backend("reference", torch.device("cuda")).forward(
            q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, 128 ** -0.5)
        err = float((triton_out.float() - ref).norm() / ref.norm())
        results[str(dtype)] = {"rel_err": err, "ok": err < tol and bool(torch.isfinite(triton_out).all())}
        print(f"triton attention {dtype}: relative error {err:.1e} (tolerance {tol:.0e})", flush=True)
    return results


def kernels() -> dict:
    """Attention of one layer at the benchmark model's shapes (D = 128, 16 query and 8 kv heads,
    bfloat16): the decode kernel with 16 or 64 keys a step, whole or split, at several batch sizes, and a prompt
    step of 29 chunks through the prefill kernel and through per-sequence SDPA."""
    from triton.testing import do_bench

    from tokenmill.attention import AttentionMetadata
    from tokenmill.attention.reference import attend_sequences
    from tokenmill.attention.triton_decode import decode_splits, paged_decode, paged_prefill

    torch.manual_seed(0)
    dev, bs, results = torch.device("cuda"), 16, {}
    k_cache = torch.randn(40000, 8, bs, 128, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    for b in (1, 32, 256):
        ctx = 1500
        q = torch.randn(b, 16, 128, device=dev, dtype=torch.bfloat16)
        tables = torch.randperm(40000, device=dev)[:b * 94].view(b, 94).int()
        seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        splits = decode_splits(b, 8, torch.cuda.get_device_properties(dev).multi_processor_count)
        for block_n, num_splits in sorted({(16, 1), (64, 1), (64, splits)}):
            ms = do_bench(lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.088, block_n=block_n,
                                               num_splits=num_splits), return_mode="median")
            gbs = b * ctx * 8 * 128 * 2 * 2 / ms / 1e6
            results[f"decode b={b} ctx={ctx} block_n={block_n} splits={num_splits}"] = {"ms": ms, "GB/s": gbs}
            print(f"decode  batch {b:3d} context {ctx}, {block_n:2d} keys a step, {num_splits:2d} splits: "
                  f"{ms * 1e3:7.1f} us  {gbs:6.0f} GB/s", flush=True)
    rng = random.Random(0)
    lens = [rng.randint(100, 1024) for _ in range(29)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    tables = torch.randperm(40000, device=dev)[:29 * 64].view(29, 64).int()
    meta = AttentionMetadata(
        slot_block=None, slot_offset=None, query_start_loc=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=tables,
        query_start_loc_host=cu, seq_lens_host=lens, block_size=bs)
    q = torch.randn(cu[-1], 16, 128, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for name, fn in (("prefill kernel", lambda: paged_prefill(q, k_cache, v_cache, meta, 0.088, out)),
                     ("per-sequence SDPA", lambda: attend_sequences(q, k_cache, v_cache, meta, 0.088, out))):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first = (time.perf_counter() - start) * 1e3
        ms = do_bench(fn, return_mode="median")
        results[f"prefill {name}"] = {"first_ms": first, "ms": ms}
        print(f"prefill {cu[-1]} tokens in 29 chunks, {name}: first call {first:8.1f} ms, then {ms:6.2f} ms",
              flush=True)
    return results


def workload(seed: int = 0, n: int = 256, vocab: int = 10000):
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024)) for _ in range(n)]


MODES = {"graphs": {}, "eager": {"enforce_eager": True}, "no_ahead": {"async_scheduling": False},
         "sync": {"async_scheduling": False, "async_output": False}, "torch_ops": {"kernels": "torch"}}


def bench_tokenmill(model: Path, reqs, args, mode: str = "graphs") -> dict:
    from tokenmill.config import EngineConfig
    from tokenmill.engine import LLMEngine
    from tokenmill.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model), device="cuda", max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=4096,
                                    kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
                                    **MODES[mode]))
    # warm up: one short request
    engine.add_request("warm", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    steps = []
    engine.stats_listeners.append(steps.append)
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0))
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.new_token_ids)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    split = {k: sum(getattr(s, f"time_{k}") for s in steps) for k in ("schedule", "prepare", "forward", "sample",
                                                                       "detokenize")}
    del engine
    torch.cuda.empty_cache()  # give the KV pool back before the next engine takes its own
    return {"engine": "tokenmill" + ("" if mode == "graphs" else f" ({mode})"), "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall, "steps": len(steps), "time_split_s": split,
            "preemptions": sum(s.num_preemptions for s in steps),
            "per_step": [(s.num_seqs, s.num_prefill_tokens, s.time_total, s.time_forward, s.time_sample)
                         for s in steps]}


def bench_hf_cb(model: Path, reqs, time_limit: float) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).cuda().eval()
    config = GenerationConfig(max_new_tokens=1024, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = hf.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        warm = manager.add_request([1, 2, 3], max_new_tokens=4, eos_token_id=-1)
        while manager.get_result(request_id=None, timeout=60) is None:
            pass
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in reqs]
        pending, tokens = set(ids), 0
        while pending and time.perf_counter() - start < time_limit:
            result = manager.get_result(timeout=5)
            if result is not None and result.request_id in pending:
                pending.discard(result.request_id)
                tokens += len(result.generated_tokens)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    del warm
    # If the time limit cut it short, this counts only the requests that finished (a lower bound).
    return {"engine": "transformers continuous batching", "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall, "unfinished_requests": len(pending)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["check", "kernels", "bench"])
    parser.add_argument("--hf-cb", action="store_true")
    parser.add_argument("--modes", default="graphs", help="tokenmill runs in order, e.g. graphs,eager,graphs "
                        "(eager: without decode graphs; no_ahead: without async scheduling; sync: also outputs "
                        "built at once, not during the next step; torch_ops: torch's element-wise ops, not "
                        "the Triton ones)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--kv-cache-memory", default="24GiB")
    parser.add_argument("--hf-time-limit", type=float, default=420.0)
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    if args.what == "check":
        result = check()
    elif args.what == "kernels":
        result = kernels()
    else:
        model = build_qwen3_0_6b(Path("/tmp/qwen3-0.6b-random"))
        reqs = workload(n=args.num_requests)
        prompt_tokens, output_tokens = sum(len(p) for p, _ in reqs), sum(n for _, n in reqs)
        print(f"{len(reqs)} requests, {prompt_tokens} prompt and {output_tokens} output tokens", flush=True)
        result = {}
        for i, mode in enumerate(args.modes.split(",")):
            run = bench_tokenmill(model, reqs, args, mode)
            key = "tokenmill" + ("" if mode == "graphs" else f"_{mode}")
            result[key if key not in result else f"{key}_{i}"] = run  # a repeated mode keeps each run
            (OUT / f"gpu_steps_{i}_{mode}.json").write_text(json.dumps(run.pop("per_step")))
            print(run, flush=True)
        if "tokenmill_eager" in result and "tokenmill" in result:
            ratio = result["tokenmill"]["output_tok_s"] / result["tokenmill_eager"]["output_tok_s"]
            print(f"decode graphs / eager: {ratio:.2f}x", flush=True)
        if args.hf_cb:
            result["transformers_cb"] = bench_hf_cb(model, reqs, args.hf_time_limit)
            print(result["transformers_cb"], flush=True)
            result["ratio"] = result["tokenmill"]["output_tok_s"] / result["transformers_cb"]["output_tok_s"]
            print(f"tokenmill / transformers CB: {result['ratio']:.2f}x", flush=True)
    (OUT / f"gpu_{args.what}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
