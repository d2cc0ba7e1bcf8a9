"""The `tokenmill bench throughput` driver: build the workload and engines, run, print tables."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from tokenmill.bench.throughput import RunResult, format_split, format_table, run_engine, run_hf_generate, run_static
from tokenmill.bench.workloads import long_workload, prefix_workload, random_workload
from tokenmill.cli_args import engine_config_from_args
from tokenmill.models.cpu_packing import EVERY_STEP


def _engine(args, label: str | None = None, **overrides):
    """The engine a run measures; a baseline's (label) traces to its own file beside --trace-file's,
    e.g. trace.static.json."""
    from tokenmill.engine import LLMEngine
    config = dataclasses.replace(engine_config_from_args(args), model=args.model, **overrides)
    if label is not None and config.trace_file:
        path = Path(config.trace_file)
        config = dataclasses.replace(config, trace_file=str(path.with_name(f"{path.stem}.{label}{path.suffix}")))
    return LLMEngine(config)


def _workload(args, vocab_size: int):
    """The workload's requests, token ids below 10000 (or the model's vocabulary, if smaller)."""
    vocab = min(10000, vocab_size)
    if args.workload == "random":
        return random_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.dataset_seed,
                               vocab=vocab)
    if args.workload == "prefix":
        return prefix_workload(args.num_requests, seed=args.dataset_seed, vocab=vocab)
    return long_workload(seed=args.dataset_seed, vocab=vocab)


def _sampling(args) -> dict:
    """run_engine's sampling settings from the command line (greedy unless --temperature)."""
    return {"temperature": args.temperature, "top_p": args.top_p}


def bench_throughput(args) -> dict:
    if args.workload != "random" and (args.compare or args.pressure or args.plot is not None):
        raise ValueError("--compare, --pressure and --plot run with --workload random")
    if args.compare and (args.temperature != 0.0 or args.top_p != 1.0):
        raise ValueError("--compare runs greedy (static batching and transformers' generate are greedy here): "
                         "leave --temperature and --top-p at their defaults")
    engine = _engine(args)
    workload = _workload(args, engine.model_config.vocab_size)
    print(f"workload {args.workload}: {len(workload)} requests, "
          f"{sum(len(r.prompt_token_ids) for r in workload)} prompt and "
          f"{sum(r.max_tokens for r in workload)} output tokens; attention backend {engine.runner.worker.backend.name}")
    arithmetic = engine.arithmetic
    rows = arithmetic["gguf_int8_rows"]
    amx = f" (on AMX tiles from {arithmetic['amx_min_rows']} rows)" if arithmetic["amx_min_rows"] else ""
    bf16 = f"bfloat16 weights and x in the products{amx}, " if arithmetic["bf16_weights"] else ""
    print(f"arithmetic: {arithmetic['dtype']}, KV pool {arithmetic['kv_dtype']}, {bf16}GGUF products with 8-bit x "
          f"{'at every step' if rows >= EVERY_STEP else f'in steps of up to {rows} rows' if rows else 'never'}")
    if args.workload == "long":
        return _bench_long(args, engine, workload)
    if args.workload == "prefix":
        return _bench_prefix(args, engine, workload)

    results = [run_engine(engine, workload, "tokenmill", **_sampling(args))]
    summary = {}
    if args.pressure:
        summary["pressure"] = _bench_pressure(args, results[0], workload, engine.cache_config.block_size)
    if args.compare:
        results += _compare(args, engine.model_path, workload, "bfloat16" if arithmetic["bf16_weights"] else None)
    print()
    print(format_table(results))
    print(format_split(results[0]))
    if args.plot is not None:
        from tokenmill.bench.plots import plot_occupancy
        print(f"plot: {plot_occupancy(results, args.plot)}")
    print(_waste_line(results[0], engine.cache_config.block_size))
    return {"workload": args.workload, "arithmetic": arithmetic, "results": [r.summary() for r in results],
            **summary}


def _compare(args, model_path, workload, hf_dtype: str | None) -> list[RunResult]:
    """The baselines beside tokenmill: its static batching, then transformers' generate (in
    `hf_dtype`: bfloat16 where tokenmill's products take bfloat16 weights, so that each runs in the
    same dtype). One that fails is reported and skipped, so the tables already measured are still
    printed."""
    batch = args.max_num_seqs
    if hf_dtype is not None:
        print(f"--compare: transformers generate in {hf_dtype}, the dtype of tokenmill's weights")

    def static() -> RunResult:
        return run_static(_engine(args, "static", static_batching=True, enable_prefix_caching=False), workload, batch,
                          pad_token_id=0)

    results = []
    for name, run in (("static batching", static),
                      ("transformers generate", lambda: run_hf_generate(model_path, workload, batch, args.device,
                                                                        dtype=hf_dtype))):
        try:
            results.append(run())
        except Exception as exc:  # a baseline's failure is not the engine's: keep what was measured
            print(f"--compare: {name} failed ({type(exc).__name__}: {exc}); left out of the table")
    return results


