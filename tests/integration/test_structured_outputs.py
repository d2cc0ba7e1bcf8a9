"""Structured outputs end to end on a tiny random model with a byte-level tokenizer: random
weights write garbage unless the grammar holds them, so every output that parses is the
grammar's doing. Offline (beside unconstrained requests, under preemption, with speculation
configured) and over HTTP with the official openai client."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from test_server import openai_client, running_server

from tokenmill import LLM, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"enum": [1, 2, 3]}, "tags": {"type": "array", "maxItems": 2,
                                                            "items": {"type": "string", "maxLength": 3}}}}


def check(value: dict) -> None:
    assert set(value) == {"name", "ok", "n", "tags"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert len(value["tags"]) <= 2 and all(isinstance(t, str) and len(t) <= 3 for t in value["tags"])


CONSTRAINED = [
    (SamplingParams(max_tokens=120, temperature=0.0, structured_outputs={"json": SCHEMA}),
     lambda text: check(json.loads(text))),
    (SamplingParams(max_tokens=120, temperature=1.0, seed=1, structured_outputs={"json": SCHEMA}),
     lambda text: check(json.loads(text))),
    (SamplingParams(max_tokens=40, temperature=1.0, seed=2, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"}),
     lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) or pytest.fail(text)),
    (SamplingParams(max_tokens=40, temperature=0.8, seed=3, structured_outputs={"choice": ["red", "green", "blue"]}),
     lambda text: text in ("red", "green", "blue") or pytest.fail(text)),
    # any object: unbounded, so a random model may still be writing one at max_tokens
    (SamplingParams(max_tokens=40, temperature=1.0, seed=4, structured_outputs={"json_object": True}),
     lambda text: text.startswith("{")),
]


def generate(llm: LLM, with_plain: bool = True):
    params = [p for p, _ in CONSTRAINED]
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = ["hello there", "The quick brown fox", "0123", "Paris", "{}"]
    if with_plain:
        params, prompts = params + [plain], prompts + ["yes no maybe"]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def roomy(tiny_bytes):
    return generate(LLM(str(tiny_bytes), max_model_len=512, num_kv_blocks=256, block_size=16))


def test_outputs_follow_their_grammar_beside_an_unconstrained_request(tiny_bytes, roomy):
    for (params, follows), out in zip(CONSTRAINED, roomy):
        if not params.structured_outputs.json_object:  # bounded: the grammar completed, nothing may follow
            assert out.finish_reason == "stop", out.text
        follows(out.text)
    alone = LLM(str(tiny_bytes), max_model_len=512).generate(
        ["yes no maybe"], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert roomy[-1].token_ids == alone[0].outputs[0].token_ids  # the masks touch only their own rows


def test_unconstrained_garbage_does_not_parse(roomy):
    """The control: the same model without a grammar does not write JSON by chance."""
    with pytest.raises(json.JSONDecodeError):
        json.loads(roomy[-1].text)


@pytest.mark.parametrize("options", [
    dict(num_kv_blocks=10, block_size=8, max_num_seqs=6, preemption_mode="recompute"),
    dict(num_kv_blocks=10, block_size=8, max_num_seqs=6, preemption_mode="swap", swap_space=1 << 22),
    dict(speculative="ngram", num_speculative_tokens=3, speculative_adaptive=False),
    dict(async_scheduling=True, async_output=False),
], ids=["recompute", "swap", "ngram", "async_scheduling"])
def test_the_same_outputs_under_preemption_speculation_and_async_scheduling(tiny_bytes, roomy, options):
    """A preempted request keeps its grammar's place (its tokens are not fed again); a
    constrained request does not speculate, so its tokens are the plain steps' ones; async
    scheduling waits for a constrained request's last token (its mask depends on it)."""
    llm = LLM(str(tiny_bytes), max_model_len=512, **{"block_size": 16, **options})
    outs = generate(llm)
    if "preemption_mode" in options:
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_n_samples_each_follow_the_grammar(tiny_bytes):
    llm = LLM(str(tiny_bytes), max_model_len=512)
    params = SamplingParams(n=4, max_tokens=60, temperature=1.0, seed=9, structured_outputs={"json": SCHEMA})
    outs = llm.generate(["hello"], params, use_tqdm=False)[0].outputs
    assert len(outs) == 4 and len({o.text for o in outs}) > 1
    for out in outs:
        check(json.loads(out.text))


