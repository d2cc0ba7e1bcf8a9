"""The runner's step tensors: the decode-only shortcut against the general path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def same(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("backend", ["cpu", "torch", "reference"])  # short queries: any, one token, none
def test_decode_steps_get_the_same_tensors_from_either_path(tiny_llama, backend):
    """Every step of a run whose requests all decode takes the shortcut, and its tensors are the
    ones the general path builds for it (last blocks full, partly filled and just begun)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64,
                                    attention_backend=backend, device="cpu"))
    runner = engine.runner
    short_max = getattr(runner.worker.backend, "short_query_max", 0)
    prepare, prepare_decodes, compared, shortcuts = runner.prepare, runner._prepare_decodes, [], []

    def counted_prepare_decodes(requests, short):
        shortcuts.append(len(requests))
        return prepare_decodes(requests, short)

    def checked_prepare(requests, num_tokens, num_drafts=None, pooling=False):
        inputs = prepare(requests, num_tokens, num_drafts, pooling)
        if all(n == 1 for n in num_tokens):
            general = runner._prepare_chunks(requests, num_tokens, num_drafts, short_max)
            assert inputs.sampling_requests == general.sampling_requests == requests
            assert inputs.num_rows == general.num_rows
            for field in ("input_ids", "positions", "logits_indices"):
                assert same(getattr(inputs, field), getattr(general, field)), field
            for field in dataclasses.fields(inputs.meta):
                assert same(getattr(inputs.meta, field.name), getattr(general.meta, field.name)), field.name
            compared.append(len(requests))
        return inputs

    runner.prepare, runner._prepare_decodes = checked_prepare, counted_prepare_decodes
    for i, prompt_len in enumerate((3, 9, 4, 17)):
        engine.add_request(f"r{i}", list(range(5, 5 + prompt_len)), SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(compared) >= 5 and max(compared) == 4 and shortcuts == compared


def test_a_block_bigger_than_the_kv_budget_is_an_error_naming_block_size_and_the_budget():
    from tokenmill.model_runner import kv_pool_blocks
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"^a KV block of block_size=64 tokens takes 6400 bytes, more than "
                                         r"kv_cache_memory='4KiB' holds: lower block_size or raise kv_cache_memory$"):
        kv_pool_blocks(EngineConfig(block_size=64, kv_cache_memory="4KiB"), cpu, bytes_per_token=100, max_len=128)
    with pytest.raises(ValueError, match=r"more than the KV pool's default budget \(4096 bytes\) holds"):
        kv_pool_blocks(EngineConfig(block_size=64, max_num_seqs=1), cpu, bytes_per_token=128, max_len=32)
    assert kv_pool_blocks(EngineConfig(block_size=16, kv_cache_memory=6400), cpu, bytes_per_token=100, max_len=8) == 4