def kv_waste(result: RunResult, block_size: int) -> tuple[float, float]:
    """(mean, max) share of allocated KV slots holding no computed token, over the decode
    steps where every request is admitted (steady state)."""
    steady = [s for s in result.steps if s.num_prefill_tokens == 0 and s.num_waiting == 0 and s.kv_blocks_used]
    shares = [1 - s.kv_slots_used / (s.kv_blocks_used * block_size) for s in steady] or [0.0]
    return float(np.mean(shares)), float(np.max(shares))


def _waste_line(result: RunResult, block_size: int) -> str:
    mean, worst = kv_waste(result, block_size)
    return f"KV memory waste at steady state (block size {block_size}): mean {mean:.1%}, max {worst:.1%}"


def _bench_pressure(args, roomy: RunResult, workload, block_size: int) -> dict:
    """The same requests with the pool cut to a quarter of the peak the roomy run used."""
    peak = max(s.kv_blocks_used for s in roomy.steps)
    largest = max(-(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) for r in workload)
    pool = max(peak // 4, largest)  # a quarter of the peak, but room for the longest request alone
    engine = _engine(args, "pressure", num_kv_blocks=pool, kv_cache_memory=None)
    tight = run_engine(engine, workload, "pressure-1/4-pool", **_sampling(args))
    preemptions = sum(s.num_preemptions for s in tight.steps)
    same = tight.outputs == roomy.outputs
    differing = sum(a != b for a, b in zip(tight.outputs, roomy.outputs))
    print()
    print(format_table([roomy, tight]))
    print(f"pressure run: pool {pool} of the {peak} blocks the roomy run peaked at; "
          f"{len(tight.outputs)}/{len(workload)} requests completed; {preemptions} preemptions; "
          f"outputs equal to the roomy run: {same} ({differing} requests differ)")
    return {"peak_blocks": peak, "pool_blocks": pool, "preemptions": preemptions,
            "completed": len(tight.outputs), "outputs_equal": same, "requests_differing": differing,
            "result": tight.summary()}


def _bench_prefix(args, engine, workload) -> dict:
    """Prefix caching on vs off on the shared-system-prompt workload."""
    on = run_engine(engine, workload, "prefix-cache-on", **_sampling(args))
    off_engine = _engine(args, "prefix-off", enable_prefix_caching=False)
    off = run_engine(off_engine, workload, "prefix-cache-off", **_sampling(args))
    stats = engine.scheduler.stats()
    hit = stats.prefix_tokens_hit / max(stats.prefix_tokens_queried, 1)
    print()
    print(format_table([on, off], reference="prefix-cache-on"))
    print(f"mean TTFT: on {np.mean(on.ttft) * 1e3:.0f} ms, off {np.mean(off.ttft) * 1e3:.0f} ms; "
          f"prefix-cache hit rate {hit:.1%}; outputs equal: {on.outputs == off.outputs}")
    print(_waste_line(on, engine.cache_config.block_size))
    return {"workload": "prefix", "results": [on.summary(), off.summary()], "hit_rate": hit}


def _bench_long(args, engine, workload) -> dict:
    """p99 inter-token latency of 32 decoding sequences from the moment a 4,000-token prompt
    arrives (after step 20, when all 32 are decoding), against the same moment without it."""
    short, long = workload[:-1], workload[-1:]
    alone = run_engine(engine, short, "decodes-alone", inject=(20, []), **_sampling(args))
    mixed = run_engine(engine, short, "with-long-prompt", inject=(20, long), **_sampling(args))
    gaps_alone, gaps_mixed = _gaps_after_mark(alone, len(short)), _gaps_after_mark(mixed, len(short))
    p99_alone, p99_mixed = np.percentile(gaps_alone, 99), np.percentile(gaps_mixed, 99)
    threshold = engine.scheduler.config.long_prefill_token_threshold
    min_chunk = engine.scheduler.config.long_prefill_min_chunk
    print()
    print(f"{'32 decoding sequences':<24} {'p50 ITL ms':>10} {'p99 ITL ms':>10} {'max ITL ms':>10}")
    for name, gaps in (("alone", gaps_alone), ("with a 4k prompt", gaps_mixed)):
        print(f"{name:<24} {np.percentile(gaps, 50) * 1e3:>10.1f} {np.percentile(gaps, 99) * 1e3:>10.1f} "
              f"{max(gaps) * 1e3:>10.1f}")
    print(f"p99 ITL ratio (with / alone): {p99_mixed / p99_alone:.2f}x; long prompt TTFT {mixed.ttft[-1]:.1f} s; "
          f"budget {args.max_num_batched_tokens} tokens/step; " + (
              f"beside decodes, prompts over {threshold} tokens get max({min_chunk}, "
              "decodes / 2) a step" if threshold else "long-prompt chunks not capped"))
    return {"workload": "long", "results": [alone.summary(), mixed.summary()], "p99_itl_alone_s": p99_alone,
            "p99_itl_with_long_s": p99_mixed, "ratio": p99_mixed / p99_alone, "long_ttft_s": mixed.ttft[-1]}


def _gaps_after_mark(result: RunResult, num_short: int) -> list[float]:
    """Inter-token gaps of the first `num_short` requests whose later token came after the mark."""
    return [b - a for times in result.token_times[:num_short] for a, b in zip(times, times[1:])
            if b > result.mark_time]
