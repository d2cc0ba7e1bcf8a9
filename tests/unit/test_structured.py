"""Structured outputs: specs validated, compiled against a byte-level tokenizer, masks that follow
the text, and the sampler keeping a constrained row inside its grammar."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tokenmill.request import Request
from tokenmill.sampler import Sampler, SamplingMetadata
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.scheduler import Scheduler
from tokenmill.structured import GrammarCompiler, allowed_tokens

VOCAB = 384


@pytest.fixture(scope="module")
def tokenizer(tiny_bytes):
    return AutoTokenizer.from_pretrained(str(tiny_bytes))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB + 16, frozenset({1}))  # logits wider than the tokenizer


def compile_(compiler, **spec):
    return compiler.compile(StructuredOutputsParams(**spec))


def allowed_texts(grammar, tokenizer) -> set[str]:
    ids = np.nonzero(allowed_tokens([grammar], VOCAB)[0])[0]
    return {tokenizer.decode([int(t)]) for t in ids}


def walk(grammar, tokenizer, text: str) -> bool:
    """Feed the tokens of `text`, checking each was allowed; True if all were."""
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not allowed_tokens([grammar], VOCAB)[0, t]:
            return False
        grammar.accept(t)
    return True


@pytest.mark.parametrize("spec, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"choice": []}, "choice must be a list of non-empty strings"),
    ({"choice": ["a", ""]}, "choice must be a list of non-empty strings"),
    ({"json": 3}, "json must be a JSON schema"),
    ({"regex": ""}, "regex must be a string"),
    ({"schema": {}}, "unknown fields: schema"),
])
def test_specs_name_their_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=spec)


@pytest.mark.parametrize("spec, message", [
    ({"regex": "a(b"}, "unclosed group"),
    ({"json": {"type": "nonsense"}}, "nonsense"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
])
def test_invalid_grammars_are_value_errors(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compile_(compiler, **spec)


def test_a_json_schema_allows_only_what_continues_a_valid_document(compiler, tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    grammar = compile_(compiler, json=json.dumps(schema))  # the schema as text works too
    first = allowed_texts(grammar, tokenizer)
    assert first and all(s.startswith("{") for s in first)
    assert walk(grammar, tokenizer, '{"ok": ') and not grammar.is_terminated
    assert allowed_texts(grammar, tokenizer) <= {"t", "f", "tr", "fa", "true", "false", "tru", "fal", "fals"}
    assert walk(grammar, tokenizer, "true}") and grammar.is_terminated
    # the layout is json.dumps's: no whitespace where it puts none
    assert not walk(compile_(compiler, json=schema), tokenizer, '{ "ok"')


def test_choices_regexes_and_gbnf_grammars(compiler, tokenizer):
    choice = compile_(compiler, choice=["red", 'say "hi"'])
    assert walk(choice, tokenizer, 'say "hi"') and choice.is_terminated
    assert not walk(compile_(compiler, choice=["red", "green"]), tokenizer, "blue")
    regex = compile_(compiler, regex="[0-9]{2}x")
    assert walk(regex, tokenizer, "42") and allowed_texts(regex, tokenizer) == {"x"}
    assert not walk(compile_(compiler, regex="[0-9]{2}x"), tokenizer, "4a")
    gbnf = compile_(compiler, grammar='root ::= "(" [ab]+ ")"')
    assert walk(gbnf, tokenizer, "(abba)") and gbnf.is_terminated


def test_an_open_ended_grammar_allows_eos_where_the_text_is_complete(compiler, tokenizer):
    grammar = compile_(compiler, regex="[0-9]+")
    assert not allowed_tokens([grammar], VOCAB)[0, 1]      # nothing yet: no end
    assert walk(grammar, tokenizer, "7")
    assert allowed_tokens([grammar], VOCAB)[0, 1] and not grammar.is_terminated
    grammar.accept(1)
    assert grammar.is_terminated


def test_masks_cover_the_logits_width(compiler):
    grammar = compile_(compiler, json_object=True)
    assert allowed_tokens([grammar], VOCAB + 16).shape == (1, VOCAB + 16)
    assert not allowed_tokens([grammar], VOCAB + 16)[0, VOCAB:].any()  # no such tokens in the tokenizer
    assert allowed_tokens([grammar], 100).shape == (1, 100)


class FixedGrammar:
    """A grammar that always allows the same tokens (V <= 32), for the sampler alone."""

    num_words = 1

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row, 0] = np.int32(np.uint32(sum(1 << t for t in self.allowed)).view(np.int32))


def constrained(rid: str, allowed: list[int] | None, **params) -> Request:
    r = Request(request_id=rid, prompt_token_ids=[3, 4], params=SamplingParams(max_tokens=50, **params),
                max_tokens=50, eos_token_ids=frozenset({1}))
    r.grammar = FixedGrammar(allowed) if allowed is not None else None
    return r


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_the_sampler_keeps_constrained_rows_in_their_grammar_and_leaves_the_others(kernels):
    from tokenmill.cpu_kernels import load_cpu_kernels
    loaded = load_cpu_kernels(required=False) if kernels else None
    if kernels and loaded is None:
        pytest.skip("no C++ compiler")
    V = 8
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    worst = [int(row.argmin()) for row in logits]
    reqs = [constrained("a", [worst[0]], temperature=0.0, logprobs=0),
            constrained("b", None, temperature=0.0),
            constrained("c", [2, 5], temperature=1.0),
            # allowed_token_ids and the grammar share no token: the grammar's own stay
            constrained("d", [worst[3]], temperature=0.0, allowed_token_ids=[(worst[3] + 1) % V])]
    for seed in range(10):
        meta = SamplingMetadata.build(reqs, {}, V, torch.device("cpu"))
        out = Sampler(seed, torch.device("cpu"), kernels=loaded)(logits.clone(), meta)
        assert out.token_ids[0] == worst[0] and out.token_ids[1] == int(logits[1].argmax())
        assert out.token_ids[2] in (2, 5) and out.token_ids[3] == worst[3]
        assert out.logprobs[0][worst[0]] == pytest.approx(float(logits[0].log_softmax(-1)[worst[0]]))


def test_a_completed_grammar_ends_the_request_even_under_min_tokens(tiny_bytes, compiler, tokenizer):
    from tokenmill.config import SchedulerConfig
    from tokenmill.kv_cache import KVCacheManager
    grammar = compile_(compiler, choice=["red"])
    request = Request(request_id="r", prompt_token_ids=[3, 4], params=SamplingParams(max_tokens=50, min_tokens=10),
                      max_tokens=50, eos_token_ids=frozenset({1}), grammar=grammar)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
                          KVCacheManager(num_blocks=16, block_size=4))
    ids = tokenizer.encode("red", add_special_tokens=False)
    for t in ids[:-1]:
        request.append_token(t, 0.0)
        assert scheduler._stop_status(request, t) is None
    request.append_token(ids[-1], 0.0)
    assert scheduler._stop_status(request, ids[-1]).name == "FINISHED_STOPPED"


def test_a_failed_grammar_ends_the_request_with_an_error(compiler, tokenizer):
    """A token the grammar does not allow (only a caller appending its own tokens can give one)
    leaves the output outside the language: an error, not a "stop" or "length" answer."""
    from tokenmill.config import SchedulerConfig
    from tokenmill.kv_cache import KVCacheManager
    grammar = compile_(compiler, regex="[0-9]+")
    request = Request(request_id="r", prompt_token_ids=[3, 4], params=SamplingParams(max_tokens=2),
                      max_tokens=2, eos_token_ids=frozenset({1}), grammar=grammar)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
                          KVCacheManager(num_blocks=16, block_size=4))
    seven, = tokenizer.encode("7", add_special_tokens=False)
    request.append_token(seven, 0.0)
    assert scheduler._stop_status(request, seven) is None and not grammar.failed
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    request.append_token(letter, 0.0)  # the last token max_tokens allows, and not the grammar's
    assert grammar.failed and scheduler._stop_status(request, letter).name == "FINISHED_ERROR"