def test_a_grammar_that_fails_mid_output_ends_its_request_with_an_error(tiny_bytes, monkeypatch):
    """llguidance fails rather than raises: a matcher that lets a token through it should not
    have (here its mask is opened to every token) ends the request as an error naming the
    grammar, and the request beside it is untouched."""
    from tokenmill.structured import Grammar
    monkeypatch.setattr(Grammar, "fill_mask", lambda self, bitmask, row: bitmask.__setitem__(row, -1))
    llm = LLM(str(tiny_bytes), max_model_len=512)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = "hello there, " * 6  # several full blocks
    constrained = greedy.clone(structured_outputs={"regex": "[0-9]+"})
    digits, plain = llm.generate([prompt, "yes no maybe"], [constrained, greedy], use_tqdm=False)
    assert digits.outputs[0].finish_reason == "error" and "grammar failed" in digits.error
    assert "\n" not in digits.error  # llguidance's first line, not its dump of the parser's state
    assert len(digits.outputs[0].token_ids) < 30 and not re.fullmatch("[0-9]+", digits.outputs[0].text)
    assert plain.error is None and plain.outputs[0].finish_reason == "length"
    # a stop string the failing token completes does not turn the error into an answer
    stopped, = llm.generate([prompt], constrained.clone(stop=[digits.outputs[0].text[-1]]), use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "error" and "grammar failed" in stopped.error
    # nor does the failure make the cache forget the prompt's blocks (its KV is sound)
    again, = llm.generate([prompt], greedy.clone(max_tokens=1), use_tqdm=False)
    assert again.metrics.num_cached_tokens > 0


# ---- over HTTP --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_bytes):
    with running_server(tiny_bytes) as s:
        yield s


@pytest.fixture
def client(server):
    return openai_client(server.url)


def test_response_format_json_schema_in_chat_whole_and_streamed(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=120, temperature=0, response_format=response_format)
    check(json.loads(whole.choices[0].message.content))
    assert whole.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=120, temperature=0, response_format=response_format,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    obj = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                                         temperature=1.0, seed=5, response_format={"type": "json_object"})
    content = obj.choices[0].message.content  # any object: it may still be open at max_tokens
    assert content.startswith("{")
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict)


def test_vllm_fields_in_completions(client):
    choice = client.completions.create(model="tiny", prompt="pick", max_tokens=20, temperature=1.0, seed=1,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model="tiny", prompt="code", max_tokens=20, temperature=1.0, seed=2,
                                      extra_body={"structured_outputs": {"regex": "[a-c]{4}"}})
    assert re.fullmatch("[a-c]{4}", regex.choices[0].text)
    grammar = client.completions.create(model="tiny", prompt="list", max_tokens=30, temperature=1.0, seed=3,
                                        extra_body={"guided_grammar": 'root ::= "[" [0-9] ("," [0-9])* "]"'})
    assert re.fullmatch(r"\[[0-9](,[0-9])*\]", grammar.choices[0].text) or grammar.choices[0].finish_reason == "length"


def test_a_grammar_that_fails_is_a_500_naming_it_or_an_error_event_before_done(server, client, monkeypatch):
    from tokenmill.structured import Grammar
    monkeypatch.setattr(Grammar, "fill_mask", lambda self, bitmask, row: bitmask.__setitem__(row, -1))
    with pytest.raises(openai.InternalServerError, match="grammar failed"):
        client.completions.create(model="tiny", prompt="hello there", max_tokens=30, temperature=0,
                                  extra_body={"guided_regex": "[0-9]+", "ignore_eos": True})
    body = {"prompt": "hello there", "max_tokens": 30, "temperature": 0, "guided_regex": "[0-9]+", "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert "grammar failed" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"  # as vLLM's
    monkeypatch.undo()
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ({"guided_regex": "a(b"}, "unclosed group"),
    ({"guided_json": {"type": "nonsense"}}, "nonsense"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"lark": "start: x"}}, "structured_outputs"),
    ({"guided_regex": "[^\\s\\S]"}, "no text satisfies"),   # fails on its first mask: known before it runs
    ({"guided_regex": "a{1000000}"}, "too many"),  # its lexer, built as tokens come, fails on the first
    ({"guided_json": '{"items": ' * 5000 + "{}" + "}" * 5000}, "nests objects and arrays deeper than 64 levels"),
    ({"structured_outputs": {"json": json.loads('{"items": ' * 100 + "{}" + "}" * 100)}}, "structured_outputs.json"),
], ids=["unknown type", "no schema", "no name", "bad regex", "bad schema", "two constraints", "two in one",
        "unknown field", "nothing satisfies", "lexer too big", "schema text nested past json's decoder",
        "schema nested 100 deep"])
