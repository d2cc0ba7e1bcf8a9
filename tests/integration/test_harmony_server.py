"""gpt-oss served in harmony, end to end: a tiny random gpt-oss with a byte-level tokenizer that
holds harmony's markers as special tokens, and a small harmony chat template, behind the real
server on 127.0.0.1, asked with the official openai client. Random weights write no harmony by
themselves: a grammar holds the output to the text a test needs (the special tokens included),
and the server splits what comes out; a forced tool choice is the server's own grammar."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import save_byte_tokenizer, save_chat_template
from test_server import openai_client, running_server
from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig

from tokenmill.server.api import create_app

SPECIAL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

# harmony's shape (a system message with the reasoning level, the tools as a TypeScript-like
# namespace in a developer message, calls with their recipient, tool results from functions.NAME)
TEMPLATE = """{%- if reasoning_effort is not defined %}{%- set reasoning_effort = "medium" %}{%- endif -%}
<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools
namespace functions {
{%- for t in tools %}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{%- endfor %}
} // namespace functions<|end|>{%- endif %}
{%- set last = namespace(name="") %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif %}
{%- for c in m.tool_calls %}{%- set last.name = c.function.name -%}
<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>
{{- c.function.arguments | tojson }}<|call|>
{%- endfor %}
{%- elif m.role == "assistant" %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == "tool" %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>
{{- m.content | tojson }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "required": ["city"],
             "properties": {"city": {"type": "string", "maxLength": 8}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]
ANSWER = ('start: <|channel|> "analysis" <|message|> "Easy." <|end|> <|start|> "assistant" <|channel|> "final" '
          '<|message|> "It is sunny." <|return|> "never"')
CALL = ('start: <|channel|> "analysis" <|message|> "Need it." <|end|> <|start|> "assistant" <|channel|> '
        '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\": \\"Paris\\"}" '
        '<|call|> "never"')


@pytest.fixture(scope="module")
def tiny_harmony(tmp_path_factory):
    from test_gpt_oss import TINY_GPT_OSS
    path = tmp_path_factory.mktemp("tiny_harmony") / "gpt_oss"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GptOssConfig(**TINY_GPT_OSS), dtype=torch.float32).save_pretrained(str(path))
    save_byte_tokenizer(path, TINY_GPT_OSS["vocab_size"], special=SPECIAL)
    save_chat_template(path, TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tiny_harmony):
    # no flag: the architecture says harmony. float32: the random model's greedy text that the
    # tests below fit (analysis, then a call within 300 tokens); bfloat16 products write another
    with running_server(tiny_harmony, engine_options={"dtype": "float32"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def whole_and_streamed(client, **request) -> list[tuple[str | None, str | None, list[tuple[str, str]], str]]:
    """(reasoning_content, content, calls as (name, arguments), finish_reason) of the request's
    answer whole, then of its stream's deltas added up."""
    whole = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, **request)
    message = whole.choices[0].message
    answers = [(getattr(message, "reasoning_content", None), message.content,
                [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
                whole.choices[0].finish_reason)]
    deltas = [c.choices[0] for c in client.chat.completions.create(model="tiny", messages=ASK, temperature=0,
                                                                    stream=True, **request) if c.choices]
    calls: list[list[str]] = []
    for d in deltas:
        for t in d.delta.tool_calls or []:
            if t.index == len(calls):
                assert t.id.startswith("call_")
                calls.append([t.function.name, t.function.arguments or ""])
            else:
                calls[t.index][1] += t.function.arguments or ""
    answers.append(("".join(getattr(d.delta, "reasoning_content", None) or "" for d in deltas) or None,
                    "".join(d.delta.content or "" for d in deltas), [tuple(c) for c in calls],
                    deltas[-1].finish_reason))
    return answers


def test_reasoning_and_answer_are_split_and_return_ends_the_turn(server, client):
    """<|return|> is a stop token: the grammar's "never" after it is never written."""
    assert server.app.state.tool_call_parser == "harmony"  # from the architecture, with no flag
    whole, streamed = whole_and_streamed(client, max_tokens=60, extra_body={"guided_grammar": ANSWER})
    assert whole == ("Easy.", "It is sunny.", [], "stop")
    assert streamed == ("Easy.", "It is sunny.", [], "stop")


def test_a_call_on_the_commentary_channel_is_a_tool_call_and_call_ends_the_turn(client):
    whole, streamed = whole_and_streamed(client, tools=TOOLS, max_tokens=200, extra_body={"guided_grammar": CALL})
    assert whole == ("Need it.", None, [("get_weather", '{"city": "Paris"}')], "tool_calls")
    assert streamed == ("Need it.", "", [("get_weather", '{"city": "Paris"}')], "tool_calls")


def test_an_answer_cut_short_by_max_tokens_is_the_reasoning_so_far(client, tiny_harmony):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_harmony))
    header = len(tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False))
    whole, streamed = whole_and_streamed(client, max_tokens=header + 2, extra_body={"guided_grammar": ANSWER})
    reasoning = tokenizer.decode(tokenizer.encode("Easy.", add_special_tokens=False)[:2])  # (its first 2 tokens)
    assert reasoning and reasoning != "Easy."
    assert whole == (reasoning, "", [], "length") and streamed == (reasoning, "", [], "length")


