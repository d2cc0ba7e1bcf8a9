"""vLLM (CPU build) on tokenmill's default workload, for a side-by-side throughput comparison.

Measures the wall time of one offline `LLM.generate` over all of `random_workload()` (token-id prompts,
greedy, EOS ignored, exact output lengths) after a small warm-up; model load and compilation are excluded.
Run with the vLLM venv (not tokenmill's), e.g.:

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \
        /work/peers/vllm/bin/python benchmarks/vllm_default_workload.py --model /work/peers/smollm2-hf --dtype bfloat16

Without the first two variables vLLM computes on one core; VLLM_CPU_KVCACHE_SPACE (GiB) fixes the KV cache
size instead of reserving 90% of RAM. 2 GiB holds all 64 requests at once even in float32.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

for _key, _value in (("VLLM_CPU_OMP_THREADS_BIND", "0-1"), ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
                     ("VLLM_CPU_KVCACHE_SPACE", "2")):
    os.environ.setdefault(_key, _value)

import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

WORKLOADS_FILE = Path(__file__).resolve().parent.parent / "tokenmill" / "bench" / "workloads.py"


def load_workloads_module() -> ModuleType:
    """Import tokenmill's workloads.py on its own, without the tokenmill package (and its dependencies)."""
    spec = importlib.util.spec_from_file_location("tokenmill_bench_workloads", WORKLOADS_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks the module up while building BenchRequest
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()

    workloads = load_workloads_module()
    workload = workloads.random_workload(num_requests=args.num_requests)
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, max_model_len=1024, max_num_seqs=max(args.num_requests, 2),
              tensor_parallel_size=1, disable_log_stats=True)

    # Warm up on other prompts (seed 1), so prefix caching gives the timed run no head start.
    warm = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in workloads.random_workload(2, seed=1)]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0), use_tqdm=False)

    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in workload]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0) for r in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(r.max_tokens for r in workload)
    if produced != expected:
        print(f"warning: produced {produced} output tokens, expected {expected}")
    print(f"vllm {vllm.__version__} {args.dtype}: {len(outputs)} requests, {produced} output tokens in "
          f"{elapsed:.2f} s, {produced / elapsed:.1f} output tok/s")


if __name__ == "__main__":
    main()
