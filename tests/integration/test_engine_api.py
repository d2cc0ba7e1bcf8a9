"""The engine's public surface on a tiny model: LLM.generate / chat, the step API, errors."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module", params=["sync", "async_output", "async_scheduling"])
def llm(tiny_models, request):
    return LLM(str(tiny_models["llama"]), max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64,
               async_output=request.param == "async_output", async_scheduling=request.param == "async_scheduling")


@pytest.mark.parametrize("mode", ["async_output", "async_scheduling"])
def test_late_modes_give_the_same_outputs_one_step_later(tiny_models, mode):
    """async_output builds a step's outputs during the next step; async_scheduling launches the
    next step before collecting this one (the GPU defaults). Both give the same tokens, text,
    stops and deltas as the plain loop, one step later. A stop string found a step late ends its
    request while the next step runs; that step's token is dropped. With async_scheduling, a
    request with penalties makes the engine wait for each step's tokens while it runs."""
    def run(late: str | None):
        llm = LLM(str(tiny_models["llama"]), max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64,
                  async_output=late == "async_output", async_scheduling=late == "async_scheduling")
        engine = llm.engine
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        full = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0]
        # e: a stop token first sampled at index k, allowed from there on by min_tokens = k
        e_tokens = llm.generate([[9, 10, 11, 14]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        k = next(i for i in range(2, 12) if e_tokens[i] not in e_tokens[:i])
        stops = {"a": greedy.clone(stop=[full.text.split()[4]]), "b": greedy.clone(max_tokens=3),
                 "c": SamplingParams(max_tokens=20, temperature=0.0), "d": greedy,
                 "e": greedy.clone(min_tokens=k, stop_token_ids=[e_tokens[k]]),
                 "g": SamplingParams(max_tokens=9, temperature=1.0, seed=3)}
        for rid, params in stops.items():
            engine.add_request(rid, [5, 6, 7] if rid == "a" else [9, 10, 11, int(rid, 36)], params)
        streamed = {rid: "" for rid in stops}
        finals, first_output_step, step = {}, None, 0
        while engine.has_unfinished_requests():
            step += 1
            if step == 6:  # penalties: async_scheduling waits for each step's tokens from here on
                engine.add_request("f", [9, 10, 11, 15], greedy.clone(repetition_penalty=1.5, max_tokens=6))
                streamed["f"] = ""
            for out in engine.step():
                first_output_step = first_output_step or step
                streamed[out.request_id] += out.new_text
                if out.finished:
                    finals[out.request_id] = out.outputs[0]
        assert engine.scheduler.stats().kv_blocks_used == 0
        assert all(streamed[rid] == finals[rid].text for rid in streamed)
        return {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in finals.items()}, first_output_step

    (sync, sync_first), (late, late_first) = run(None), run(mode)
    assert late == sync and late_first == sync_first + 1
    assert sync["a"][2] == "stop" and len(sync["a"][0]) < 12 and sync["b"][2] == "length"
    assert sync["e"][2] == "stop" and sync["e"][0][-1] not in sync["e"][0][:-1]


def test_a_generate_call_gives_its_thread_back_every_cpu_and_thread_the_load_had_taken(tiny_models):
    """LLM's steps run on the caller's thread, whose kernels' team the thread governor pins one to
    a core (or cuts to one thread) while a neighbour is busy; when the call returns, the thread
    has both CPUs and both threads again. The governor is put at its pinned level by hand here,
    where a neighbour's load would take it there by timing."""
    import os

    import torch

    from tokenmill.cpu_threads import usable_cpus
    cpus, limit = usable_cpus()
    if len(cpus) != 2 or limit != 2:
        pytest.skip("the pinned level is for two usable CPUs")
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=64)
    governor = llm.engine.runner.worker.threads
    governor.level = governor.levels.index((2, True))
    governor._apply()
    assert os.sched_getaffinity(0) == {min(cpus)}  # this thread is thread 0 of its team
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert os.sched_getaffinity(0) == set(cpus) and torch.get_num_threads() == 2


def test_outputs_come_back_in_input_order_for_every_prompt_form(llm):
    prompts = ["w5 w6 w7", [5, 6, 7], {"prompt_token_ids": [5, 6, 7]}, {"prompt": "w5 w6 w7"},
               [9] * 100, "w9"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs[:4]] == [[5, 6, 7]] * 4
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) == 1
    assert outs[4].prompt_token_ids == [9] * 100 and outs[5].prompt_token_ids == [9]
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason in ("stop", "length")


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [[11] * n for n in (3, 40, 70)]
    batch = llm.generate(others[:2] + [[5, 6, 7]] + others[2:],
                         [SamplingParams(max_tokens=12, temperature=0.9)] * 2 + [params] + [SamplingParams()],
                         use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone


def test_n_completions_and_max_tokens(llm):
    out = llm.generate("w5 w6", SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_string_ends_the_request_and_is_cut(llm):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    full = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    stop = words[3]
    out = llm.generate([[5, 6, 7]], greedy.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    assert len(out.token_ids) < len(full.token_ids)


def test_step_api_streams_deltas_and_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("s1", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.add_request("s2", [8] * 30, SamplingParams(max_tokens=50, ignore_eos=True))
    pieces, finished = [], None
    while finished is None:
        for out in engine.step():
            if out.request_id == "s1":
                pieces.extend(out.new_token_ids)
                if out.finished:
                    finished = out
    assert pieces == finished.outputs[0].token_ids and len(pieces) == 8
    m = finished.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert engine.last_stats.num_tokens >= 1 and engine.last_stats.kv_blocks_used > 0
    assert engine.abort("s2") and not engine.abort("s2")
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.stats().kv_blocks_used == 0


def test_final_only_outputs_report_a_request_once_it_ended(llm):
    """output_kind="final" (vLLM's FINAL_ONLY, what LLM.generate asks for): no output per step,
    one at the end with the same text, tokens and logprobs, stop strings still applied."""
    engine = llm.engine
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    full = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text.split()[4]
    for rid, params in (("f1", greedy), ("f2", greedy.clone(stop=[stop]))):
        engine.add_request(rid, [5, 6, 7], params.clone(output_kind="final"))
    engine.add_request("c", [5, 6, 7], greedy)  # cumulative beside them: reported every step
    seen: dict[str, list] = {"f1": [], "f2": [], "c": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [o.finished for o in seen["f1"]] == [True] and [o.finished for o in seen["f2"]] == [True]
    assert len(seen["c"]) == 12
    whole, stopped = seen["f1"][0].outputs[0], seen["f2"][0].outputs[0]
    assert (whole.text, whole.token_ids) == (full.text, full.token_ids)
    assert [list(e) for e in whole.logprobs] == [list(e) for e in full.logprobs]  # (prefill rounding differs
    assert [v for e in whole.logprobs for v in e.values()] == pytest.approx(    # with the batch, ~1e-7)
        [v for e in full.logprobs for v in e.values()], abs=1e-5)
    assert (seen["f1"][0].new_token_ids, seen["f1"][0].new_text) == (full.token_ids, full.text)  # all of it is new
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:full.text.index(stop)]
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty"),
    ([5] * 1100, SamplingParams(max_tokens=1), "context length"),
    ([5] * 1000, SamplingParams(max_tokens=100), "exceeds"),
    ([99999], SamplingParams(), r"token ids must be integers in \[0, 384\)"),
    ([5], SamplingParams(stop_token_ids=[400], min_tokens=2), r"stop_token_ids must be integers in \[0, 384\)"),
    ({"nope": 1}, SamplingParams(), "prompt"),
    ([5], SamplingParams(allowed_token_ids=[1, 9], stop_token_ids=[9], min_tokens=1), "allowed_token_ids"),
    # EOS is banned under min_tokens with ignore_eos too, and the bans add up
    ([5], SamplingParams(allowed_token_ids=[1], ignore_eos=True, min_tokens=2), "allowed_token_ids"),
    ([5], SamplingParams(allowed_token_ids=[1, 9], bad_words=["w9"], min_tokens=2), "allowed_token_ids"),
    ("w5 \udcff", SamplingParams(), "not valid UTF-8"),   # a shell argument's bytes that were no UTF-8
    ([5], SamplingParams(top_k=385), r"top_k must be <= the vocabulary size \(384\), or 0 or -1 for every token"),
    ([5], SamplingParams(truncate_prompt_tokens=10**11), "truncate_prompt_tokens must be <= the model.s context"),
])
def test_bad_requests_raise_clear_errors(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_a_priority_without_the_priority_policy_is_an_error_not_ignored(llm):
    with pytest.raises(ValueError, match="needs scheduling_policy 'priority'"):
        llm.generate(["w5", "w6"], SamplingParams(max_tokens=2), priority=[0, 3], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["w5"], SamplingParams(max_tokens=2), priority=[0], use_tqdm=False)) == 1


def test_chat_uses_the_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "w7 w8"}], SamplingParams(max_tokens=3, temperature=0.0))
    assert out[0].prompt_token_ids == [2, 7, 8, 3, 4]
    parts = [{"role": "user", "content": [{"type": "text", "text": "w7 "}, {"type": "text", "text": "w8"}]}]
    assert llm.chat(parts, SamplingParams(max_tokens=1))[0].prompt_token_ids == [2, 7, 8, 3, 4]
    no_prompt = llm.chat(parts, SamplingParams(max_tokens=1), add_generation_prompt=False)[0]
    assert no_prompt.prompt_token_ids == [2, 7, 8, 3]
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "w7"}])
    with pytest.raises(ValueError, match="^messages: a list of message dicts, or a list of such lists; got 'w7'$"):
        llm.chat("w7")
    assert llm.get_tokenizer() is llm.tokenizer


