"""What storing the KV pool's rows in 8 bits costs in quality, format against format, on the default
model: an engine with a float32 pool whose used rows are rounded through a format after every
decode step, so that each format sees the same keys and values the exact pool holds.

    python benchmarks/kv_row_formats.py

Formats: float16; int8 with a scale per row, max |x| / 127 (the engine's kv_cache_dtype="int8");
fp8-e4m3 with a scale per row, max |x| / 448; fp8-e4m3 without a scale (values clamped to +-448).
Prints each format's relative error over the rows (K and V apart), then the perplexity of 300
tokens of README.md fed one decode step at a time, with top-1 agreement and KL divergence of the
next-token distributions against the exact pool.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_step_paths import compare_log_probs, decode_log_probs  # noqa: E402

from tokenmill import LLM  # noqa: E402


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def fp8_unscaled(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


FORMATS = {"float16": lambda x: x.half().float(), "int8 per row": int8_rows, "fp8 per row": fp8_rows,
           "fp8 unscaled": fp8_unscaled}


def main() -> None:
    llm = LLM(None, dtype="float32")
    worker = llm.engine.runner.worker
    pool = worker.kv_cache  # (layers, K|V, blocks + 1, kv heads, block size, head_dim)
    ids = llm.engine.tokenizer.encode((Path(__file__).resolve().parent.parent / "README.md").read_text())[:300]
    forward = worker.forward
    log_probs = {}
    for name, rounding in [("exact", None), *FORMATS.items()]:
        def rounded_forward(input_ids, positions, meta, rounding=rounding):
            out = forward(input_ids, positions, meta)
            if rounding is not None:  # the blocks this step's request holds
                held = meta.block_tables.unique().long()
                pool[:, :, held] = rounding(pool[:, :, held])
            return out
        worker.forward = rounded_forward
        pool.zero_()
        log_probs[name] = decode_log_probs(llm.engine, ids)
        if name == "exact":
            for kv, rows in enumerate(pool.unbind(1)):
                rows = rows[rows.abs().amax(-1) > 0]
                errors = [f"{f} {float((r(rows) - rows).norm() / rows.norm()):.5f}" for f, r in FORMATS.items()]
                print(f"{'KV'[kv]} rows' relative error: {', '.join(errors)}")
    for name, lp in log_probs.items():
        c = compare_log_probs(log_probs["exact"], lp, ids)
        print(f"{name:13s} perplexity {c['ppl']:.3f} ({c['ppl'] / c['ppl_exact'] - 1:+.3%}), top-1 agreement "
              f"{c['agree']:.1%}, KL mean {c['kl_mean']:.5f}, max {c['kl_max']:.4f}")


if __name__ == "__main__":
    main()
