"""Speculative decoding on tiny models: greedy outputs identical to plain decoding (ngram and
draft-model proposers, mixed batches, chunked prefill, forced preemption), and sampling that
keeps the target's distribution."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import build_tiny_model, copy_model

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    """The tiny llama with every weight perturbed: agrees with the target often, not always."""
    return build_tiny_model(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=0, noise=0.3)


def prompts():
    rng = random.Random(3)
    out = []
    for i in range(16):
        if i % 2:  # repetitive: prompt lookup finds continuations
            unit = [rng.randrange(2, 384) for _ in range(rng.randint(2, 6))]
            out.append((unit * 60)[:rng.randint(10, 200)])
        else:
            out.append([rng.randrange(2, 384) for _ in range(rng.randint(1, 200))])
    return out


def generate(model_dir, params, **options):
    llm = LLM(str(model_dir), max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=36, block_size=16,
              **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert llm.engine.scheduler.stats().kv_blocks_used == 0
    return [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.fixture(scope="module")
def plain(tiny_llama):
    tokens, engine = generate(tiny_llama, SamplingParams(max_tokens=40, temperature=0.0))
    assert engine.scheduler.num_preemptions > 0
    return tokens


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_speculation_is_token_for_token_identical(tiny_llama, draft_model, plain, proposer):
    kind = "ngram" if proposer == "ngram" else f"draft:{draft_model}"
    tokens, engine = generate(tiny_llama, SamplingParams(max_tokens=40, temperature=0.0), speculative=kind,
                              speculative_adaptive=False, num_speculative_tokens=3)
    spec = engine.speculator
    assert engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    assert spec.num_proposed > 0 and 0 < spec.num_accepted < spec.num_proposed, \
        f"want some drafts accepted and some rejected: {spec.num_accepted}/{spec.num_proposed}"
    assert tokens == plain


def test_greedy_speculation_over_int8_pools_is_token_for_token_identical(tiny_llama, draft_model):
    """kv_cache_dtype="int8" for the target's pool and the draft's: the verified tokens are those of
    plain decoding over an int8 pool."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    plain_int8, _ = generate(tiny_llama, greedy, kv_cache_dtype="int8")
    tokens, engine = generate(tiny_llama, greedy, kv_cache_dtype="int8", speculative=f"draft:{draft_model}",
                              speculative_adaptive=False, num_speculative_tokens=3)
    assert engine.speculator.proposer.runner.worker.kv_cache.dtype == torch.int8
    assert 0 < engine.speculator.num_accepted < engine.speculator.num_proposed
    assert tokens == plain_int8


def test_rejection_sampling_keeps_the_target_distribution():
    """The first emitted token of `_rejection_sample` follows p[0]: for a fixed (point-mass) draft,
    and for drafts drawn from a draft model's q."""
    from tokenmill.spec_decode import _rejection_sample
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.1, 0.7]])
    n = 5000
    for draft_probs in (None, q):
        counts = torch.zeros(4)
        for _ in range(n):
            draft = [1] if draft_probs is None else [int(torch.multinomial(q[0], 1, generator=g))]
            counts[_rejection_sample(p, draft, draft_probs, g)[0]] += 1
        expected = p[0] * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 16.27, f"chi-square {chi2:.1f} (3 d.o.f., p = 0.001)"