def test_offline_generate_as_a_vllm_user_expects(llm):
    """max_tokens past the context ends the output there ("length"), as vLLM's offline API does
    (the engine's add_request, and the server, refuse it); cumulative_logprob sums the chosen
    tokens' logprobs; a call that fails or is interrupted leaves nothing running for the next one."""
    out = llm.generate([[5] * 1020], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    c = llm.generate([[5, 6]], SamplingParams(max_tokens=4, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)))
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].cumulative_logprob is None
    with pytest.raises(TypeError):
        llm.generate([[5, 6], {"prompt_token_ids": None}], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    engine = llm.engine
    scheduler, original = engine.scheduler, engine.scheduler.update
    calls = []

    def interrupted(*args, **kwargs):  # Ctrl-C inside a step: a request has finished, its output unbuilt
        calls.append(1)
        changed = original(*args, **kwargs)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return changed
    scheduler.update = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, i] for i in range(4)], [SamplingParams(max_tokens=n, ignore_eos=True)
                                                         for n in (2, 3, 50, 50)], use_tqdm=False)
    finally:
        del scheduler.update
    assert not engine.has_unfinished_requests() and engine.scheduler.stats().kv_blocks_used == 0
    assert not engine.unfinished_request_ids()  # no detokenizer left behind


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_failed_step_fails_its_requests_and_loses_no_output(llm, where):
    """launch() raising (a host-side error) or collect() raising (a device error surfaces at the
    sync): the step's requests fail, the outputs built before it (async_output: the last step's)
    still come back once, cached prefixes are forgotten, and the engine goes on."""
    engine, runner = llm.engine, llm.engine.runner
    prompt = list(range(5, 45))  # two full blocks and a half: blocks get cached
    engine.add_request("short", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.add_request("long", prompt[::-1], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    streamed = {"short": [], "long": []}
    finals = {}

    def take(outputs):
        for out in outputs:
            assert out.request_id not in finals, "an output after the final one"
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    while "short" in engine.scheduler.requests:  # until it ends by length
        take(engine.step())
    assert ("short" in finals) != engine.async_output  # async_output: the failing step must report it
    assert engine.scheduler.kv.pool.cached
    original = getattr(runner, where)

    def broken(arg):
        if where == "collect":
            original(arg)
        raise RuntimeError("injected fault")
    setattr(runner, where, broken)
    try:
        take(engine.step())
    finally:
        setattr(runner, where, original)
    assert set(finals) == {"short", "long"} and not engine.has_unfinished_requests()
    short = finals["short"].outputs[0]
    assert short.finish_reason == "length" and streamed["short"] == short.token_ids
    assert finals["long"].outputs[0].finish_reason == "error" and "injected fault" in finals["long"].error
    assert not engine.scheduler.kv.pool.cached  # the failed step may have left blocks half written
    assert engine.unfinished_request_ids() == [] and engine.scheduler.stats().kv_blocks_used == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_abort_reports_every_token_and_a_finished_request_keeps_its_end(llm):
    """An abort's final output holds every sampled token's text (with async_output, also those of
    the last step, not yet reported); a request that ended by length before its end was reported
    gets that end, not an abort; and its id is not taken again until then."""
    engine = llm.engine
    engine.add_request("run", [5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.add_request("ends", [5, 6, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    streamed = {"run": "", "ends": ""}
    finals = {}
    while "ends" in engine.scheduler.requests:  # until it ends by length
        for out in engine.step():
            streamed[out.request_id] += out.new_text
            if out.finished:
                finals[out.request_id] = out
    assert ("ends" in engine.unfinished_request_ids()) == engine.async_output  # its end not yet reported
    if engine.async_output:
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("ends", [5], SamplingParams(max_tokens=1))
        out = engine.abort("ends")
        streamed["ends"] += out.new_text
        finals["ends"] = out
    assert finals["ends"].outputs[0].finish_reason == "length"
    assert streamed["ends"] == finals["ends"].outputs[0].text and len(finals["ends"].outputs[0].token_ids) == 3
    out = engine.abort("run")
    streamed["run"] += out.new_text
    assert out.outputs[0].finish_reason == "abort" and streamed["run"] == out.outputs[0].text
    assert len(out.outputs[0].text.split()) == len(out.outputs[0].token_ids) > 0
    assert engine.unfinished_request_ids() == [] and not engine.has_unfinished_requests()


def test_abort_text_holds_every_token_with_or_without_stop_strings(llm):
    """A request with a stop string that never matches holds back the tail that might still turn
    into it; an abort ends that doubt, so its text is every sampled token's, in both modes."""
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=["never matches this"])
    engine.add_request("held", [5, 6, 7], params)
    streamed = ""
    while len(engine.scheduler.requests["held"].output_token_ids) < 6:
        streamed += "".join(out.new_text for out in engine.step())
    out = engine.abort("held")
    streamed += out.new_text
    ids = out.outputs[0].token_ids
    assert streamed == out.outputs[0].text and len(out.outputs[0].text.split()) == len(ids) >= 6  # a word a token


def test_chat_starts_over_with_the_message_that_no_longer_fit(tiny_llama, monkeypatch, capsys):
    """`tokenmill chat`: when the conversation outgrows the context, the message that did not fit
    opens a new conversation and is answered (it used to be dropped); a message too long alone is
    reported and skipped."""
    import io

    from tokenmill.cli import main
    from tokenmill.engine import LLMEngine
    added = []
    original = LLMEngine.add_request

    def add_request(self, request_id, prompt, *args, **kwargs):
        request = original(self, request_id, prompt, *args, **kwargs)
        added.append(len(request.prompt_token_ids))
        return request
    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    words = " ".join(f"w{i}" for i in range(5, 11))  # 6 tokens, and the template's
    lines = [words, words, " ".join(f"w{i}" for i in range(5, 40)), words]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert main(["chat", "--model", str(tiny_llama), "--max-model-len", "24", "--max-tokens", "4",
                 "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count("the conversation starts over") == 2
    assert len(added) == 3 and added[0] == added[1] == added[2]  # turn 2 alone; turn 3 skipped; 4 alone


def test_the_stop_token_is_in_token_ids_but_not_in_the_text(llm):
    """As in vLLM: a request ended by a stop token id keeps the token in token_ids and stop_reason,
    and its text ends before it, unless include_stop_str_in_output."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    full = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.token_ids[2]
    k = full.token_ids.index(stop)
    for include in (False, True):
        params = greedy.clone(stop_token_ids=[stop], include_stop_str_in_output=include)
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full.token_ids[:k + 1] and out.stop_reason == stop and out.finish_reason == "stop"
        cut = llm.generate([[5, 6, 7]], greedy.clone(max_tokens=k + 1 if include else k), use_tqdm=False)[0]
        assert out.text == cut.outputs[0].text


def test_a_dict_prompts_cache_salt_keeps_its_blocks_to_prompts_of_that_salt(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=16)
    prompt, once = list(range(5, 45)), SamplingParams(max_tokens=1)

    def cached(**salt) -> int:
        out = llm.generate([{"prompt_token_ids": prompt, **salt}], once, use_tqdm=False)[0]
        return out.metrics.num_cached_tokens
    assert [cached(cache_salt="a"), cached(cache_salt="b"), cached(), cached(cache_salt="a")] == [0, 0, 0, 32]
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        cached(cache_salt=7)


def test_truncated_prompts_and_priorities_in_generate(tiny_llama):
    """vLLM's truncate_prompt_tokens keeps a prompt's last k tokens; generate(priority=...) orders
    requests under the priority policy (one sequence at a time here: lower runs first)."""
    llm = LLM(str(tiny_llama), max_num_seqs=1, scheduling_policy="priority")
    out = llm.generate([list(range(5, 15))], SamplingParams(max_tokens=2, truncate_prompt_tokens=3),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == [12, 13, 14] and out.prompt is None
    short = LLM(str(tiny_llama), max_model_len=32)  # -1: as many as leave max_tokens of the context (vLLM's)
    out = short.generate([list(range(5, 45))], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1, ignore_eos=True),
                         use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(17, 45)) and len(out.outputs[0].token_ids) == 4
    outs = llm.generate([[5, 6], [7, 8], [9, 10]], SamplingParams(max_tokens=3), priority=[2, 0, 1], use_tqdm=False)
    starts = [o.metrics.first_scheduled_time for o in outs]
    assert starts[1] < starts[2] < starts[0]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=1), priority=[1, 2])


def test_deadlines_in_generate_order_requests_under_edf_and_are_refused_elsewhere(tiny_llama):
    """generate(deadline=...) (seconds from the call) reaches the edf policy: one sequence at a
    time, the earliest deadline runs first and one without a deadline last; under another policy
    a deadline is an error, not ignored."""
    llm = LLM(str(tiny_llama), max_num_seqs=1, scheduling_policy="edf")
    outs = llm.generate([[5, 6], [7, 8], [9, 10], [11, 12]], SamplingParams(max_tokens=3),
                        deadline=[300.0, None, 100.0, 200.0], use_tqdm=False)
    starts = [o.metrics.first_scheduled_time for o in outs]
    assert starts[2] < starts[3] < starts[0] < starts[1]
    with pytest.raises(ValueError, match="deadlines"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=1), deadline=[1.0, 2.0])
    fcfs = LLM(str(tiny_llama), max_num_seqs=1)
    with pytest.raises(ValueError, match="a deadline needs scheduling_policy 'edf'"):
        fcfs.generate([[5, 6]], SamplingParams(max_tokens=1), deadline=[1.0], use_tqdm=False)
    assert not fcfs.engine.has_unfinished_requests()


def test_each_output_carries_its_request_timeline_in_order(llm):
    """The offline API returns the timeline on each output: arrival, tokenizing, admission, the
    prompt's chunks (64-token budget: a 150-token prompt takes three), the first token, the end;
    one token time per output token."""
    out = llm.generate([list(range(2, 152))], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    t = out.timeline
    kinds = [e.kind for e in t.events]
    assert kinds == ["arrival", "tokenized", "admitted", "chunk", "chunk", "chunk", "first_token", "finished"]
    assert [e.data["tokens"] for e in t.events if e.kind == "chunk"] == [64, 64, 22]
    assert t.events[-1].data == {"finish_reason": "length"} and len(t.token_times) == 5
    times = [e.time for e in t.events]
    assert times == sorted(times) and list(t.token_times) == sorted(t.token_times)
    assert t.ttft == out.metrics.first_token_time - out.metrics.arrival_time
