"""What the default arithmetic costs in quality against the exact one, on the default model: the
engine's defaults (on a CPU with VNNI: x in 8-bit blocks, a float16 KV pool) against
`dtype="float32"` (GGUF blocks decoded exactly, a float32 pool), and any other options given;
with --model a Hugging Face directory, its defaults (with AVX512-BF16: bfloat16 weights, x in the
products and pool) against float32.

    python benchmarks/cpu_auto_quality.py [--kv-cache-dtype bfloat16] [--gguf-int8-rows 0] [--model DIR]
                                          [--tokens 4800] [--window 300]

Two measures: the perplexity of the first --tokens tokens of README.md fed one decode step at a
time, with the top-1 agreement and KL divergence of the next-token distributions, and the range of
the perplexity's change over windows of --window tokens (how far a shorter text's figure strays
from the whole's: an 8-bit path's change over 300 tokens moves by points with 1e-6 changes in the
kernels, over 4800 it holds, BENCHMARKS.md); and twelve chat questions' 48-token greedy answers,
how many are identical and the mean length of the prefix they share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpu_step_paths import compare_log_probs, decode_log_probs  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Write a haiku about the sea.",
             "How do I reverse a list in Python?", "What causes the seasons on Earth?",
             "Give me three tips for a good night's sleep.", "Who wrote Romeo and Juliet?",
             "Explain photosynthesis in one paragraph.", "What is 17 times 23?",
             "Name three planets of the solar system.", "What is a prime number?",
             "Describe a cat to someone who has never seen one."]


def answers(llm: LLM) -> list[list[int]]:
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def window_changes(exact: torch.Tensor, other: torch.Tensor, ids: list[int], window: int) -> list[float]:
    """The perplexity's relative change (other against exact) over each whole window of `window` tokens."""
    changes = []
    for start in range(0, len(ids) - window + 1, window):
        c = compare_log_probs(exact[start:start + window], other[start:start + window], ids[start:start + window])
        changes.append(c["ppl"] / c["ppl_exact"] - 1)
    return changes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--gguf-int8-rows", type=int, default=None)
    parser.add_argument("--model", default=None, help="another model than the default one (a Hugging Face "
                        "directory: its defaults on a CPU with AVX512-BF16 are bfloat16 weights and pool)")
    parser.add_argument("--tokens", type=int, default=4800, help="tokens of README.md to score")
    parser.add_argument("--window", type=int, default=300, help="tokens per window of the spread")
    args = parser.parse_args()
    exact = LLM(args.model, dtype="float32")
    other = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, gguf_int8_rows=args.gguf_int8_rows)
    worker = other.engine.runner.worker
    print(f"exact: float32 pool, int8_rows 0; other: {worker.kv_cache.dtype} pool, options {vars(args)}")
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    ids = exact.engine.tokenizer.encode(text)[:args.tokens]
    lp = [decode_log_probs(llm.engine, ids) for llm in (exact, other)]
    c = compare_log_probs(*lp, ids)
    print(f"perplexity over {len(ids)} tokens of README.md: {c['ppl_exact']:.3f} exact, {c['ppl']:.3f} other "
          f"({c['ppl'] / c['ppl_exact'] - 1:+.2%}); top-1 agreement {c['agree']:.1%}; KL mean {c['kl_mean']:.4f}, "
          f"max {c['kl_max']:.4f}")
    changes = window_changes(*lp, ids, args.window)
    if len(changes) > 1:
        print(f"over its {len(changes)} windows of {args.window} tokens: perplexity change from {min(changes):+.2%} "
              f"to {max(changes):+.2%}, median {statistics.median(changes):+.2%}")
    a, b = answers(exact), answers(other)
    same = sum(x == y for x, y in zip(a, b))
    mean_prefix = sum(shared_prefix(x, y) for x, y in zip(a, b)) / len(a)
    print(f"greedy chat answers (48 tokens): {same} of {len(a)} identical, mean shared prefix {mean_prefix:.1f} tokens")


if __name__ == "__main__":
    main()