def test_speculative_sampling_matches_the_target_end_to_end(tmp_path):
    """A 16-token model: the token after the first (the first one verified against ngram
    drafts) has the target's conditional distribution. The prompt is one where the usual first
    token (15) is followed by a draft (0) the target takes about a quarter of the time, so that
    both accepted drafts and draws from the residual make up that distribution."""
    model = build_tiny_model(tmp_path / "v16", "llama", seed=5, vocab_size=16, initializer_range=0.3)
    prompt = list(range(16)) * 2 + [2, 6]  # every token occurs earlier: the lookup always proposes
    n = 1500
    llm = LLM(str(model), speculative="ngram", speculative_adaptive=False, num_speculative_tokens=2,
              max_num_seqs=256, num_kv_blocks=2048)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, SamplingParams(max_tokens=3, temperature=1.0,
                                                                           ignore_eos=True), use_tqdm=False)
    spec = llm.engine.speculator
    assert 0.1 < spec.num_accepted / spec.num_proposed < 0.9, f"{spec.num_accepted}/{spec.num_proposed}"
    pairs = [o.outputs[0].token_ids[:2] for o in outs]
    first = max(set(p[0] for p in pairs), key=[p[0] for p in pairs].count)
    seconds = torch.tensor([p[1] for p in pairs if p[0] == first])
    # the target's conditional distribution of the second token, from the plain engine
    plain = LLM(str(model), max_num_seqs=4, num_kv_blocks=64)
    out = plain.generate([{"prompt_token_ids": prompt + [first]}], SamplingParams(max_tokens=1, logprobs=16,
                                                                                 temperature=1.0), use_tqdm=False)
    logprobs = out[0].outputs[0].logprobs[0]
    probs = torch.tensor([float(torch.tensor(logprobs[t]).exp()) for t in range(16)])
    counts = torch.bincount(seconds, minlength=16).float()
    expected = probs * len(seconds)
    keep = expected >= 5  # pool the rare tokens, as the chi-square test requires
    observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    wanted = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    chi2 = float(((observed - wanted) ** 2 / wanted.clamp_min(1e-9)).sum())
    dof = len(observed) - 1
    critical = {k: v for k, v in zip(range(1, 17), [10.8, 13.8, 16.3, 18.5, 20.5, 22.5, 24.3, 26.1, 27.9, 29.6,
                                                     31.3, 32.9, 34.5, 36.1, 37.7, 39.3])}[dof]  # p = 0.001
    assert chi2 < critical, f"chi-square {chi2:.1f} with {dof} d.o.f."


def test_a_failed_step_leaves_no_draft_state_behind(tiny_llama, draft_model):
    """A request aborted just before a step that fails: the speculator learns of it from that
    step's finished ids, which the failure must not lose."""
    llm = LLM(str(tiny_llama), max_num_seqs=4, num_kv_blocks=64, speculative=f"draft:{draft_model}",
              speculative_adaptive=False)
    engine, runner = llm.engine, llm.engine.runner
    proposer = engine.speculator.proposer
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("A", [5, 6, 7, 8], greedy)
    engine.add_request("B", [9, 10, 11], greedy)
    for _ in range(5):
        engine.step()
    assert set(proposer.seqs) == {"A", "B"}
    engine.abort("A")
    original = runner.launch
    runner.launch = lambda sched: (_ for _ in ()).throw(RuntimeError("injected fault"))
    try:
        engine.step()
    finally:
        runner.launch = original
    while engine.has_unfinished_requests():
        engine.step()
    assert proposer.seqs == {} and proposer.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_drafts_never_crowd_decodes_out_of_the_token_budget(tiny_llama, draft_model, proposer):
    """Eight decodes with four drafts each would need 40 tokens of a 16-token budget: the drafts
    are cut so that every decode still gets its token each step (none waits behind the others'
    drafts), and the draft model's view of a request stays right (its outputs are plain greedy's)."""
    kind = "ngram" if proposer == "ngram" else f"draft:{draft_model}"
    prompts = [[5 + i, 6] for i in range(8)]  # all eight prefilled in the first step
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=128, block_size=16)
    plain = LLM(str(tiny_llama), **options).generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                     use_tqdm=False)
    options["max_num_batched_tokens"] = 16
    llm = LLM(str(tiny_llama), speculative=kind, speculative_adaptive=False, num_speculative_tokens=4, **options)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        decoding = [r for r in engine.scheduler.running if r.num_remaining_prefill == 1]
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        stats = engine.last_stats
        if len(decoding) == 8:  # every decode ran, drafts or not
            assert stats.num_seqs == 8 and stats.num_tokens <= 16
    assert [outputs[str(i)] for i in range(8)] == [o.outputs[0].token_ids for o in plain]
    assert engine.speculator.num_proposed > 0


def test_a_draft_model_with_a_shorter_context_stops_drafting_at_its_end(tiny_llama, draft_model, tmp_path):
    """Past the draft model's context length (its rotary tables end there) a sequence gets no
    drafts; it goes on decoding, to the same tokens as without speculation."""
    short = copy_model(draft_model, tmp_path / "short_draft", max_position_embeddings=24)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}]
    plain = LLM(str(tiny_llama)).generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(tiny_llama), speculative=f"draft:{short}", speculative_adaptive=False)
    out = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].token_ids == plain
    assert llm.engine.speculator.num_proposed > 0


