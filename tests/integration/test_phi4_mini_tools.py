"""Phi-4-mini's tool calls through the real server on a tiny model whose tokenizer has Phi-4-mini's
special tokens and chat template: the format read from the template with no flags, the tools put
in the system message where that template reads them, the model's calls parsed whether it opens
them with <|tool_call|> or functools[, and forced calls.

A random model calls no tool by itself: a grammar (vLLM's guided_grammar) makes it write a call,
special token included, and the server's parser reads it like any model's output."""

from __future__ import annotations

import json

import pytest
from test_server import openai_client, running_server

# Phi-4-mini-instruct's chat template, as its tokenizer_config.json holds it
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
SPECIAL = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>", "<|tool_call|>",
           "<|/tool_call|>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
                                                "city": {"type": "string", "maxLength": 8}}}}}  # (a random
# model's forced string ends within max_tokens)
ASK = [{"role": "user", "content": "weather in Paris?"}]
SYSTEM = {"role": "system", "content": "You are a helpful assistant with some tools.",
          "tools": json.dumps([WEATHER["function"]])}
CALL_JSON = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.fixture(scope="module")
def phi4_model(tiny_bytes, tmp_path_factory):
    from conftest import copy_model, save_byte_tokenizer, save_chat_template
    model = copy_model(tiny_bytes, tmp_path_factory.mktemp("phi4") / "llama")
    save_byte_tokenizer(model, special=SPECIAL)
    save_chat_template(model, PHI4_MINI_TEMPLATE)
    return model


@pytest.fixture(scope="module")
def tokenizer(phi4_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(phi4_model))


@pytest.fixture(scope="module")
def server(phi4_model):
    with running_server(phi4_model) as s:  # no tool-call parser given
        yield s


@pytest.fixture
def client(server):
    return openai_client(server.url)


def prompt_tokens(tokenizer, messages: list[dict]) -> int:
    """The oracle: transformers renders the conversation as Phi-4-mini's template takes it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def whole_and_streamed(client, **options) -> list[tuple[str | None, list[tuple[str, dict]], str]]:
    """(content, calls, finish_reason) of the answer, whole then streamed."""
    out = []
    for stream in (False, True):
        answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=100,
                                                temperature=0, stream=stream, **options)
        if stream:
            deltas = [c.choices[0] for c in answer if c.choices]
            content, reason = "".join(d.delta.content or "" for d in deltas), deltas[-1].finish_reason
            calls = {}   # index -> [name, arguments]: a call's arguments may come in pieces
            for t in (t for d in deltas for t in (d.delta.tool_calls or [])):
                calls.setdefault(t.index, [t.function.name, ""])[1] += t.function.arguments or ""
            calls = list(calls.values())
        else:
            message, reason = answer.choices[0].message, answer.choices[0].finish_reason
            content = message.content
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        out.append((content, [(name, json.loads(arguments)) for name, arguments in calls], reason))
    return out


def test_the_phi4_mini_format_is_read_from_the_chat_template(server):
    assert server.app.state.tool_call_parser == "phi4_mini_json"


def test_the_tools_reach_the_system_message_and_earlier_calls_the_assistants_content(client, tokenizer):
    answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=1)
    assert answer.usage.prompt_tokens == prompt_tokens(tokenizer, [SYSTEM, *ASK])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    answer = client.chat.completions.create(model="tiny", messages=conversation, tools=[WEATHER], max_tokens=1)
    assert answer.usage.prompt_tokens == prompt_tokens(tokenizer, [
        SYSTEM, *ASK, {"role": "assistant", "content": f"<|tool_call|>{CALL_JSON}<|/tool_call|>"},
        {"role": "tool", "content": "21 C"}])


def test_calls_after_phi4_minis_special_token_are_parsed(client, tokenizer):
    """Text is decoded without special tokens by default, which would drop <|tool_call|>: this
    server keeps them for tool_choice "auto"."""
    start, end = tokenizer.convert_tokens_to_ids(["<|tool_call|>", "<|/tool_call|>"])
    grammar = f'start: "Checking." <[{start}]> {json.dumps(CALL_JSON)} <[{end}]>'
    expected = ("Checking.", [("get_weather", {"city": "Paris"})], "tool_calls")
    assert whole_and_streamed(client, extra_body={"guided_grammar": grammar}) == [expected, expected]


def test_calls_after_functools_are_parsed(client):
    grammar = f'start: "functools" {json.dumps(CALL_JSON)}'
    whole, streamed = whole_and_streamed(client, extra_body={"guided_grammar": grammar})
    assert whole == (None, [("get_weather", {"city": "Paris"})], "tool_calls")
    assert streamed == ("", [("get_weather", {"city": "Paris"})], "tool_calls")


def test_text_that_is_no_call_is_content(client):
    grammar = 'start: "Use functools.partial here."'
    whole, streamed = whole_and_streamed(client, extra_body={"guided_grammar": grammar})
    assert whole == streamed == ("Use functools.partial here.", [], "stop")


@pytest.mark.parametrize("choice, reason", [({"type": "function", "function": {"name": "get_weather"}}, "stop"),
                                            ("required", "tool_calls")], ids=["named", "required"])
def test_forced_calls_come_back_as_calls(client, choice, reason):
    """A forced call is a structured output (the same for every format), read back as a call."""
    for content, calls, finish in whole_and_streamed(client, tool_choice=choice, parallel_tool_calls=False):
        assert not content and [name for name, _ in calls] == ["get_weather"] and finish == reason
        assert list(calls[0][1]) == ["city"] and len(calls[0][1]["city"]) <= 8