@pytest.mark.parametrize("choice, finish", [({"type": "function", "function": {"name": "get_weather"}}, "stop"),
                                            ("required", "tool_calls")])
def test_a_forced_tool_choice_is_a_harmony_call_to_a_tool(client, tiny_harmony, choice, finish):
    """The server's grammar: maybe some analysis (<|end|> favoured, so it ends at once), then one
    call in harmony's header, its arguments held to the function's schema."""
    end = AutoTokenizer.from_pretrained(str(tiny_harmony)).convert_tokens_to_ids("<|end|>")
    for whole_or_streamed in whole_and_streamed(client, tools=TOOLS, tool_choice=choice, max_tokens=200,
                                                logit_bias={str(end): 100}):
        reasoning, content, calls, reason = whole_or_streamed
        assert reasoning in (None, "") and not content and reason == finish and len(calls) == 1
        name, arguments = calls[0]
        assert name == "get_weather" or (choice == "required" and name == "now")
        value = json.loads(arguments)
        assert set(value) == ({"city"} if name == "get_weather" else set())
        assert isinstance(value.get("city", ""), str) and len(value.get("city", "")) <= 8


def test_the_template_gets_the_tools_the_reasoning_effort_and_earlier_calls_and_thinking(client, server,
                                                                                          tiny_harmony):
    """The prompt has transformers' apply_chat_template's tokens for the same conversation, the
    calls' arguments as objects and the assistant's reasoning_content as its thinking; /tokenize
    renders the same request to the same tokens."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_harmony))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "reasoning_content": "Need it.", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    for effort in ("low", "high"):
        out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=1,
                                             reasoning_effort=effort)
        oracle = [*ASK, {"role": "assistant", "thinking": "Need it.", "tool_calls": [
                      {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[2]]
        text = tokenizer.apply_chat_template(oracle, tools=TOOLS, reasoning_effort=effort, tokenize=False,
                                             add_generation_prompt=True)
        assert f"Reasoning: {effort}<|end|>" in text and "type get_weather = (_: {" in text
        assert ('analysis<|message|>Need it.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary '
                'json<|message|>{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant') in text
        assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
        counted = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS,
                                                              "reasoning_effort": effort}).json()["tokens"]
        assert counted == tokenizer.encode(text, add_special_tokens=False)


def test_a_bad_reasoning_effort_is_a_400_naming_it(server):
    response = httpx.post(server.url + "/v1/chat/completions",
                          json={"messages": ASK, "max_tokens": 1, "reasoning_effort": "max"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"


def test_harmony_with_another_tool_call_parser_is_refused():
    with pytest.raises(ValueError, match="harmony carries its own tool calls"):
        create_app(None, "tiny", tool_call_parser="hermes", reasoning_parser="harmony")


def test_the_responses_api_gives_the_reasoning_item_and_the_call_chat_gives(client):
    """A required call, greedy, long enough for the random model to write some analysis first: its
    reasoning item and function call (whole, and the stream's deltas added up) are chat's answer."""
    answer = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=300, temperature=0)
    message = answer.choices[0].message
    assert message.reasoning_content and answer.choices[0].finish_reason == "tool_calls"
    options = dict(model="tiny", input=ASK[0]["content"], tools=[{"type": "function", **t["function"]} for t in TOOLS],
                   tool_choice="required", max_output_tokens=300, temperature=0)
    response = client.responses.create(**options)
    reasoning, call = response.output
    assert response.status == "completed" and reasoning.content[0].text == message.reasoning_content
    assert (call.type, call.name, call.arguments) == ("function_call", message.tool_calls[0].function.name,
                                                      message.tool_calls[0].function.arguments)
    events = list(client.responses.create(**options, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "function_call"]
    assert (thought, arguments) == (reasoning.content[0].text, call.arguments)
    assert events[-1].type == "response.completed" and events[-1].response.output[1].name == call.name


def test_reasoning_effort_in_the_responses_api_reaches_the_template(client, tiny_harmony):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_harmony))
    for effort in ("low", "high"):
        response = client.responses.create(model="tiny", input="hi", max_output_tokens=1, reasoning={"effort": effort})
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], reasoning_effort=effort,
                                             tokenize=False, add_generation_prompt=True)
        assert response.usage.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))
        assert response.reasoning.effort == effort
