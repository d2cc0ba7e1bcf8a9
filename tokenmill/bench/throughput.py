"""Offline throughput: run a workload through the engine (and, with --compare, through static
batching and Hugging Face `generate`) on the same requests in the same process.

Static batching, as the baseline engines did it: a batch is admitted only when the previous
one has fully finished, prompts are left-padded to the batch's longest, and every sequence
runs to the batch's longest output (finished ones are computed as padding). Only the real
prompt and output tokens count towards throughput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from tokenmill.bench.workloads import BenchRequest, static_batches
from tokenmill.outputs import StepStats
from tokenmill.sampling_params import SamplingParams


@dataclass
class RunResult:
    name: str
    wall: float                          # seconds, first request added to last token
    prompt_tokens: int                   # real (unpadded) prompt tokens
    output_tokens: int                   # real output tokens
    steps: list[StepStats] = field(default_factory=list)
    useful_seqs: list[int] = field(default_factory=list)   # per step: sequences doing real work
    outputs: list[list[int]] = field(default_factory=list)  # token ids per request, input order
    ttft: list[float] = field(default_factory=list)         # per request, seconds
    itl: list[float] = field(default_factory=list)          # all inter-token gaps, seconds
    token_times: list[list[float]] = field(default_factory=list)  # per request: when each token came
    mark_time: float | None = None                          # when the `inject` step was reached

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall

    def time_split(self) -> dict[str, float]:
        """Seconds per phase of the step, summed over steps."""
        keys = ("schedule", "prepare", "forward", "sample", "detokenize")
        return {k: sum(getattr(s, f"time_{k}") for s in self.steps) for k in keys}

    def summary(self) -> dict:
        return {"name": self.name, "wall_s": self.wall, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "output_tok_s": self.output_tps,
                "total_tok_s": self.total_tps, "steps": len(self.steps), "time_split_s": self.time_split(),
                "preemptions": sum(s.num_preemptions for s in self.steps),
                "ttft_mean_s": float(np.mean(self.ttft)) if self.ttft else None,
                "itl_p99_s": float(np.percentile(self.itl, 99)) if self.itl else None}


def run_engine(engine, workload: list[BenchRequest], name: str, temperature: float = 0.0, top_p: float = 1.0,
               useful: list[BenchRequest] | None = None, inject: tuple[int, list[BenchRequest]] | None = None,
               progress: bool = True) -> RunResult:
    """Run `workload` to completion through `engine.step()`.

    useful: the unpadded requests when `workload` is a padded static-batching version of them.
    inject: (after_steps, requests) added once that many steps have run (arrivals mid-run); the
            moment is kept as `mark_time` even when the request list is empty.
    """
    useful = useful or workload
    steps: list[StepStats] = []
    engine.stats_listeners.append(steps.append)
    useful_all = list(useful) + (list(inject[1]) if inject else [])
    limit = {f"{name}-{i}": r.max_tokens for i, r in enumerate(useful_all)}
    token_times: dict[str, list[float]] = {rid: [] for rid in limit}
    arrival: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}

    def add(index: int, r: BenchRequest) -> None:
        rid = f"{name}-{index}"
        arrival[rid] = time.monotonic()
        engine.add_request(rid, {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=temperature,
                                          top_p=top_p))

    useful_seqs = []
    mark_time = None
    start = time.monotonic()
    for i, r in enumerate(workload):
        add(i, r)
    try:
        with tqdm(total=sum(r.max_tokens for r in useful_all), desc=name, unit="tok", disable=not progress) as bar:
            while engine.has_unfinished_requests():
                if inject and len(steps) == inject[0] and mark_time is None:
                    mark_time = time.monotonic()
                    for j, r in enumerate(inject[1]):
                        add(len(workload) + j, r)
                now_outputs = engine.step()
                now = time.monotonic()
                working = 0
                for out in now_outputs:
                    times = token_times[out.request_id]
                    real = min(len(out.outputs[0].token_ids), limit[out.request_id]) - len(times)
                    times.extend([now] * max(real, 0))
                    working += real > 0
                    bar.update(max(real, 0))
                    if out.finished:
                        outputs[out.request_id] = out.outputs[0].token_ids[:limit[out.request_id]]
                useful_seqs.append(working)
    finally:
        engine.stats_listeners.remove(steps.append)
    wall = time.monotonic() - start
    ids = list(limit)
    return RunResult(
        name=name, wall=wall, prompt_tokens=sum(len(r.prompt_token_ids) for r in useful_all),
        output_tokens=sum(r.max_tokens for r in useful_all), steps=steps, useful_seqs=useful_seqs,
        outputs=[outputs[rid] for rid in ids],
        ttft=[token_times[rid][0] - arrival[rid] for rid in ids if token_times[rid]],
        itl=[b - a for rid in ids for a, b in zip(token_times[rid], token_times[rid][1:])],
        token_times=[token_times[rid] for rid in ids], mark_time=mark_time)


def run_static(engine, workload: list[BenchRequest], batch_size: int, pad_token_id: int,
               progress: bool = True) -> RunResult:
    """tokenmill in static-batching mode (the engine must be built with static_batching=True)."""
    padded = static_batches(workload, batch_size, pad_token_id)
    return run_engine(engine, padded, "static", useful=workload, progress=progress)


def run_hf_generate(model_path, workload: list[BenchRequest], batch_size: int, device: str = "cpu",
                    progress: bool = True, dtype: str | None = None) -> RunResult:
    """Hugging Face transformers `generate`, static batches of `batch_size`, left padding, greedy; in
    `dtype` (default float32 on the CPU, bfloat16 on CUDA)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype or ("float32" if device == "cpu" else "bfloat16"))
    if model_path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    model = model.to(device).eval()
    pad = 0
    start = time.monotonic()
    batches = [workload[i:i + batch_size] for i in range(0, len(workload), batch_size)]
    for batch in tqdm(batches, desc="hf generate", unit="batch", disable=not progress):
        longest = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, longest - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, longest - len(r.prompt_token_ids):] = 1
        new = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
        if device != "cpu":
            torch.cuda.synchronize()
    wall = time.monotonic() - start
    return RunResult(name="hf-generate", wall=wall, prompt_tokens=sum(len(r.prompt_token_ids) for r in workload),
                     output_tokens=sum(r.max_tokens for r in workload))


def format_table(results: list[RunResult], reference: str = "tokenmill") -> str:
    ref = next((r for r in results if r.name == reference), results[0])
    lines = [f"{'engine':<22} {'output tok/s':>12} {'total tok/s':>12} {'wall s':>8} {'vs ' + ref.name:>14}"]
    for r in results:
        lines.append(f"{r.name:<22} {r.output_tps:>12.1f} {r.total_tps:>12.1f} {r.wall:>8.1f} "
                     f"{r.output_tps / ref.output_tps:>13.2f}x")
    return "\n".join(lines)


def format_split(result: RunResult) -> str:
    split = result.time_split()
    total = sum(s.time_total for s in result.steps) or 1.0
    parts = "  ".join(f"{k} {v / total:6.1%}" for k, v in split.items())
    overhead = 1 - split["forward"] / total
    return f"step time split ({result.name}, {len(result.steps)} steps): {parts}  | outside forward {overhead:.1%}"
