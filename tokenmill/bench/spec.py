"""`tokenmill bench spec`: speculative decoding where prompt lookup should help.

The workload asks the model to repeat a ~200-token passage word for word. The passages are
written by the model itself first (greedy, from a few topic prompts), so the benchmark
needs no text corpus. At each concurrency (that many requests in flight, a new one sent
as one finishes) the same requests run with and without speculation, greedy, so both produce
the same tokens; the table gives output tok/s for both, their ratio, the acceptance rate,
and the k the engine chose (its policy decides per step whether speculating pays).
"""

from __future__ import annotations

import dataclasses
import time

from tokenmill.cli_args import engine_config_from_args
from tokenmill.sampling_params import SamplingParams

TOPICS = ["the history of the bicycle", "how bees make honey", "the life of a lighthouse keeper",
          "why the sky is blue", "a walk through an autumn forest", "the invention of the printing press",
          "how volcanoes form", "a day at a busy train station"]


def make_passages(engine, count: int, length: int) -> list[str]:
    prompts = [engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a detailed paragraph about {TOPICS[i % len(TOPICS)]}."}],
        add_generation_prompt=True, tokenize=False) for i in range(count)]
    for i, text in enumerate(prompts):
        engine.add_request(f"passage-{i}", {"prompt": text, "prompt_token_ids": engine.tokenizer.encode(
            text, add_special_tokens=False)}, SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True))
    passages = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                passages[out.request_id] = out.outputs[0].text.strip()
    return [passages[f"passage-{i}"] for i in range(count)]


def repeat_prompts(engine, passages: list[str]) -> list[dict]:
    out = []
    for p in passages:
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{p}"}],
            add_generation_prompt=True, tokenize=False)
        out.append({"prompt": text, "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)})
    return out


def run(engine, prompts: list[dict], concurrency: int, max_tokens: int) -> dict:
    """All prompts through the engine, at most `concurrency` in flight (a new one is added when
    one finishes, as clients would); output tok/s."""
    spec = engine.speculator
    before = (spec.num_proposed, spec.num_accepted, spec.num_steps_speculated) if spec else (0, 0, 0)
    chosen: list[int] = []
    pending = list(enumerate(prompts))
    tokens, outputs, steps = 0, [], 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.scheduler.requests) < concurrency:
            i, p = pending.pop(0)
            engine.add_request(f"c{concurrency}-{i}", p, params)
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                outputs.append(out.outputs[0].token_ids)
        steps += 1
        if spec is not None:
            chosen.append(spec.policy.last_k)
    wall = time.perf_counter() - start
    result = {"output_tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "outputs": sorted(map(tuple, outputs))}
    if spec is not None:
        proposed, accepted, speculated = (a - b for a, b in zip(
            (spec.num_proposed, spec.num_accepted, spec.num_steps_speculated), before))
        result.update(acceptance=accepted / proposed if proposed else 0.0, proposed=proposed,
                      speculated_steps=speculated / max(steps, 1),
                      chosen_k=max(set(chosen), key=chosen.count) if chosen else 0)
    return result


def bench_spec(args) -> dict:
    from tokenmill.engine import LLMEngine

    base_config = dataclasses.replace(engine_config_from_args(args), model=args.model, speculative=None)
    plain = LLMEngine(base_config)
    spec = LLMEngine(dataclasses.replace(base_config, speculative=args.speculative,
                                         num_speculative_tokens=args.num_speculative_tokens))
    passages = make_passages(plain, max(args.concurrency) if args.num_passages is None else args.num_passages,
                             args.passage_tokens)
    rows = []
    for c in args.concurrency:
        prompts = repeat_prompts(plain, [passages[i % len(passages)] for i in range(max(c, args.min_requests))])
        without = run(plain, prompts, c, args.max_tokens)
        with_spec = run(spec, prompts, c, args.max_tokens)
        rows.append({"concurrency": c, "requests": len(prompts), "without_tok_s": without["output_tok_s"],
                     "with_tok_s": with_spec["output_tok_s"],
                     "speedup": with_spec["output_tok_s"] / without["output_tok_s"],
                     "acceptance": with_spec["acceptance"], "speculated_steps": with_spec["speculated_steps"],
                     "chosen_k": with_spec["chosen_k"], "same_outputs": without["outputs"] == with_spec["outputs"]})
    print()
    print(f"speculative={args.speculative}, up to {args.num_speculative_tokens} drafts, "
          f"{args.passage_tokens}-token passages repeated (greedy)")
    print(f"{'concurrency':>11} {'requests':>8} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} "
          f"{'accepted':>8} {'steps spec.':>11} {'usual k':>7} {'same out':>8}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['requests']:>8} {r['without_tok_s']:>11.1f} {r['with_tok_s']:>10.1f} "
              f"{r['speedup']:>7.2f}x {r['acceptance']:>8.0%} {r['speculated_steps']:>11.0%} {r['chosen_k']:>7} "
              f"{str(r['same_outputs']):>8}")
    return {"rows": rows}
