"""Incremental detokenization: UTF-8 safe deltas and stop strings that never leak."""

from __future__ import annotations

import pytest

from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

CORPUS = ["héllo wörld, naïve café 🎉🎉 日本語のテキスト", "The quick brown fox jumps over the lazy dog.",
          "END of story. Once upon a time, the end."] * 20


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE (trained here, no hub): multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def stream(tokenizer, text: str, params: SamplingParams, prompt: str = "Prompt: "):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    deltas, stop = [], None
    for token in tokenizer.encode(text):
        delta, stop = detok.update([token])
        deltas.append(delta)
        if stop:
            break
    if stop is None:
        deltas.append(detok.flush())
    return deltas, stop


def test_deltas_are_whole_characters_and_add_up_to_the_text(tokenizer):
    text = "héllo wörld 🎉 日本語"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # some characters really are split across tokens
    deltas, _ = stream(tokenizer, text, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_is_cut_and_never_emitted_even_in_part(tokenizer):
    deltas, stop = stream(tokenizer, "Once upon a time, the end. More text", SamplingParams(stop=["the end"]))
    assert stop == "the end"
    assert "".join(deltas) == "Once upon a time, "
    assert not any("the" in d for d in deltas)


def test_stop_string_can_be_kept(tokenizer):
    params = SamplingParams(stop=["time"], include_stop_str_in_output=True)
    deltas, stop = stream(tokenizer, "Once upon a time, the end.", params)
    assert "".join(deltas) == "Once upon a time"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, stop = stream(tokenizer, "The quick brown fox jumps", SamplingParams(stop=["fox", "quick"]))
    assert stop == "quick" and "".join(deltas) == "The "


def test_held_back_text_is_flushed_when_no_stop_matches(tokenizer):
    deltas, stop = stream(tokenizer, "The lazy dog.", SamplingParams(stop=["dog!"]))
    assert stop is None and "".join(deltas) == "The lazy dog."


def test_stop_strings_count_only_from_min_tokens_on(tokenizer):
    """As EOS and stop ids: a stop string ending before the min_tokens-th output token does not
    stop the request; one ending in that token's text or later does (whether the tokens come one
    at a time or all in one update, as with speculation)."""
    text = "the end. the end. the end."
    ids = tokenizer.encode(text)
    ends = [len(tokenizer.decode(ids[:i + 1])) for i in range(len(ids))]  # text length after each token

    def expected_cut(min_tokens: int) -> int | None:
        boundary = ends[min_tokens - 2] if min_tokens >= 2 else 0  # text before the min_tokens-th token
        starts = [i for i in range(len(text)) if text.startswith("the end", i) and i + 7 > boundary]
        return starts[0] if starts else None

    past_first = next(i for i, e in enumerate(ends) if e > 7) + 2  # a min_tokens past the first stop's end
    assert expected_cut(0) == 0 and expected_cut(past_first) == 9
    for min_tokens in (0, past_first, len(ids)):
        params = SamplingParams(stop=["the end"], min_tokens=min_tokens, max_tokens=None)
        deltas, stop = stream(tokenizer, text, params)
        cut = expected_cut(min_tokens)
        assert stop == (None if cut is None else "the end")
        assert "".join(deltas) == (text if cut is None else text[:cut])
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "), params)
        delta, stop_all = detok.update(ids)  # every token in one update
        assert stop_all == stop and delta + (detok.flush() if stop is None else "") == "".join(deltas)


def test_the_token_that_ended_a_request_is_left_out_of_its_text(tokenizer):
    """EOS or a stop token id: its text is not part of the output (as in vLLM), unless
    include_stop_str_in_output; the tokens before it in the same update are."""
    ids = tokenizer.encode("The quick brown fox")
    for include, expected in ((False, tokenizer.decode(ids[:-1])), (True, tokenizer.decode(ids))):
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "),
                                       SamplingParams(include_stop_str_in_output=include))
        text = detok.update(ids[:2])[0] + detok.update(ids[2:], stop_token=True)[0] + detok.flush()
        assert text == expected and detok.num_tokens == len(ids)


def test_a_prompt_that_ends_inside_a_character_gives_the_output_only_its_own_text(tokenizer):
    """A token-id prompt can end inside a character (an earlier output cut mid-character): the
    output's text is what it adds to the prompt's, the character it completes included, never the
    prompt's own text; a byte the output leaves broken stays the prompt's."""
    ids = tokenizer.encode("Prompt: 日本語")
    cut = next(k for k in range(len(ids), 0, -1) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    prompt, output = ids[:cut], ids[cut:]
    assert not tokenizer.decode(prompt).endswith("語")  # (the prompt ends inside 語 or before it)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    whole, shown = tokenizer.decode(ids), tokenizer.decode(prompt).rstrip("\ufffd")
    assert detok.update(output)[0] + detok.flush() == whole[len(shown):]
    broken = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())  # then words, not the rest of 語
    words = tokenizer.encode(" the end")
    assert broken.update(words)[0] + broken.flush() == tokenizer.decode(prompt + words)[len(tokenizer.decode(prompt)):]
