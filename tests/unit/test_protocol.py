"""Request bodies (server/protocol.py, protocol_responses.py): how pydantic reads what clients send."""

import pytest
from pydantic import ValidationError

from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from tokenmill.server.protocol_responses import ResponsesRequest

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def test_null_for_a_field_whose_type_has_no_null_means_its_default():
    chat = ChatCompletionRequest.model_validate({**CHAT, "n": None, "stream": None, "logprobs": None,
                                                 "stream_options": {"include_usage": None}, "priority": None})
    assert chat.n == 1 and chat.stream is False and chat.logprobs is False and chat.priority == 0
    assert chat.stream_options.include_usage is False
    completion = CompletionRequest.model_validate({"prompt": "x", "echo": None, "n": None, "stream": None})
    assert (completion.echo, completion.n, completion.stream) == (False, 1, False)
    responses = ResponsesRequest.model_validate({"input": "hi", "store": None, "parallel_tool_calls": None,
                                                 "stream": None, "background": None})
    assert responses.store is True and responses.parallel_tool_calls is True
    assert responses.stream is False and responses.background is False


def test_null_stays_null_where_the_type_takes_it_and_is_refused_for_a_required_field():
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None  # the context
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens == 16
    assert ChatCompletionRequest.model_validate({**CHAT, "temperature": None}).temperature is None
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest.model_validate({"messages": None})
    with pytest.raises(ValidationError, match="prompt"):
        CompletionRequest.model_validate({"prompt": None})


def test_a_wrong_type_is_still_refused():
    with pytest.raises(ValidationError, match="n"):
        ChatCompletionRequest.model_validate({**CHAT, "n": "two"})
    with pytest.raises(ValidationError, match="stream"):
        ResponsesRequest.model_validate({"input": "hi", "stream": "yes"})


def test_the_schema_allows_null_exactly_where_it_means_the_default():
    props = ChatCompletionRequest.model_json_schema()["properties"]
    assert props["n"] == {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 1, "title": "N"}
    assert props["stream"]["anyOf"][1] == {"type": "null"} and props["stream"]["default"] is False
    assert "anyOf" not in props["messages"]  # required: null is still refused
    background = ResponsesRequest.model_json_schema()["properties"]["background"]
    assert background["anyOf"] == [{"type": "boolean"}, {"type": "null"}]


def test_stream_options_without_stream_and_a_request_chat_template_are_refused_naming_the_field():
    body = {**CHAT, "stream_options": {"include_usage": True}}
    with pytest.raises(ValueError, match="^stream_options is only allowed with stream=true$"):
        ChatCompletionRequest.model_validate(body).sampling_params(None, None, None)
    assert ChatCompletionRequest.model_validate({**body, "stream": True}).sampling_params(None, None, None).n == 1
    with pytest.raises(ValueError, match="^chat_template is not supported by this server$"):
        ChatCompletionRequest.model_validate({**CHAT, "chat_template": "{{ messages }}"}).sampling_params(None, None,
                                                                                                          None)
    # OpenAI's deprecated function calling: ignored, the call a client waits for would never come
    for field, value in (("functions", [{"name": "f", "parameters": {}}]), ("function_call", {"name": "f"})):
        with pytest.raises(ValueError, match=f"^{field} is not supported by this server$"):
            ChatCompletionRequest.model_validate({**CHAT, field: value}).sampling_params(None, None, None)


def test_continue_final_message_needs_add_generation_prompt_false():
    from tokenmill.server.errors import APIError
    from tokenmill.server.serving_chat import _chat_sampling_params
    with pytest.raises(APIError, match="continue_final_message needs add_generation_prompt=false") as info:
        _chat_sampling_params(ChatCompletionRequest.model_validate({**CHAT, "continue_final_message": True}))
    assert info.value.body["error"]["param"] == "continue_final_message"
    params = _chat_sampling_params(ChatCompletionRequest.model_validate(
        {**CHAT, "continue_final_message": True, "add_generation_prompt": False}))
    assert params.n == 1


def test_an_error_message_quoting_a_3_mb_value_is_cut_to_2000_characters_and_says_how_much_was_cut():
    message = error_body("bad model: " + "x" * 3_000_000)["error"]["message"]
    assert message == "bad model: " + "x" * (2000 - 11) + "... (2,998,011 more characters)"
    assert error_body("short")["error"]["message"] == "short"