def test_bad_constraints_are_400s_and_the_server_keeps_serving(server, client, body, param):
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") or param in error["message"]
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


def test_a_constraint_that_does_not_compile_is_a_400_naming_the_field_it_came_in(server):
    """The compile fails in the engine (its field is structured_outputs there); the answer names
    the request's own field, as every other 400 does."""
    nonsense = {"type": "nonsense"}
    cases = [("/v1/completions", {"prompt": "hi", "guided_regex": "a(b"}, "guided_regex"),
             ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": nonsense}}, "structured_outputs"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
                 "type": "json_schema", "json_schema": {"name": "x", "schema": nonsense}}}, "response_format"),
             ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                   "schema": nonsense}}}, "text.format")]
    for path, body, param in cases:
        response = httpx.post(server.url + path, json={"max_tokens": 4, **body} if "input" not in body else body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith("invalid structured output: "), error


# ---- bad words (vLLM's): the other way to keep text out -------------------------------------------

@pytest.mark.parametrize("options", [{}, dict(async_scheduling=True, async_output=False)],
                         ids=["sync", "async_scheduling"])
def test_a_bad_word_the_model_would_write_is_avoided_from_where_it_would_complete(tiny_bytes, options):
    """Async scheduling waits for such a request's last token (the ban depends on it)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_bytes))
    llm = LLM(str(tiny_bytes), max_model_len=512, **options)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = llm.generate(["hello there"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    # a two-token word of the greedy output that tokenizes back to those tokens
    i = next(i for i in range(2, 28) if tokenizer.encode(tokenizer.decode(plain[i:i + 2]).lstrip(),
                                                       add_special_tokens=False) == plain[i:i + 2])
    word = tokenizer.decode(plain[i:i + 2])
    out = llm.generate(["hello there"], greedy.clone(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    assert out[:i + 1] == plain[:i + 1] and out[i + 1] != plain[i + 1]
    assert all(out[j:j + 2] != plain[i:i + 2] for j in range(len(out) - 1))


def test_bad_words_over_http_outrank_logit_bias(client, tiny_bytes):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_bytes))
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    forced = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0,
                                       logit_bias={str(yes[0]): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "yes" * 3
    banned = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0,
                                       logit_bias={str(yes[0]): 100},
                                       extra_body={"ignore_eos": True, "bad_words": ["yes"]})
    assert "yes" not in banned.choices[0].text


# ---- tool calling: named and required calls are structured outputs; auto ones are parsed -----------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city", "unit"],
             "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def hermes_client(tiny_bytes):
    """A server that parses Hermes tool calls and Qwen3's thinking."""
    with running_server(tiny_bytes, tool_call_parser="hermes", reasoning_parser="qwen3") as s:
        yield openai_client(s.url)


def test_a_named_tool_choice_calls_that_function_whole_and_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=60, temperature=0)
    message = whole.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1 and whole.choices[0].finish_reason == "stop"
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("C", "F") and len(arguments["city"]) <= 8
    stream = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                            max_tokens=60, temperature=0, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    pieces = [t.function.arguments for d in deltas for t in (d.delta.tool_calls or [])]
    assert "".join(pieces) == call.function.arguments and deltas[-1].finish_reason == "stop"


def test_required_tool_choice_makes_calls_to_the_tools(client):
    """One call with parallel_tool_calls false; otherwise at least one (a random model may go on
    adding calls: cut short by max_tokens, they come as far as they came, with "length")."""
    for seed in range(3):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
        calls = out.choices[0].message.tool_calls
        assert len(calls) == 1 and out.choices[0].finish_reason == "tool_calls"
        assert calls[0].function.name in ("get_weather", "now") and isinstance(json.loads(calls[0].function.arguments),
                                                                               dict)
    several = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=120, temperature=1.0, n=3, seed=3)
    for c in several.choices:
        assert c.message.content is None and c.finish_reason in ("tool_calls", "length")
        assert c.finish_reason == "length" or len(c.message.tool_calls) >= 1


