"""Disaggregated prefill and decode through the shared-storage KV connector (kv_storage.py): a
prefill engine and a decode engine over one directory, against one engine doing both."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(40 + 9 * i)] for i in range(3)]  # 40, 49, 58 tokens
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def engine(tiny_models, **options) -> LLM:
    options = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 64, **options}
    return LLM(str(tiny_models["llama"]), **options)


def prefill(tiny_models, storage, **options) -> list[dict]:
    """Run the prompts on a prefill instance as a proxy would (one token each); their params."""
    llm = engine(tiny_models, kv_role="prefill", kv_storage_path=str(storage), **options)
    outs = llm.generate(PROMPTS, GREEDY.clone(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                        use_tqdm=False)
    return [out.kv_transfer_params for out in outs]


def decode(tiny_models, storage, params: list[dict], **options) -> tuple[list[list[int]], LLM, int]:
    """The decode instance's outputs for those params, the instance, and the prompt tokens it computed."""
    llm = engine(tiny_models, kv_role="decode", kv_storage_path=str(storage), **options)
    computed = []
    llm.engine.stats_listeners.append(lambda stats: computed.append(stats.num_prefill_tokens))
    outs = llm.generate(PROMPTS, [GREEDY.clone(kv_transfer_params=p) for p in params], use_tqdm=False)
    return [out.outputs[0].token_ids for out in outs], llm, sum(computed)


@pytest.fixture(scope="module")
def colocated(tiny_models) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in engine(tiny_models).generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_the_decode_instance_computes_only_each_last_prompt_token_and_answers_as_one_instance(
        tiny_models, tmp_path, colocated):
    params = prefill(tiny_models, tmp_path)
    assert all(p["do_remote_prefill"] and not p["do_remote_decode"] for p in params)
    outputs, llm, computed = decode(tiny_models, tmp_path, params)
    assert outputs == colocated
    # full blocks of 16 below each prompt's last token: 32, 48, 48 of 40, 49, 58 tokens
    assert llm.engine.scheduler.stats().num_external_tokens == 32 + 48 + 48
    assert computed == (40 - 32) + (49 - 48) + (58 - 48)
    assert not list(tmp_path.rglob("*.kv"))  # the hand-off is consumed


def test_int8_pools_hand_over_their_codes_and_scales_and_refuse_a_float16_pools_blocks(tiny_models, tmp_path):
    """Both instances with kv_cache_dtype="int8": the decode instance reads the prompts' blocks (codes
    and scales, byte for byte) and answers as one int8 instance; a float16 decode instance finds
    none of them (the pool's dtype is in the blocks' fingerprint) and computes the prompts itself."""
    int8 = {"dtype": "float32", "kv_cache_dtype": "int8"}
    alone = [out.outputs[0].token_ids for out in engine(tiny_models, **int8).generate(PROMPTS, GREEDY, use_tqdm=False)]
    params = prefill(tiny_models, tmp_path / "a", **int8)
    outputs, llm, computed = decode(tiny_models, tmp_path / "a", params, **int8)
    assert outputs == alone and llm.engine.scheduler.stats().num_external_tokens == 32 + 48 + 48
    params = prefill(tiny_models, tmp_path / "b", **int8)
    _, llm, computed = decode(tiny_models, tmp_path / "b", params, dtype="float32", kv_cache_dtype="float16")
    assert llm.engine.scheduler.stats().num_external_tokens == 0 and computed == 40 + 49 + 58


def test_missing_or_corrupt_blocks_are_computed_by_the_decode_instance(tiny_models, tmp_path, colocated):
    params = prefill(tiny_models, tmp_path)
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == 2 + 3 + 3
    files[0].unlink()
    files[1].write_bytes(files[1].read_bytes()[:100])
    outputs, llm, computed = decode(tiny_models, tmp_path, params)
    assert outputs == colocated
    assert llm.engine.scheduler.stats().num_external_tokens < 32 + 48 + 48


def test_a_request_preempted_on_the_decode_instance_still_answers_right(tiny_models, tmp_path, colocated):
    params = prefill(tiny_models, tmp_path)
    outputs, llm, _ = decode(tiny_models, tmp_path, params, num_kv_blocks=7)  # two prompts fill it; they grow
    assert outputs == colocated
    assert llm.engine.scheduler.num_preemptions > 0


def test_a_colocated_request_with_transfer_params_is_served_alone_on_a_decode_instance(tiny_models, tmp_path,
                                                                                      colocated):
    outputs, llm, computed = decode(tiny_models, tmp_path, [{"do_remote_prefill": True}] * 3)
    assert outputs == colocated and computed == 40 + 49 + 58


def test_prompt_logprobs_are_computed_here_even_when_the_blocks_wait(tiny_models, tmp_path):
    params = prefill(tiny_models, tmp_path)
    llm = engine(tiny_models, kv_role="decode", kv_storage_path=str(tmp_path))
    asked = GREEDY.clone(max_tokens=2, prompt_logprobs=0)
    out = llm.generate(PROMPTS[0], asked.clone(kv_transfer_params=params[0]), use_tqdm=False)[0]
    alone = engine(tiny_models).generate(PROMPTS[0], asked, use_tqdm=False)[0]
    assert llm.engine.scheduler.stats().num_external_tokens == 0
    assert out.prompt_logprobs == alone.prompt_logprobs


def test_salted_blocks_are_handed_over_only_to_a_request_of_the_same_salt(tiny_models, tmp_path, colocated):
    """The prefill and decode instances hash a salted prompt's blocks alike (kv_cache's
    extend_block_hashes); another salt finds none of them and computes its prompt."""
    def salted(salt: str) -> list[dict]:
        return [{"prompt_token_ids": p, "cache_salt": salt} for p in PROMPTS]
    handoff = GREEDY.clone(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    for salt, expected in (("tenant-1", 32 + 48 + 48), ("tenant-2", 0)):
        outs = engine(tiny_models, kv_role="prefill", kv_storage_path=str(tmp_path)).generate(
            salted("tenant-1"), handoff, use_tqdm=False)
        llm = engine(tiny_models, kv_role="decode", kv_storage_path=str(tmp_path))
        answers = llm.generate(salted(salt), [GREEDY.clone(kv_transfer_params=o.kv_transfer_params) for o in outs],
                               use_tqdm=False)
        assert [a.outputs[0].token_ids for a in answers] == colocated
        assert llm.engine.scheduler.stats().num_external_tokens == expected, salt
