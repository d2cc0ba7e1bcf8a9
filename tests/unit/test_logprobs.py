"""The server's logprob shapes from engine entries, with a real (tiny, word-level) tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tokenmill.server.logprobs import prompt_logprobs, top_prompt_entries


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(str(tiny_llama))


def test_prompt_logprobs_rank_the_alternatives_around_the_prompts_own_token(tokenizer):
    """An entry is the own token, then the top-n best first without it: ranked 1..n, skipping the
    own token's rank when it is among them."""
    inside = {7: -1.5, 5: -0.5, 9: -2.0}   # own token 7 is second best: the top-3 are 5, 7, 9
    outside = {8: -6.0, 5: -0.5, 9: -2.0}  # own token 8 ranks 40th
    assert prompt_logprobs(tokenizer, [None, inside, outside, {6: -0.1}], [None, 2, 40, 1], 3) == [None, {
        "7": {"logprob": -1.5, "rank": 2, "decoded_token": "w7"},
        "5": {"logprob": -0.5, "rank": 1, "decoded_token": "w5"},
        "9": {"logprob": -2.0, "rank": 3, "decoded_token": "w9"},
    }, {
        "8": {"logprob": -6.0, "rank": 40, "decoded_token": "w8"},
        "5": {"logprob": -0.5, "rank": 1, "decoded_token": "w5"},
        "9": {"logprob": -2.0, "rank": 2, "decoded_token": "w9"},
    }, {"6": {"logprob": -0.1, "rank": 1, "decoded_token": "w6"}}]


def test_prompt_entries_scored_with_a_larger_top_n_are_cut_as_if_scored_with_the_smaller():
    """Echo's legacy logprobs and prompt_logprobs may ask for different n: the prompt is scored
    once with the larger, each view cut to its own (the own token always stays)."""
    inside, outside = {7: -1.5, 5: -0.5, 9: -2.0}, {8: -6.0, 5: -0.5, 9: -2.0}   # as above: ranks 2 and 40
    entries, ranks = [None, inside, outside], [None, 2, 40]
    assert top_prompt_entries(entries, ranks, 3) == entries
    assert top_prompt_entries(entries, ranks, 2) == [None, {7: -1.5, 5: -0.5}, {8: -6.0, 5: -0.5, 9: -2.0}]
    assert top_prompt_entries(entries, ranks, 1) == [None, {7: -1.5, 5: -0.5}, {8: -6.0, 5: -0.5}]
    assert top_prompt_entries(entries, ranks, 0) == [None, {7: -1.5}, {8: -6.0}]