def test_a_draft_model_with_a_smaller_padded_vocabulary(tiny_llama, tmp_path):
    """The same tokenizer with a smaller embedding table (as Qwen2.5-0.5B beside the 7B): greedy
    outputs are still plain greedy's, sampled drafts are verified against the target's wider
    distributions (the draft's padded with zeros), a sequence holding a token past the draft's
    rows gets no drafts; a larger draft vocabulary is refused."""
    small = build_tiny_model(tmp_path / "small_vocab", "llama", seed=0, noise=0.3, vocab_size=380)
    prompts = [{"prompt_token_ids": [5 + i, 9, 11, 13] * 3} for i in range(4)] + [{"prompt_token_ids": [382, 5, 6]}]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(tiny_llama)).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(str(tiny_llama), speculative=f"draft:{small}", speculative_adaptive=False, num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == plain
    assert llm.engine.speculator.num_proposed > 0
    sampled = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True), use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 10 for o in sampled)
    large = build_tiny_model(tmp_path / "large_vocab", "llama", seed=0, vocab_size=400)
    with pytest.raises(ValueError, match="larger than the target"):
        LLM(str(tiny_llama), speculative=f"draft:{large}")


def test_drafts_no_step_verified_are_dropped_at_the_next_proposal(tiny_llama, draft_model):
    """A request proposed for but not verified (left out of its step, or preempted) keeps its
    drafts in the draft model's cache; the next proposal first trims them away and drafts the
    same tokens again from the request's own."""
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_llama)).generate([{"prompt_token_ids": [5, 6, 7, 8]}], greedy, use_tqdm=False)
    llm = LLM(str(tiny_llama), speculative=f"draft:{draft_model}", speculative_adaptive=False,
              num_speculative_tokens=3)
    engine = llm.engine
    engine.add_request("a", [5, 6, 7, 8], greedy)
    for _ in range(3):
        engine.step()
    request, proposer = engine.scheduler.running[0], engine.speculator.proposer
    proposer.propose([request], [3])
    first = list(request.draft_token_ids)
    proposer.propose([request], [3])  # the same request again, its drafts never verified
    assert len(first) == 3 and request.draft_token_ids == first
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    assert outputs == [plain[0].outputs[0].token_ids]


def test_the_kv_budget_holds_the_draft_models_pool_too(tiny_llama, draft_model):
    """A draft model's pool gets as many blocks as the target's, so a KV budget (on a GPU: the
    memory left after both models' weights) is shared: each block costs both models' K/V. The
    draft's weights are loaded before the budget is measured."""
    budget = 1 << 20
    plain = LLM(str(tiny_llama), kv_cache_memory=budget, dtype="float32").engine
    spec = LLM(str(tiny_llama), kv_cache_memory=budget, dtype="float32", speculative=f"draft:{draft_model}").engine
    per_token = plain.model_config.kv_elements_per_token * 4  # float32 K and V of every layer
    assert plain.cache_config.num_blocks == budget // (16 * per_token)
    draft_per_token = spec.speculator.proposer.model_config.kv_elements_per_token * 4
    assert spec.cache_config.num_blocks == budget // (16 * (per_token + draft_per_token))
    assert spec.speculator.proposer.kv.pool.num_blocks == spec.cache_config.num_blocks


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_accepted_drafts_ends_the_tokens_there_too(tiny_llama, include):
    """The target as its own draft: every draft is accepted, so a stop string completes inside a
    step's tokens. token_ids, logprobs and the cumulative logprob end at the token that completed
    it, as one token per step would have them (they used to keep the drafts after it)."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)

    def run(params, **options):
        llm = LLM(str(tiny_llama), num_kv_blocks=64, **options)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0].outputs[0]
        return out, llm.engine

    full, _ = run(greedy)
    stopped = greedy.clone(stop=[f"w{full.token_ids[2]}"], include_stop_str_in_output=include)
    plain, _ = run(stopped)
    spec, engine = run(stopped, speculative=f"draft:{tiny_llama}", num_speculative_tokens=4,
                       speculative_adaptive=False)
    assert engine.speculator.num_accepted > 0
    assert plain.token_ids == full.token_ids[:3] and plain.finish_reason == "stop"
    assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == (
        plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason)
    assert len(spec.logprobs) == len(plain.logprobs) == 3  # (values to float noise: verified in a wider batch)
    assert all(a == pytest.approx(b, abs=1e-4) for a, b in zip(spec.logprobs, plain.logprobs))
    assert spec.cumulative_logprob == pytest.approx(plain.cumulative_logprob, abs=1e-4)
