"""POST /v1/responses (OpenAI's Responses API) over real HTTP on 127.0.0.1 with the official openai
client, on a tiny random model with a byte-level tokenizer (its JSON and its function calls are the
grammar's doing): each answer equals the chat endpoint's for the same conversation, and the
Responses API's own parts (instructions, items, incomplete outputs, stored conversations, function
call round trips, typed stream events, errors) are checked on their own."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from test_server import metric, openai_client, running_server
from test_structured_outputs import SCHEMA, check

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER}}]
CALL_WEATHER = {"type": "function", "name": "get_weather"}
STORE_SIZE = 4


@pytest.fixture(scope="module")
def server(tiny_bytes):
    with running_server(tiny_bytes, responses_store_size=STORE_SIZE) as s:
        yield s


@pytest.fixture
def client(server):
    return openai_client(server.url)


def chat(client, messages: list[dict], max_tokens: int, **options):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                          **options)


def assert_same_answer(response, completion) -> None:
    """A response and a chat completion of the same conversation and settings answer the same."""
    choice = completion.choices[0]
    assert response.output_text == choice.message.content
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens)


def test_a_text_input_is_one_user_message_answered_as_chat_answers_it(client):
    response = client.responses.create(model="tiny", input="hello there", max_output_tokens=8, temperature=0,
                                       metadata={"run": "a"})
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "tiny"
    assert abs(response.created_at - time.time()) < 60 and response.metadata == {"run": "a"} and response.store
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"] and message.status == response.status
    assert_same_answer(response, chat(client, [{"role": "user", "content": "hello there"}], 8))


def test_instructions_come_first_and_message_items_are_the_conversation(client):
    items = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "you"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yes"}]},
             {"role": "user", "content": "Paris?"}]
    response = client.responses.create(model="tiny", instructions="You are terse.", input=items, max_output_tokens=8,
                                       temperature=0)
    assert response.instructions == "You are terse."
    # developer messages are system messages (chat templates know no developer role); parts join with newlines
    messages = [{"role": "system", "content": "You are terse."}, {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi\nyou"}, {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "Paris?"}]
    assert_same_answer(response, chat(client, messages, 8))


def test_max_output_tokens_cuts_a_response_short_as_incomplete(client):
    response = client.responses.create(model="tiny", input="The quick brown fox", max_output_tokens=3,
                                       text={"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA}})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.max_output_tokens == 3
    assert response.output[0].status == "incomplete" and response.output_text.startswith("{")


def test_previous_response_id_continues_the_stored_conversation_without_its_instructions(client):
    first = client.responses.create(model="tiny", instructions="Be kind.", input="hello", max_output_tokens=5,
                                    temperature=0)
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="and then?",
                                     max_output_tokens=5, temperature=0)
    assert second.previous_response_id == first.id and second.instructions is None
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "and then?"}]
    assert_same_answer(second, chat(client, messages, 5))


def test_an_unknown_unstored_or_forgotten_previous_response_is_openais_404(server, client):
    def follow(previous: str) -> httpx.Response:
        return httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2,
                                                             "previous_response_id": previous})
    answer = follow("resp_unknown")
    assert answer.status_code == 404 and answer.json() == {"error": {
        "message": "Previous response with id 'resp_unknown' not found.", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}}
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_unknown")
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=1, store=False)
    assert not unstored.store and follow(unstored.id).status_code == 404
    oldest = client.responses.create(model="tiny", input="hi", max_output_tokens=1)
    kept = client.responses.create(model="tiny", input="hi", max_output_tokens=1)
    assert follow(oldest.id).status_code == 200  # read: oldest is now more recent than kept
    # least recent first, the store ends with kept, oldest and the answer that followed oldest: two more push kept out
    for _ in range(2):
        client.responses.create(model="tiny", input="hi", max_output_tokens=1)
    assert follow(kept.id).status_code == 404 and follow(oldest.id).status_code == 200


def test_a_stored_response_is_retrieved_as_answered_and_once_deleted_is_a_404(client):
    """The openai SDK's responses.retrieve and .delete; a streamed response is kept as its
    response.completed event carried it. A deleted one cannot be continued either."""
    whole = client.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0)
    assert client.responses.retrieve(whole.id).model_dump() == whole.model_dump()
    events = list(client.responses.create(model="tiny", input="hello", max_output_tokens=3, temperature=0,
                                          stream=True))
    final = events[-1].response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    assert client.responses.delete(whole.id) is None  # (the SDK returns nothing for the deleted object)
    for gone in (lambda: client.responses.retrieve(whole.id), lambda: client.responses.delete(whole.id),
                 lambda: client.responses.create(model="tiny", input="more", max_output_tokens=1,
                                                  previous_response_id=whole.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError, match="was not stored"):
        client.responses.retrieve(unstored.id)


def test_a_json_schema_text_format_gives_json_that_follows_the_schema(client):
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    response = client.responses.create(model="tiny", input="hi", max_output_tokens=120, temperature=0,
                                       text={"format": fmt})
    check(json.loads(response.output_text))
    assert response.status == "completed" and response.text.format.type == "json_schema"
    completion = chat(client, [{"role": "user", "content": "hi"}], 120,
                      response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
    assert_same_answer(response, completion)
    anything = client.responses.create(model="tiny", input="hi", max_output_tokens=40, temperature=1.0,
                                       text={"format": {"type": "json_object"}})
    assert anything.output_text.startswith("{")


def test_a_function_call_and_its_output_make_a_round_trip(client):
    ask = {"role": "user", "content": "weather in Paris?"}
    called = client.responses.create(model="tiny", input=[ask], tools=TOOLS, tool_choice=CALL_WEATHER,
                                     max_output_tokens=60, temperature=0)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and called.output_text == ""
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("C", "F")
    assert called.tools[0].name == "get_weather" and called.tool_choice.name == "get_weather"
    # the SDK's round trip: the output items go back in the input, then the call's output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    answer = client.responses.create(model="tiny", input=[ask, *called.output, result], tools=TOOLS,
                                     tool_choice="none", max_output_tokens=6, temperature=0)
    tool_calls = [{"id": call.call_id, "type": "function",
                   "function": {"name": "get_weather", "arguments": call.arguments}}]
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": tool_calls},
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}]
    assert_same_answer(answer, chat(client, messages, 6, tools=CHAT_TOOLS, tool_choice="none"))
    # or the call's output after previous_response_id
    following = client.responses.create(model="tiny", previous_response_id=called.id, input=[result], tools=TOOLS,
                                        tool_choice="none", max_output_tokens=6, temperature=0)
    assert following.output_text == answer.output_text and following.usage.input_tokens == answer.usage.input_tokens


def test_required_tool_choice_with_one_call_at_a_time(client):
    out = client.responses.create(model="tiny", input="weather?", tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=80, temperature=1.0)
    assert [item.type for item in out.output] == ["function_call"] and out.output[0].name == "get_weather"
    assert set(json.loads(out.output[0].arguments)) == {"city", "unit"} and not out.parallel_tool_calls


def test_a_stream_sends_the_typed_events_in_order_and_its_deltas_add_up(client):
    options = dict(model="tiny", input="hello there", max_output_tokens=12, temperature=0)
    client.responses.create(**options)  # the prompt's blocks cached before both, so their usage can be equal
    whole = client.responses.create(**options)
    events = list(client.responses.create(**options, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas), "response.output_text.done", "response.content_part.done",
        "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events))) and len(deltas) > 1
    final = events[-1].response
    assert "".join(deltas) == events[-4].text == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert events[2].item.id == events[-2].item.id == final.output[0].id and events[-2].item.status == final.status
    assert final.usage == whole.usage


def test_a_streamed_function_call_sends_its_arguments_as_they_come(client):
    options = dict(model="tiny", input="weather in Paris?", tools=TOOLS, tool_choice=CALL_WEATHER,
                   max_output_tokens=60, temperature=0)
    whole = client.responses.create(**options)
    events = list(client.responses.create(**options, stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(pieces), "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert "".join(pieces) == events[-3].arguments == whole.output[0].arguments and len(pieces) > 1
    assert events[2].item.call_id == events[-1].response.output[0].call_id
    # the SDK's own stream helper rebuilds the response from the events, checking their order
    with client.responses.stream(**options) as stream:
        final = stream.get_final_response()
    assert final.output[0].arguments == whole.output[0].arguments


def test_a_dropped_stream_aborts_its_request(server):
    # a schema with a long string: the grammar keeps the model writing
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 400, "stream": True, "text": {"format": {
        "type": "json_schema", "name": "long", "schema": {"type": "object", "required": ["s"], "properties": {
            "s": {"type": "string", "minLength": 390}}}}}}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line == "event: response.output_text.delta":
                break  # leave at the first delta: the connection closes
    deadline = time.monotonic() + 10
    while metric(server.url, "tokenmill_num_requests_running") or server.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the dropped stream's request still runs"
        time.sleep(0.1)


TOOL = TOOLS[0]
BAD_REQUESTS = [
    ("unknown role", {"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ("item without its fields", {"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
    ("unknown item type", {"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
    ("image part", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ("empty input", {"input": []}, "input"),
    ("max_output_tokens 0", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("temperature", {"input": "hi", "temperature": -1}, "temperature"),
    ("top_p", {"input": "hi", "top_p": 2}, "top_p"),
    ("schema missing", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ("name missing", {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ("unknown format", {"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ("a name with a space", {"input": "hi", "tools": [{**TOOL, "name": "get weather"}], "tool_choice": "required"},
     "tools.0.function.name"),
    ("built-in tool", {"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ("unknown function named", {"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "x"}},
     "tool_choice"),
    ("auto without a parser", {"input": "hi", "tools": [TOOL]}, "tool_choice"),
    ("two constraints", {"input": "hi", "tools": [TOOL], "tool_choice": CALL_WEATHER,
                         "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ("background", {"input": "hi", "background": True}, "background"),
    ("logprobs", {"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 3}, "include"),
    ("top_logprobs", {"input": "hi", "top_logprobs": 3}, "top_logprobs"),
    ("truncation auto", {"input": "hi", "truncation": "auto"}, "truncation"),
    ("a stored conversation", {"input": "hi", "conversation": "conv_1"}, "conversation"),
    ("a stored prompt", {"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ("max_tool_calls", {"input": "hi", "max_tool_calls": 1}, "max_tool_calls"),
    ("flex tier", {"input": "hi", "service_tier": "flex"}, "service_tier"),
    ("metadata", {"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("output of no call", {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
    ("lone surrogate", b'{"input": "\\ud800"}', "input"),
]


@pytest.mark.parametrize("body, param", [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS])
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(server, client, body, param):
    answer = (httpx.post(server.url + "/v1/responses", content=body, headers={"content-type": "application/json"})
              if isinstance(body, bytes)
              else httpx.post(server.url + "/v1/responses", json={"model": "tiny", **body}))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or error["message"]), error
    assert client.responses.create(model="tiny", input="hi", max_output_tokens=2).status


LONG = "The quick brown fox jumps over the lazy dog. " * 200


@pytest.mark.parametrize("text, limit", [(LONG, None), ("hi", 100_000)], ids=["prompt", "prompt and max_output_tokens"])
def test_a_prompt_past_the_context_gets_the_chat_endpoints_error(server, text, limit):
    """The same status, type, code and first sentence (the rest names each endpoint's own fields)."""
    chat = httpx.post(server.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": text}], "max_tokens": limit}).json()["error"]
    answer = httpx.post(server.url + "/v1/responses", json={"input": text, "max_output_tokens": limit})
    error = answer.json()["error"]
    assert answer.status_code == 400 and (error["type"], error["code"]) == (chat["type"], chat["code"])
    assert error["message"].split(".")[0] == chat["message"].split(".")[0]


def test_the_openapi_schema_documents_the_endpoint(server):
    operation = httpx.get(server.url + "/openapi.json").json()["paths"]["/v1/responses"]["post"]
    assert {"200", "400", "404", "413", "500", "503"} <= set(operation["responses"])
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}


def test_a_reasoning_parser_splits_the_thinking_off_as_a_reasoning_item(tiny_bytes):
    """deepseek_r1 takes all of an output that never closes its block as thinking (a random model's)."""
    with running_server(tiny_bytes, reasoning_parser="deepseek_r1") as s:
        client = openai_client(s.url)
        options = dict(model="tiny", input="hi", max_output_tokens=5, temperature=0)
        response = client.responses.create(**options)
        answer = chat(client, [{"role": "user", "content": "hi"}], 5).choices[0].message
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == answer.reasoning_content
        assert message.type == "message" and response.output_text == "" == answer.content
        events = list(client.responses.create(**options, stream=True))
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == reasoning.content[0].text and events[-1].response.output[0].type == "reasoning"