def test_auto_tool_calls_are_parsed_from_the_models_own_format(hermes_client):
    """A random model does not call tools by itself: a regex makes it write a Hermes call (or
    plain text), and the server's parser turns that into tool_calls."""
    forced = 'OK<tool_call>\\{"name": "now", "arguments": \\{\\}\\}</tool_call>'
    out = hermes_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                                                extra_body={"guided_regex": forced})
    message = out.choices[0].message
    assert message.content == "OK" and [c.function.name for c in message.tool_calls] == ["now"]
    assert json.loads(message.tool_calls[0].function.arguments) == {} and out.choices[0].finish_reason == "tool_calls"
    stream = hermes_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60,
                                                   temperature=0, stream=True, extra_body={"guided_regex": forced})
    deltas = [c.choices[0] for c in stream if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == "OK"
    assert [t.function.name for d in deltas for t in (d.delta.tool_calls or [])] == ["now"]
    plain = hermes_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=20,
                                                  temperature=0, extra_body={"guided_regex": "hello"})
    assert plain.choices[0].message.content == "hello" and not plain.choices[0].message.tool_calls


@pytest.fixture(scope="module")
def mistral_client(tiny_bytes, tmp_path_factory):
    """A server that parses Mistral's tool calls, its tokenizer with "[TOOL_CALLS]" as a special token."""
    from conftest import copy_model, save_byte_tokenizer
    model = copy_model(tiny_bytes, tmp_path_factory.mktemp("mistral") / "llama")
    save_byte_tokenizer(model, special=("[TOOL_CALLS]",))
    with running_server(model, tool_call_parser="mistral") as s:
        yield openai_client(s.url)


def test_mistral_calls_after_the_special_token_are_parsed(mistral_client):
    """Text is decoded without special tokens by default, which would drop "[TOOL_CALLS]": a Mistral
    server keeps them for tool_choice "auto". A grammar makes the model write the token itself (id 2)."""
    forced = 'start: "Wait." <[2]> "[{\\"name\\": \\"now\\", \\"arguments\\": {}}]"'
    for stream in (False, True):
        out = mistral_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60,
                                                     temperature=0, stream=stream,
                                                     extra_body={"guided_grammar": forced})
        if stream:
            deltas = [c.choices[0] for c in out if c.choices]
            content = "".join(d.delta.content or "" for d in deltas)
            calls, reason = [t for d in deltas for t in (d.delta.tool_calls or [])], deltas[-1].finish_reason
        else:
            message, reason = out.choices[0].message, out.choices[0].finish_reason
            content, calls = message.content, message.tool_calls
        assert content == "Wait." and [c.function.name for c in calls] == ["now"] and reason == "tool_calls"
        assert json.loads(calls[0].function.arguments) == {} and len(calls[0].id) == 9
    plain = mistral_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0,
                                                   extra_body={"guided_grammar": forced})
    # without tools, special tokens are skipped as by default
    assert plain.choices[0].message.content == 'Wait.[{"name": "now", "arguments": {}}]'



def test_a_conversation_with_calls_and_results_reaches_the_template(server):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    # arguments handed over as an object (as templates write them), not as a string in a string
    assert '<call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</call>' in text
    assert "<tool>21</s>" in text


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS}, "--tool-call-parser"),   # "auto" by default: this server has no parser
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rain"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
], ids=["auto without a parser", "unknown function", "no tools", "no name", "with response_format"])
def test_bad_tool_requests_are_400s(server, body, param):
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") or param in error["message"]


def test_offline_chat_shows_the_tools_to_the_template(tiny_bytes):
    llm = LLM(str(tiny_bytes), max_model_len=512)
    out = llm.chat(ASK, SamplingParams(max_tokens=120, temperature=0.0, structured_outputs={"json": SCHEMA}),
                   tools=TOOLS)[0]
    assert out.prompt.startswith('<tools>[{"type": "function", "function": {"name": "get_weather"')
    check(json.loads(out.outputs[0].text))


