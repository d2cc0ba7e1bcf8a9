"""The engine's host time per step at a large batch, with a tiny model whose forward pass costs
little: scheduling, step preparation and detokenizing are the same Python on a CPU as on a GPU,
where the nano-vllm workload is bound by them (BENCHMARKS.md, GPU section).

    python benchmarks/host_steps.py [--no-prefix-cache] [--rounds 3]

256 requests (prompts of 20..100 random tokens, 300..900 output tokens, greedy, EOS ignored) on
a random 2-layer Llama with a byte-level tokenizer, up to 256 sequences a step. Each round runs
the same requests again in the same engine, so later rounds also hit the prefix cache.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]

from conftest import build_tiny_model  # noqa: E402

from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

PARTS = ("schedule", "prepare", "forward", "sample", "detokenize")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama", byte_tokenizer=True)
    engine = LLMEngine(EngineConfig(model=str(model), max_num_seqs=256, max_num_batched_tokens=4096,
                                    max_model_len=1024, enable_prefix_caching=not args.no_prefix_cache))
    rng = random.Random(0)
    reqs = [([rng.randrange(2, 384) for _ in range(rng.randint(20, 100))], rng.randint(300, 900)) for _ in range(256)]
    print(f"{'round':>5} {'steps':>6} {'wall s':>7} " + " ".join(f"{p:>10}" for p in PARTS) + "  host ms/step")
    for round_ in range(args.rounds):
        steps = []
        engine.stats_listeners[:] = [steps.append]
        for i, (prompt, n) in enumerate(reqs):
            engine.add_request(f"{round_}-{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        wall = time.perf_counter() - start
        split = {p: sum(getattr(s, f"time_{p}") for s in steps) for p in PARTS}
        host = split["schedule"] + split["prepare"] + split["detokenize"]
        print(f"{round_:>5} {len(steps):>6} {wall:>7.2f} " + " ".join(f"{split[p]:>10.3f}" for p in PARTS)
              + f"  {host / len(steps) * 1e3:>12.2f}", flush=True)


if __name__ == "__main__":
    main()
