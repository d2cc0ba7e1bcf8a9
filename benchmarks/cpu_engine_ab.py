"""Two (or more) builds of the CPU kernels, an engine on each, in one process: decode steps, or the
default workload's shape, alternated between them, so the machine's drift falls on both alike.

    python benchmarks/cpu_engine_ab.py old=/tmp/old/tokenmill/csrc new=tokenmill/csrc \
        [--batch 64 --prompt 250 --rounds 12 --steps 6] [--workloads 4] [--prefill 4000] [--model PATH] \
        [--kv-cache-dtypes auto int8] [--block-sizes 16 32]

Only the kernels differ between the engines, or with --kv-cache-dtypes or --block-sizes (one per
build, in order) their KV pools too: the Python is this checkout's. Decode steps: each
engine takes `batch` requests of `prompt` tokens, then the engines run `steps` decode steps in turn,
`rounds` times, their order reversed every other round; each round's median step is compared.
Workloads: each engine runs one warm-up workload (its pool's pages faulted in), then the default
workload's shape with seed 100, 101, ... (a new one each round, so no prefix-cache hits; the same
for every engine), the order of the engines reversed every other round. Prefill: each round, each
engine computes a new lone prompt of that many tokens (one output token), in alternating order.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the checkout this runs in
from kernel_builds import build_named  # noqa: E402 (beside this script)

import tokenmill.cpu_kernels as cpu_kernels  # noqa: E402
from tokenmill.bench.throughput import run_engine  # noqa: E402
from tokenmill.bench.workloads import random_workload  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.models.loader import default_model_path  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402


def engine_on(module, model: str | None = None, kv_cache_dtype: str = "auto", block_size: int = 16) -> LLMEngine:
    """An engine of `model` (default: the default model) whose kernels come from `module` (the
    engine takes them from load_cpu_kernels while it is built)."""
    original = cpu_kernels._build
    cpu_kernels._build = lambda: module
    try:
        return LLMEngine(EngineConfig(model=model or str(default_model_path()), kv_cache_dtype=kv_cache_dtype,
                                      block_size=block_size))
    finally:
        cpu_kernels._build = original


def decode_steps(engines: dict[str, LLMEngine], args: argparse.Namespace) -> None:
    for engine in engines.values():
        # requests that outlast the prompts' steps too: the first ones decode while the last ones'
        # prompts are still being computed
        params = SamplingParams(max_tokens=engine.scheduler.config.max_model_len - args.prompt, ignore_eos=True,
                                temperature=0.0)
        for i in range(args.batch):
            engine.add_request(f"r{i}", [100 + (7 * i + j) % 5000 for j in range(args.prompt)], params)
        while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
            engine.step()  # the prompts
    lengths = [r.num_tokens for r in next(iter(engines.values())).scheduler.running]
    print(f"{len(lengths)} requests, contexts {min(lengths)}-{max(lengths)} when the decode steps start")
    times: dict[str, list[list[float]]] = {name: [] for name in engines}  # per round, its steps
    for r in range(args.rounds):
        order = list(engines.items())
        for name, engine in order if r % 2 == 0 else reversed(order):
            times[name].append([])
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times[name][-1].append(time.perf_counter() - start)
    first = next(iter(times))
    for name, rounds in times.items():
        ratios = " ".join(f"{statistics.median(mine) / statistics.median(theirs):.3f}"
                          for mine, theirs in zip(rounds, times[first]))
        print(f"{name}: median decode step {statistics.median(sum(rounds, [])) * 1e3:.2f} ms "
              f"(batch {args.batch}); "
              f"each round's median against {first}'s: {ratios}")


def alternated(engines: dict[str, LLMEngine], rounds: int, run, what: str) -> None:
    """run(name, engine, round) -> seconds, for every engine each round, the order reversed every
    other round; prints each engine's median and its per-round ratios to the first engine's."""
    walls: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        order = list(engines.items())
        for name, engine in order if r % 2 == 0 else reversed(order):
            walls[name].append(run(name, engine, r))
            print(f"round {r}: {name} {walls[name][-1]:.2f} s", flush=True)
    first = next(iter(walls))
    for name, ws in walls.items():
        ratios = " ".join(f"{w / f:.3f}" for w, f in zip(ws, walls[first]))
        print(f"{name}: {what}, median {statistics.median(ws):.3f} s, per round against {first}: {ratios}")


def workloads(engines: dict[str, LLMEngine], rounds: int) -> None:
    for engine in engines.values():
        run_engine(engine, random_workload(seed=99), "warm-up", progress=False)
    alternated(engines, rounds, lambda name, engine, r: run_engine(
        engine, random_workload(seed=100 + r), name, progress=False).wall, "default workload")


def prefills(engines: dict[str, LLMEngine], tokens: int, rounds: int) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def one(name: str, engine: LLMEngine, r: int) -> float:
        engine.add_request(f"p{r}", [100 + (13 * r + j) % 5000 for j in range(tokens)], params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    alternated(engines, rounds, one, f"a {tokens}-token prompt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="name=path/to/csrc")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workloads", type=int, default=0, help="alternate this many workloads instead")
    parser.add_argument("--prefill", type=int, default=0, help="time lone prompts of this many tokens instead")
    parser.add_argument("--model", default=None, help="another model than the default one")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=None, help="each build's engine's pool dtype")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=None, help="each build's engine's block size")
    args = parser.parse_args()
    dtypes = args.kv_cache_dtypes or ["auto"] * len(args.builds)
    blocks = args.block_sizes or [16] * len(args.builds)
    if len(dtypes) != len(args.builds) or len(blocks) != len(args.builds):
        parser.error("--kv-cache-dtypes and --block-sizes need one value per build")
    engines = {name: engine_on(module, args.model, dtype, block)
               for (name, module), dtype, block in zip(build_named(args.builds).items(), dtypes, blocks)}
    if args.workloads:
        workloads(engines, args.workloads)
    elif args.prefill:
        prefills(engines, args.prefill, args.rounds)
    else:
        decode_steps(engines, args)


if __name__ == "__main__":
    main()
