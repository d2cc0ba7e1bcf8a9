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
