"""What clients nobody here wrote expect of the server, each checked with that client on a tiny
model: tool calls with no server flags (the format read from a Hermes-style chat template) and
LangChain's tool round trip; a forced call cut by max_tokens said to be cut; context-length
errors in OpenAI's form, as the openai SDK, LiteLLM and LangChain read them.

A random model calls no tool by itself: a regex (vLLM's guided_regex) makes it write a call in
the template's format, and the server's parser reads it like any model's output."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from test_server import openai_client, running_server

# A Qwen-style template, written here: tools in <tools>, calls in <tool_call> blocks, results as
# tool turns. Its <tool_call> marker is what tells the server the model writes Hermes calls.
HERMES_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>Call a tool as "
    "<tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call>{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}</s>{%- endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]
CALL = 'OK<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}</tool_call>'  # a regex
ANSWER = "It is 21 C in Paris\\."


@pytest.fixture(scope="module")
def hermes_model(tiny_bytes, tmp_path_factory):
    from conftest import copy_model, save_chat_template
    model = copy_model(tiny_bytes, tmp_path_factory.mktemp("hermes") / "llama")
    save_chat_template(model, HERMES_TEMPLATE)
    return model


@pytest.fixture(scope="module")
def server(hermes_model):
    with running_server(hermes_model) as s:  # no tool-call parser given
        yield s


@pytest.fixture
def client(server):
    return openai_client(server.url)


# ---- tools with no flags --------------------------------------------------------------------------

def test_the_tool_call_format_is_read_from_the_chat_template(server):
    assert server.app.state.tool_call_parser == "hermes"


def test_an_openai_sdk_tool_round_trip_needs_no_server_flags(client, server):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0,
                                           extra_body={"guided_regex": CALL})
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content == "OK"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    conversation = [*ASK, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21 C"}]
    second = client.chat.completions.create(model="tiny", messages=conversation, tools=[WEATHER], max_tokens=200,
                                            temperature=0, extra_body={"guided_regex": ANSWER})
    assert second.choices[0].message.content == "It is 21 C in Paris." and second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls
    # the call and its result reached the template, the arguments as an object
    tokens = httpx.post(server.url + "/tokenize", json={"messages": conversation}).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert prompt.endswith('<assistant>OK<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                           '</tool_call></s><tool>21 C</s><assistant>')


def test_tokenize_counts_messages_with_tools_as_chat_renders_them(client, server):
    """A client that counts its prompt before sending it (vLLM's /tokenize with tools, as the
    verifiers library calls it) gets the chat endpoint's count."""
    body = {"messages": ASK, "tools": [WEATHER]}
    counted = httpx.post(server.url + "/tokenize", json=body).json()["count"]
    without = httpx.post(server.url + "/tokenize", json={"messages": ASK}).json()["count"]
    out = client.chat.completions.create(model="tiny", max_tokens=1, tool_choice="none", **body)
    assert counted == out.usage.prompt_tokens > without
    bad = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": [{"x": 1}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"  # as chat refuses them