def test_chat_template_kwargs_reach_the_template(server, client):
    def prompt_tokens(**extra) -> int:
        out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1, extra_body=extra)
        return out.usage.prompt_tokens
    assert prompt_tokens(chat_template_kwargs={"greeting": "hello hello"}) > prompt_tokens()
    bad = httpx.post(server.url + "/v1/chat/completions",
                     json={"messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.status_code == 400 and "may not set add_generation_prompt" in bad.json()["error"]["message"]


def test_thinking_comes_back_as_reasoning_content_before_the_answer_and_its_calls(hermes_client):
    forced = '<think>hmm</think>OK<tool_call>\\{"name": "now", "arguments": \\{\\}\\}</tool_call>'
    whole = hermes_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60,
                                                  temperature=0, extra_body={"guided_regex": forced})
    message = whole.choices[0].message
    assert message.reasoning_content == "hmm" and message.content == "OK"
    assert [c.function.name for c in message.tool_calls] == ["now"]
    stream = hermes_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60,
                                                   temperature=0, stream=True, extra_body={"guided_regex": forced})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "hmm"
    assert "".join(d.content or "" for d in deltas) == "OK"
    assert [t.function.name for d in deltas for t in (d.tool_calls or [])] == ["now"]
    plain = hermes_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=20, temperature=0,
                                                  extra_body={"guided_regex": "Paris"})
    assert plain.choices[0].message.content == "Paris" and plain.choices[0].message.reasoning_content is None


def test_a_structured_output_under_a_reasoning_parser_is_the_answer(tiny_bytes):
    """deepseek_r1 takes text with no </think> as thinking; a grammar-held output never has one,
    so it is all answer (it used to come back as reasoning_content, content empty)."""
    with running_server(tiny_bytes, reasoning_parser="deepseek_r1") as s:
        client = openai_client(s.url)
        fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
        out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=120, temperature=0,
                                             response_format=fmt)
        check(json.loads(out.choices[0].message.content))
        assert getattr(out.choices[0].message, "reasoning_content", None) is None
        stream = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=120, temperature=0,
                                                response_format=fmt, stream=True)
        deltas = [c.choices[0].delta for c in stream if c.choices]
        assert "".join(d.content or "" for d in deltas) == out.choices[0].message.content
        assert not any(getattr(d, "reasoning_content", None) for d in deltas)


def test_allowed_tokens_that_bad_words_all_ban_are_refused(tiny_bytes):
    from transformers import AutoTokenizer
    yes = AutoTokenizer.from_pretrained(str(tiny_bytes)).encode("yes", add_special_tokens=False)
    llm = LLM(str(tiny_bytes), max_model_len=512)
    with pytest.raises(ValueError, match="bad_words bans"):
        llm.generate(["hi"], SamplingParams(allowed_token_ids=yes, bad_words=["yes"]), use_tqdm=False)


# ---- keys the schema never declared --------------------------------------------------------------

PARIS = {"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"]}
MORE_KEYS = {"13": 100, "262": 100}  # "," and '",' (tiny_bytes' ids): the model goes on to another key if it may


def chat_text(client, stream: bool, **kwargs) -> tuple[str, list]:
    """(content, [(name, arguments)]) of a chat completion, whole or streamed."""
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, temperature=0,
                                         logit_bias=MORE_KEYS, stream=stream, **kwargs)
    if not stream:
        message = out.choices[0].message
        return message.content or "", [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    deltas = [c.choices[0].delta for c in out if c.choices]
    calls = {}
    for t in (t for d in deltas for t in (d.tool_calls or [])):
        name, arguments = calls.get(t.index, ("", ""))
        calls[t.index] = (name + (t.function.name or ""), arguments + (t.function.arguments or ""))
    return "".join(d.content or "" for d in deltas), [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_formats_and_forced_tool_calls_write_no_key_the_schema_never_declared(client, stream):
    """A logit bias toward "," makes the model add a key wherever the grammar lets it."""
    paris = {"type": "function", "function": {"name": "get_weather", "parameters": PARIS}}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": PARIS}}
    assert chat_text(client, stream, response_format=fmt) == ('{"city": "Paris"}', [])
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat_text(client, stream, tools=[paris], tool_choice=named) == ("", [("get_weather", '{"city": "Paris"}')])
    assert chat_text(client, stream, tools=[paris], tool_choice="required", parallel_tool_calls=False) == (
        "", [("get_weather", '{"city": "Paris"}')])
    content, calls = chat_text(client, stream, extra_body={  # JSON Schema's default, asked for
        "structured_outputs": {"json": PARIS, "disable_additional_properties": False}})
    assert content.startswith('{"city": "Paris", "') and calls == []
