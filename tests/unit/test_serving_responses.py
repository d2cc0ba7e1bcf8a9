"""The Responses API's request side: its input as chat messages, and the store of conversations."""

from __future__ import annotations

import pytest

from tokenmill.server.protocol_responses import ResponsesRequest
from tokenmill.server.serving_responses import ResponseStore, input_messages, output_message


def test_a_string_input_is_one_user_message():
    assert input_messages(ResponsesRequest(input="hi").input) == [{"role": "user", "content": "hi"}]


def test_items_become_messages_tool_calls_and_tool_messages_and_reasoning_is_dropped():
    req = ResponsesRequest(input=[
        {"role": "developer", "content": "be brief"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": "let me look"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "call_3", "name": "f", "arguments": "{}"}])
    assert input_messages(req.input) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_output_items_become_one_assistant_message():
    output = [{"type": "message", "content": [{"type": "output_text", "text": "OK"}]},
              {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}]
    assert output_message(output) == {"role": "assistant", "content": "OK", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert output_message(output[:1]) == {"role": "assistant", "content": "OK"}


def test_the_store_forgets_the_least_recently_used_first():
    store = ResponseStore(2)
    store.put("a", [{"role": "user", "content": "1"}], {"id": "a"})
    store.put("b", [], {"id": "b"})
    assert store.get("a") == [{"role": "user", "content": "1"}]  # a is now the most recent
    store.put("c", [], {"id": "c"})
    assert store.get("b") is None and store.get("a") is not None and store.get("c") == [] and len(store) == 2


def test_a_store_of_size_0_keeps_nothing_and_a_negative_size_is_refused():
    store = ResponseStore(0)
    store.put("a", [], {})
    assert store.get("a") is None and len(store) == 0
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(-1)


def test_the_store_drops_the_oldest_conversations_past_its_characters_too():
    store = ResponseStore(100, max_chars=250)
    big = [{"role": "user", "content": "x" * 80}]  # 113 characters as JSON, and 2 of the response {}: two fit
    store.put("a", big, {})
    store.put("b", big, {})
    store.put("c", big, {})
    assert store.get("a") is None and store.get("b") == big and store.get("c") == big
    store.put("d", [{"role": "user", "content": "x" * 500}], {})  # larger than the whole store
    assert store.get("d") is None and len(store) == 2


def test_a_deleted_response_is_gone_with_its_conversation_and_frees_its_characters():
    store = ResponseStore(100, max_chars=250)
    big = [{"role": "user", "content": "x" * 80}]
    store.put("a", big, {"id": "a"})
    store.put("b", big, {"id": "b"})
    assert store.response("a") == {"id": "a"} and store.delete("a") and not store.delete("a")
    assert store.get("a") is None and store.response("a") is None
    store.put("c", big, {"id": "c"})  # fits beside b without dropping it: a's characters were freed
    assert store.response("b") == {"id": "b"} and len(store) == 2
