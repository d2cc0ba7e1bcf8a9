"""The Responses API's output items and stream events, from hand-made request outputs (no model)."""

from __future__ import annotations

import json

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol_responses import ResponsesRequest
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.responses_output import ResponseEvents, ResponseHead, output_items
from tokenmill.server.tools import ToolPlan

TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'


def outputs(texts: list[str], finish_reason: str = "stop") -> list[RequestOutput]:
    """The outputs of a request whose text grows through `texts`, one token each."""
    result, before = [], ""
    for k, text in enumerate(texts):
        last = k == len(texts) - 1
        result.append(RequestOutput("resp_x-0-0", None, [5, 6, 7], [CompletionOutput(
            0, text, list(range(k + 1)), finish_reason if last else None)], last, new_text=text[len(before):]))
        before = text
    return result


def stream(plan: ToolPlan | None, texts: list[str], finish_reason: str = "stop") -> list[dict]:
    head = ResponseHead.of(ResponsesRequest(input="hi"), SamplingParams(), "resp_x", "tiny")
    events = ResponseEvents(head, plan)
    sent = events.start() + [e for out in outputs(texts, finish_reason) for e in events.step(out)]
    parsed = []
    for event in sent:
        kind, data = event.removesuffix("\n\n").split("\n")
        parsed.append(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {parsed[-1]['type']}"
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    return parsed


def test_text_streams_as_one_message_item_and_ends_completed():
    events = stream(None, ["a", "a b", "a b c"])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["a", " b", " c"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 6}
    [message] = final["output"]
    assert message["content"] == [{"type": "output_text", "text": "a b c", "annotations": [], "logprobs": []}]
    assert events[2]["item"]["status"] == "in_progress" and events[2]["item"]["content"] == []
    assert events[-2]["item"] == message and message["status"] == "completed"


def test_a_response_cut_at_max_output_tokens_ends_incomplete():
    events = stream(None, ["a", "a b"], finish_reason="length")
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_content_then_parsed_calls_close_the_message_before_the_first_call():
    plan = ToolPlan("auto", TOOLS, parser="hermes")
    events = stream(plan, ["OK", "OK<tool_c", "OK" + CALL])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    message, call = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == "OK" and call["name"] == "now" and call["arguments"] == "{}"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]
    assert events[8]["item"]["call_id"] == call["call_id"] and call["call_id"].startswith("call_")


def test_a_named_function_streams_its_arguments_without_a_message():
    plan = ToolPlan("named", TOOLS, name="now")
    events = stream(plan, ['{"a"', '{"a": 1}'])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[-3]["arguments"] == '{"a": 1}' and [item["type"] for item in events[-1]["response"]["output"]] == [
        "function_call"]


def test_an_auto_plan_that_writes_nothing_answers_an_empty_message():
    events = stream(ToolPlan("auto", TOOLS, parser="hermes"), [""])
    assert [item["content"][0]["text"] for item in events[-1]["response"]["output"]] == [""]
    plan = ToolPlan("auto", TOOLS, parser="hermes")
    assert [item["content"][0]["text"] for item in output_items(plan, "", "completed")] == [""]


def test_whole_outputs_have_the_streams_items():
    plan = ToolPlan("auto", TOOLS, parser="hermes")
    items = output_items(plan, "OK" + CALL, "completed")
    assert [item["type"] for item in items] == ["message", "function_call"]
    assert items[0]["content"][0]["text"] == "OK" and (items[1]["name"], items[1]["arguments"]) == ("now", "{}")
    assert [item["type"] for item in output_items(plan, CALL, "completed")] == ["function_call"]


def test_a_failed_request_ends_the_stream_with_response_failed():
    head = ResponseHead.of(ResponsesRequest(input="hi"), SamplingParams(), "resp_x", "tiny")
    events = ResponseEvents(head, None)
    events.start()
    out = outputs(["a"])[0]
    out.error = "the step failed"
    failed = json.loads(events.step(out)[-1].split("data: ", 1)[1])
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the step failed"}
    assert events.final is None


def test_thinking_streams_as_a_reasoning_item_before_the_message():
    head = ResponseHead.of(ResponsesRequest(input="hi"), SamplingParams(), "resp_x", "tiny")
    events = ResponseEvents(head, None, ReasoningParser("qwen3"))
    sent = events.start() + [e for out in outputs(["<think>", "<think>hm", "<think>hm</thi", "<think>hm</think>ok"])
                             for e in events.step(out)]
    parsed = [json.loads(event.split("data: ", 1)[1]) for event in sent]
    assert [e["type"] for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    reasoning, message = parsed[-1]["response"]["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert message["content"][0]["text"] == "ok" and parsed[3]["part"] == {"type": "reasoning_text", "text": ""}
    whole = output_items(None, "<think>hm</think>ok", "completed", ReasoningParser("qwen3"))
    assert [(item["type"], item["content"]) for item in whole] == [(item["type"], item["content"])
                                                                   for item in (reasoning, message)]


def test_a_response_that_only_thinks_ends_with_an_empty_message():
    head = ResponseHead.of(ResponsesRequest(input="hi"), SamplingParams(), "resp_x", "tiny")
    events = ResponseEvents(head, None, ReasoningParser("deepseek_r1"))
    sent = events.start() + [e for out in outputs(["hm", "hm more"], "length") for e in events.step(out)]
    final = json.loads(sent[-1].split("data: ", 1)[1])["response"]
    assert [(item["type"], item["content"][0]["text"]) for item in final["output"]] == [
        ("reasoning", "hm more"), ("message", "")]
    assert [item["type"] for item in output_items(None, "hm more", "incomplete", ReasoningParser("deepseek_r1"))] == [
        "reasoning", "message"]
