"""Structured outputs: specs validated, compiled against a byte-level tokenizer, masks that follow
the text, and the sampler keeping a constrained row inside its grammar."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tokenmill.request import Request
from tokenmill.sampler import Sampler, SamplingMetadata
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.tools import plan_tools
from tokenmill.structured import (
    GrammarCompiler,
    allowed_tokens,
    compile_error,
    compile_stack_bytes,
    forbid_undeclared_properties,
)

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


DEEP_SCHEMA = {}
for _ in range(64):  # 65 levels of JSON: a schema as deep as this would be compiled, and closed, recursively
    DEEP_SCHEMA = {"items": DEEP_SCHEMA}


@pytest.mark.parametrize("spec, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"choice": []}, "choice must be a list of non-empty strings"),
    ({"choice": ["a", ""]}, "choice must be a list of non-empty strings"),
    ({"json": 3}, "json must be a JSON schema"),
    ({"regex": ""}, "regex must be a string"),
    ({"schema": {}}, "unknown fields: schema"),
    ({"json": DEEP_SCHEMA},
     "structured_outputs.json nests objects and arrays deeper than 64 levels"),
    ({"choice": [f"c{i}" for i in range(2000)]}, "structured_outputs.choice takes at most 1,999 strings, got 2,000"),
])
def test_specs_name_their_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=spec)


@pytest.mark.parametrize("spec, message", [
    ({"regex": "a(b"}, "unclosed group"),
    ({"json": {"type": "nonsense"}}, "nonsense"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": json.dumps(DEEP_SCHEMA)}, "the JSON schema nests objects and arrays deeper than 64 levels"),
    ({"json": '{"items": ' * 100_000}, "the JSON schema nests objects and arrays deeper than 64 levels"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
])
def test_invalid_grammars_are_value_errors(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compile_(compiler, **spec)


def test_a_compile_panics_message_loses_its_backtrace():
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10"
    frames = "   0: <unknown>\n  16: type_call\n             at Objects/typeobject.c:1091:11\n"
    text = f"{panic}\n<backtrace>\n{frames}</backtrace>"
    assert compile_error(text) == panic and compile_error("Parser Error: x") == "Parser Error: x"


def test_chains_of_10000_refs_and_of_10000_lark_rules_compile_and_take_their_one_text(compiler, tokenizer):
    """llguidance recurses once per link of a chain: a default thread's 8 MB stack overflowed at
    3,000 (a segfault, the server gone); the compile runs on a stack sized by the grammar."""
    n = 10_000
    refs = {"$ref": "#/$defs/a0", "$defs": {**{f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)},
                                             f"a{n}": {"enum": ["yes"]}}}
    rules = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "z"\n'
    for spec, text in (({"json": refs}, '"yes"'), ({"grammar": rules}, "z")):
        grammar = compile_(compiler, **spec)
        assert walk(grammar, tokenizer, text) and grammar.is_terminated


def test_a_grammar_past_8_mi_characters_is_refused_before_it_is_compiled():
    with pytest.raises(ValueError, match="its grammar is 8,388,609 characters, more than 8,388,608"):
        compile_stack_bytes("x" * (8 * 1024 * 1024 + 1))


def test_a_string_held_to_9_patterns_at_once_is_refused_at_once_and_8_compile(compiler):
    """llguidance checks that the patterns' intersection is not empty, in time and memory
    exponential in their number (25 failed to allocate 4.5 GB): 8 at most, counted through
    nested allOf parts and the local $refs among them."""
    def schema(patterns: list[str]) -> dict:
        nested = {"allOf": [{"pattern": p} for p in patterns[:-1]]}
        return {"$defs": {"last": {"pattern": patterns[-1]}}, "type": "string",
                "allOf": [nested, {"$ref": "#/$defs/last"}]}
    compile_(compiler, json=schema(["^[a-h]+$", *"abcdefg"]))
    start = time.monotonic()
    with pytest.raises(ValueError, match="holds a string to more than 8 patterns at once"):
        compile_(compiler, json=schema([f"a.{{{i}}}b" for i in range(1, 30)]))
    assert time.monotonic() - start < 1
    properties = {f"p{i}": {"type": "string", "pattern": f"a.{{{i}}}b"} for i in range(20)}
    compile_(compiler, json={"type": "object", "properties": properties})  # apart, not at once


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


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CLOSED_CITY = {**CITY, "additionalProperties": False}


def test_object_schemas_that_declare_properties_take_no_others_at_any_depth():
    schema = {"type": "object", "properties": {
        "home": CITY, "trips": {"type": "array", "items": CITY}, "pair": {"prefixItems": [CITY, {"type": "null"}]},
        "either": {"anyOf": [CITY, {"type": "string"}]}, "one": {"oneOf": [{"$ref": "#/$defs/Place"}]},
        "by_name": {"type": "object", "additionalProperties": CITY},
        "default": {"type": "object", "default": {"properties": {"x": {}}}, "const": {"properties": {}}}},
        "$defs": {"Place": CITY}, "definitions": {"Old": {"required": ["id"]}}}
    closed = forbid_undeclared_properties(schema)
    assert closed == {**schema, "additionalProperties": False, "properties": {
        "home": CLOSED_CITY, "trips": {"type": "array", "items": CLOSED_CITY},
        "pair": {"prefixItems": [CLOSED_CITY, {"type": "null"}]},
        "either": {"anyOf": [CLOSED_CITY, {"type": "string"}]}, "one": {"oneOf": [{"$ref": "#/$defs/Place"}]},
        "by_name": {"type": "object", "additionalProperties": CLOSED_CITY},
        "default": schema["properties"]["default"]},  # values are data: default and const untouched
        "$defs": {"Place": CLOSED_CITY},
        "definitions": {"Old": {"required": ["id"], "properties": {"id": True}, "additionalProperties": False}}}
    assert "additionalProperties" not in schema and "additionalProperties" not in CITY  # a copy


@pytest.mark.parametrize("given", [
    {"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
    {"additionalProperties": False}, {"patternProperties": {"^x_": {"type": "string"}}},
    {"unevaluatedProperties": False},
], ids=["true", "a schema", "false", "patternProperties", "unevaluatedProperties"])
def test_an_object_schema_that_says_what_other_properties_it_takes_is_left_alone(given):
    schema = {"type": "object", "properties": {"inner": CITY}, **given}
    assert forbid_undeclared_properties(schema) == {**schema, "properties": {"inner": CLOSED_CITY}}
    assert forbid_undeclared_properties({"type": "object"}) == {"type": "object"}  # declares none: any object
    assert forbid_undeclared_properties({"type": "string"}) == {"type": "string"}


def test_composed_objects_are_closed_as_a_whole_not_part_by_part():
    """Closing each part of an allOf (or the $ref beside an object's own keys) on its own would
    refuse the keys its siblings declare: the whole is closed on all their names instead."""
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    both = forbid_undeclared_properties({"allOf": [place, {"properties": {"zip": {"type": "string"}}}]})
    assert both == {"allOf": [place, {"properties": {"zip": {"type": "string"}}}],
                    "properties": {"city": True, "zip": True}, "additionalProperties": False}
    extended = forbid_undeclared_properties({"$defs": {"Place": place}, "$ref": "#/$defs/Place",
                                             "properties": {"zip": {"type": "string"}}})
    assert extended == {"$defs": {"Place": {**place, "additionalProperties": False}}, "allOf": [place],
                        "properties": {"city": True, "zip": {"type": "string"}}, "additionalProperties": False}
    branches = forbid_undeclared_properties({"properties": {"id": {"type": "integer"}},
                                             "anyOf": [place, {"required": ["zip"]}]})
    assert branches == {"properties": {"id": {"type": "integer"}}, "anyOf": [
        {**place, "properties": {"id": True, "city": {"type": "string"}}, "additionalProperties": False},
        {"required": ["zip"], "properties": {"id": True, "zip": True}, "additionalProperties": False}]}
    cycle = {"$defs": {"N": {"allOf": [{"$ref": "#/$defs/N"}], "properties": {"v": {}}}}, "$ref": "#/$defs/N"}
    assert forbid_undeclared_properties(cycle)["$ref"] == "#/$defs/N"  # a cycle ends (and stays a $ref)


def test_composed_objects_take_their_parts_keys_and_no_others(compiler, tokenizer):
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    for schema in ({"allOf": [place, {"properties": {"zip": {"type": "string"}}}]},
                   {"$defs": {"Place": place}, "$ref": "#/$defs/Place", "properties": {"zip": {"type": "string"}}}):
        assert walk(compile_(compiler, json=schema), tokenizer, '{"city": "Paris", "zip": "75001"}')
        assert not walk(compile_(compiler, json=schema), tokenizer, '{"city": "Paris", "x"')
        assert walk(compile_(compiler, json=schema, disable_additional_properties=False), tokenizer,
                    '{"city": "Paris", "x"')


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
NOW = {"type": "function", "function": {"name": "now"}}


def undeclared_key_grammars(compiler):
    """(name, a fresh grammar, the JSON object's text before it) for each way an object schema reaches
    the engine: a response format and the calls of tool_choice named and required."""
    fmt = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}).sampling_params(16, None, None)
    named = plan_tools([WEATHER, NOW], {"type": "function", "function": {"name": "get_weather"}}, None)
    required = plan_tools([WEATHER, NOW], "required", None)
    return [("response_format", lambda: compiler.compile(fmt.structured_outputs), ""),
            ("named", lambda: compile_(compiler, **named.constraint()), ""),
            ("required", lambda: compile_(compiler, **required.constraint()),
             '[{"name": "get_weather", "parameters": ')]


def test_a_response_format_and_forced_tool_calls_refuse_a_key_the_schema_never_declared(compiler, tokenizer):
    for name, grammar, before in undeclared_key_grammars(compiler):
        assert walk(grammar(), tokenizer, before + '{"city": "Paris"}'), name
        assert not walk(grammar(), tokenizer, before + '{"city": "Paris", "x"'), name


def test_required_calls_resolve_each_tools_own_defs_and_references(compiler, tokenizer):
    """openai.pydantic_function_tool writes a nested model as "$defs" and "$ref": "#/$defs/...";
    under tool_choice "required" every tool's schema sits inside one array schema, where each
    reference must still reach its own tool's definitions (two tools may use one name)."""
    register = {"type": "object", "required": ["address"], "properties": {"address": {"$ref": "#/$defs/Address"}},
                "$defs": {"Address": {"type": "object", "required": ["city"],
                                      "properties": {"city": {"type": "string"}}}}}
    count = {"type": "object", "required": ["n"], "properties": {"n": {"$ref": "#/$defs/Address"}},
             "$defs": {"Address": {"type": "integer"}}}
    chain = {"type": "object", "required": ["next"],
             "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}}
             for name, schema in (("register", register), ("count", count), ("chain", chain))]
    required = plan_tools(tools, "required", None).constraint()

    def fits(text: str) -> bool:
        return walk(compile_(compiler, **required), tokenizer, text)
    assert fits('[{"name": "register", "parameters": {"address": {"city": "Paris"}}}, '
                '{"name": "count", "parameters": {"n": 3}}, '
                '{"name": "chain", "parameters": {"next": {"next": null}}}]')
    assert not fits('[{"name": "count", "parameters": {"n": {')  # count's Address is an integer
    assert not fits('[{"name": "register", "parameters": {"address": 3')
    # a schema with its own $id, and a const that looks like a reference: as they worked before
    tagged = {**register, "$id": "https://example.com/register.json",
              "properties": {**register["properties"], "kind": {"const": {"$ref": "#/x"}}}}
    tool = {"type": "function", "function": {"name": "tagged", "parameters": tagged}}
    assert walk(compile_(compiler, **plan_tools([tool], "required", None).constraint()), tokenizer,
                '[{"name": "tagged", "parameters": {"address": {"city": "Oslo"}, "kind": {"$ref": "#/x"}}}]')


@pytest.mark.parametrize("parameters", [None, {}, {"type": "object"}, {"type": "object", "properties": {}}])
def test_a_function_without_parameters_is_called_with_no_arguments(compiler, tokenizer, parameters):
    """A tool whose parameters are left out, or declare no property, takes none: forced, its
    arguments are {} (an empty `properties` is a declaration, where {"type": "object"} alone in a
    response_format stays any object)."""
    function = {"name": "ping", **({} if parameters is None else {"parameters": parameters})}
    named = plan_tools([{"type": "function", "function": function}], {"type": "function", "function": {"name": "ping"}},
                       None)
    grammar = compile_(compiler, **named.constraint())
    assert walk(grammar, tokenizer, "{}") and grammar.is_terminated
    assert not walk(compile_(compiler, **named.constraint()), tokenizer, '{"x"')
    empty = compile_(compiler, json={"type": "object", "properties": {}})
    assert not walk(empty, tokenizer, '{"x"')
    assert forbid_undeclared_properties({"type": "object", "properties": {}}) == {
        "type": "object", "properties": {}, "additionalProperties": False}


def test_the_permissive_option_lets_an_undeclared_key_through_but_never_into_tool_arguments(compiler, tokenizer):
    permissive = compile_(compiler, json=CITY, disable_additional_properties=False)
    assert walk(permissive, tokenizer, '{"city": "Paris", "x": 1}')
    assert SamplingParams(structured_outputs={"json": CITY}).structured_outputs.disable_additional_properties
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.constraint()["disable_additional_properties"] is True
    with pytest.raises(ValueError, match="disable_additional_properties must be a boolean"):
        SamplingParams(structured_outputs={"json": CITY, "disable_additional_properties": "no"})


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
    grammar = compile_(compiler, choice=["red"])
    request = Request(request_id="r", prompt_token_ids=[3, 4], params=SamplingParams(max_tokens=50, min_tokens=10),
                      max_tokens=50, eos_token_ids=frozenset({1}), grammar=grammar)
    ids = tokenizer.encode("red", add_special_tokens=False)
    for t in ids[:-1]:
        request.append_token(t, 0.0)
        assert request.stop_status(t, 128) is None
    request.append_token(ids[-1], 0.0)
    assert request.stop_status(ids[-1], 128).name == "FINISHED_STOPPED"


def test_a_failed_grammar_ends_the_request_with_an_error(compiler, tokenizer):
    """A token the grammar does not allow (only a caller appending its own tokens can give one)
    leaves the output outside the language: an error, not a "stop" or "length" answer."""
    grammar = compile_(compiler, regex="[0-9]+")
    request = Request(request_id="r", prompt_token_ids=[3, 4], params=SamplingParams(max_tokens=2),
                      max_tokens=2, eos_token_ids=frozenset({1}), grammar=grammar)
    seven, = tokenizer.encode("7", add_special_tokens=False)
    request.append_token(seven, 0.0)
    assert request.stop_status(seven, 128) is None and not grammar.failed
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    request.append_token(letter, 0.0)  # the last token max_tokens allows, and not the grammar's
    assert grammar.failed and request.stop_status(letter, 128).name == "FINISHED_ERROR"
