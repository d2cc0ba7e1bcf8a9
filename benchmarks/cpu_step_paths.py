"""Decode steps of the default model three ways, alternated in one engine: the Python layers,
the C++ layers in one call (the default), and those with the layers' products taking x in 8-bit
blocks (gguf_int8_rows); then what the 8-bit x costs in quality.

    python benchmarks/cpu_step_paths.py [BATCH ...]    (default: 1 4 16 64)

For each batch size, BATCH requests with 250-token prompts decode while the three paths
alternate: twelve steps each, nine rounds; the table gives each path's median step. The third
path takes 8-bit x at every batch size shown (gguf_int8_rows = BATCH), big ones included. The quality
check decodes 300 tokens of README.md one at a time, with and without 8-bit x, and compares the
next-token distributions (perplexity, top-1 agreement, KL divergence).
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpu_gguf_blocks import median_step  # noqa: E402

from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine import LLMEngine  # noqa: E402
from tokenmill.models.cpu_packing import set_int8_rows  # noqa: E402
from tokenmill.request import Request  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

ROUNDS, STEPS = 9, 12
PATHS = ("python layers", "one-call layers", "one-call, 8-bit x")


def use_path(engine: LLMEngine, stack, path: str, rows: int) -> None:
    model = engine.runner.worker.model
    model.fused_stack = None if path == "python layers" else stack
    set_int8_rows(model, rows if path == "one-call, 8-bit x" else 0)


def steps(engine: LLMEngine, stack, batches: list[int]) -> None:
    print(f"{'batch':>5} " + " ".join(f"{p + ' ms':>20}" for p in PATHS))
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, list(range(100 + i, 350 + i)),
                               SamplingParams(max_tokens=ROUNDS * STEPS * len(PATHS) + 40, ignore_eos=True,
                                              temperature=0.0))
        while engine.scheduler.waiting or any(r.num_remaining_prefill > 1 for r in engine.scheduler.running):
            engine.step()  # the prompts, in chunks
        results: dict[str, list[float]] = {p: [] for p in PATHS}
        for _ in range(ROUNDS):
            for path in PATHS:
                use_path(engine, stack, path, batch)
                results[path].append(median_step(engine, STEPS))
        for rid in ids:
            engine.abort(rid)
        base = statistics.median(results[PATHS[0]])
        print(f"{batch:>5} " + " ".join(f"{statistics.median(v) * 1e3:>11.1f} ({statistics.median(v) / base:.2f}x)"
                                          for v in results.values()))
    use_path(engine, stack, "one-call layers", 0)


def decode_log_probs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Next-token log-probabilities after each token of `ids`, fed one decode step at a time."""
    model, runner = engine.runner.worker.model, engine.runner
    r = Request(request_id="quality", prompt_token_ids=ids, params=SamplingParams(), max_tokens=1)
    assert engine.scheduler.kv.allocate(r, len(ids))
    out = []
    for t in range(len(ids)):
        r.num_computed_tokens = t
        inputs = runner.prepare([r], [1])
        with torch.inference_mode():
            hidden = runner.worker.forward(inputs.input_ids, inputs.positions, inputs.meta)
            out.append(model.compute_logits(hidden)[0].log_softmax(-1))
    engine.scheduler.kv.free(r)
    return torch.stack(out)


def compare_log_probs(exact: torch.Tensor, other: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Two runs of decode_log_probs over ids: each one's perplexity of ids, how often their top
    tokens agree, and the KL divergence of `other`'s next-token distributions from `exact`'s."""
    target = torch.tensor(ids[1:])[:, None]
    ppl = [math.exp(-float(lp[:-1].gather(1, target).mean())) for lp in (exact, other)]
    kl = (exact.exp() * (exact - other)).sum(-1)
    return {"ppl_exact": ppl[0], "ppl": ppl[1], "agree": float((exact.argmax(-1) == other.argmax(-1)).float().mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def quality(engine: LLMEngine) -> None:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    ids = engine.tokenizer.encode(text)[:300]
    model = engine.runner.worker.model
    set_int8_rows(model, 0)
    exact = decode_log_probs(engine, ids)
    set_int8_rows(model, 1)
    int8 = decode_log_probs(engine, ids)
    set_int8_rows(model, 0)
    c = compare_log_probs(exact, int8, ids)
    print(f"quality over {len(ids)} tokens of README.md decoded one by one: perplexity {c['ppl_exact']:.3f} exact, "
          f"{c['ppl']:.3f} with 8-bit x ({c['ppl'] / c['ppl_exact'] - 1:+.2%}); top-1 agreement {c['agree']:.1%}; "
          f"KL(exact || 8-bit x) mean {c['kl_mean']:.4f}, max {c['kl_max']:.4f}")


def main(batches: list[int]) -> None:
    engine = LLMEngine(EngineConfig())
    steps(engine, engine.runner.worker.model.fused_stack, batches)
    if "--no-quality" not in sys.argv:
        quality(engine)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:] if a.isdigit()] or [1, 4, 16, 64])