def test_langchains_tool_round_trip_needs_no_server_flags(server):
    """bind_tools sends tool_choice "auto" (by leaving it out); the AIMessage's tool_calls and a
    ToolMessage go back, and the model answers."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"21 C in {city}"

    def chat(regex: str):
        return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny", temperature=0,
                                           max_tokens=200, max_retries=0, extra_body={"guided_regex": regex})
    conversation = [HumanMessage("weather in Paris?")]
    call = chat(CALL).bind_tools([get_weather]).invoke(conversation)
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather", {"city": "Paris"})]
    conversation += [call, get_weather.invoke(call.tool_calls[0])]
    answer = chat(ANSWER).bind_tools([get_weather]).invoke(conversation)
    assert answer.content == "It is 21 C in Paris." and answer.tool_calls == []


def cut_answer(client, choice, max_tokens: int, stream: bool, **options) -> tuple[list[tuple[str, str]], str, str]:
    """A forced call's answer at temperature 0: its calls' (name, arguments), content and finish reason."""
    out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=choice,
                                         max_tokens=max_tokens, temperature=0, stream=stream, **options)
    if not stream:
        message = out.choices[0].message
        calls = [(t.function.name, t.function.arguments) for t in message.tool_calls or []]
        return calls, message.content or "", out.choices[0].finish_reason
    choices = [c.choices[0] for c in out if c.choices]
    calls: dict[int, list[str]] = {}
    for t in (t for c in choices for t in c.delta.tool_calls or []):
        name, arguments = calls.setdefault(t.index, ["", ""])
        calls[t.index] = [name + (t.function.name or ""), arguments + (t.function.arguments or "")]
    return [tuple(calls[k]) for k in sorted(calls)], "".join(c.delta.content or "" for c in choices), (
        choices[-1].finish_reason)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_cut_by_max_tokens_ends_with_length(client, stream):
    """The call comes as far as it came, its arguments unterminated JSON, and "length" tells the
    client it is incomplete: a named function's, and a "required" array's (never the array's JSON
    as content). The cut is placed by the uncut answer's tokens: one past where the arguments open."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=named,
                                           max_tokens=3, temperature=0, logprobs=True)
    three = "".join(t.token for t in whole.choices[0].logprobs.content)
    assert cut_answer(client, named, 3, stream) == ([("get_weather", three)], "", "length")
    with pytest.raises(json.JSONDecodeError):
        json.loads(three)
    whole = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=200, temperature=0, logprobs=True)
    tokens = [t.token for t in whole.choices[0].logprobs.content]
    texts = ["".join(tokens[:k]) for k in range(len(tokens) + 1)]
    opened = next(k for k, text in enumerate(texts) if re.search(r'"parameters"\s*:\s*\{', text))
    arguments = texts[opened + 1][re.search(r'"parameters"\s*:\s*', texts[opened]).end():]
    assert cut_answer(client, "required", opened + 1, stream) == ([("get_weather", arguments)], "", "length")
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_call_ended_by_a_stop_string_is_no_call(client, stream):
    """Only max_tokens makes a cut array calls: a stop string ends the text, which stays content
    (a cut call under "stop" would read as a finished one)."""
    calls, content, reason = cut_answer(client, "required", 200, stream, stop=['"parameters"'])
    assert (calls, reason) == ([], "stop") and content.startswith('[{"name"') and '"parameters"' not in content


# ---- context length as OpenAI answers it ----------------------------------------------------------

LONG = "hello " * 1100   # past the tiny model's 1024 tokens


def context_error(client, endpoint: str, text: str, max_tokens: int | None, stream: bool = False):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                           max_tokens=max_tokens, stream=stream)
        else:
            client.completions.create(model="tiny", prompt=text, max_tokens=max_tokens, stream=stream)
    return caught.value


def prompt_tokens(server, endpoint: str, text: str) -> int:
    body = {"messages": [{"role": "user", "content": text}]} if endpoint == "chat" else {"prompt": text}
    return httpx.post(server.url + "/tokenize", json=body).json()["count"]


@pytest.mark.parametrize("endpoint, input_name", [("chat", "messages"), ("completions", "prompt")])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prompt_past_the_context_is_context_length_exceeded(client, server, endpoint, input_name, stream):
    """OpenAI's code and the opening words clients match on, for a prompt that leaves no room and
    for one whose max_tokens would run past the context; a stream is refused before it opens."""
    limit, n = server.engine.max_model_len, prompt_tokens(server, endpoint, LONG)
    too_long = context_error(client, endpoint, LONG, 10, stream)
    assert (too_long.status_code, too_long.code, too_long.param, too_long.type) == (
        400, "context_length_exceeded", input_name, "invalid_request_error")
    assert too_long.body["message"] == (
        f"This model's maximum context length is {limit} tokens. However, your {input_name} resulted in {n} tokens: "
        f"the prompt is too long, with no room for output. Please reduce the length of the {input_name}.")
    n = prompt_tokens(server, endpoint, "hello")
    with_output = context_error(client, endpoint, "hello", 100_000, stream)
    assert (with_output.status_code, with_output.code, with_output.param) == (400, "context_length_exceeded",
                                                                              input_name)
    assert with_output.body["message"] == (
        f"This model's maximum context length is {limit} tokens. However, you requested {n + 100_000} tokens ({n} in "
        f"the {input_name}, 100000 in the completion): the prompt is too long for that completion. Please reduce the "
        f"length of the {input_name} or the completion's maximum tokens.")


def test_litellm_raises_its_context_window_error(server, monkeypatch):
    """LiteLLM maps the message to ContextWindowExceededError, which its fallbacks and trimming catch."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    litellm = pytest.importorskip("litellm")
    for max_tokens, content in ((100_000, "hello"), (10, LONG)):
        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(model="openai/tiny", api_base=server.url + "/v1", api_key="unused", max_retries=0,
                               messages=[{"role": "user", "content": content}], max_tokens=max_tokens)


def test_langchain_sees_a_context_overflow(server):
    """ContextOverflowError, which LangChain's summarising and trimming middleware catch."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.exceptions import ContextOverflowError
    for max_tokens, content in ((100_000, "hello"), (10, LONG)):
        chat = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny",
                                           max_tokens=max_tokens, max_retries=0)
        with pytest.raises(ContextOverflowError):
            chat.invoke(content)
