"""Reasoning split from answers, whole and streamed: the streamed pieces add up to the whole
split at every cut of the text (pieces are only ever appended, so a piece of a tag sent early
would stay in the sum)."""

from __future__ import annotations

import pytest

from tokenmill.server.reasoning import ReasoningParser, ReasoningStream


@pytest.mark.parametrize("kind, text, reasoning, content", [
    ("qwen3", "<think>\nhmm</think>\n\nParis.", "\nhmm", "\n\nParis."),
    ("qwen3", "Paris.", "", "Paris."),                                 # no thinking (enable_thinking false)
    ("qwen3", "<think>still going", "still going", ""),                # cut short while thinking
    ("qwen3", "a <think> b", "", "a <think> b"),                       # a tag inside the answer is text
    ("qwen3", "abc</think>def", "", "abc</think>def"),                 # and a closing one: no block opened
    ("deepseek_r1", "hmm</think>Paris.", "hmm", "Paris."),             # the template opened the block
    ("deepseek_r1", "<think>hmm</think>Paris.", "hmm", "Paris."),
    ("deepseek_r1", "still going", "still going", ""),
])
def test_whole_outputs_split(kind, text, reasoning, content):
    assert ReasoningParser(kind).split(text) == (reasoning, content)


@pytest.mark.parametrize("kind, text", [
    ("qwen3", "<think>\nhmm, let me see</think>\n\nParis it is."), ("qwen3", "Paris <thinks> it is."),
    ("qwen3", "<think>a</thin"), ("qwen3", "abc</think>def"), ("deepseek_r1", "hmm</th</think>Paris</think>."),
    ("deepseek_r1", "<thi"),
])
def test_streamed_pieces_add_up_to_the_whole_split_at_every_cut(kind, text):
    parser = ReasoningParser(kind)
    for step in (1, 2, 3, 5):
        stream, reasoning, content = ReasoningStream(parser), "", ""
        cuts = list(range(step, len(text), step)) + [len(text)]
        for cut in cuts:
            new_reasoning, so_far, new_content = stream.step(text[:cut], finished=cut == len(text))
            reasoning, content = reasoning + new_reasoning, content + new_content
            assert so_far == content
        assert (reasoning, content) == parser.split(text), step
