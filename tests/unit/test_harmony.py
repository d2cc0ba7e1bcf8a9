"""gpt-oss's harmony outputs split into reasoning, content and tool calls: whole, and streamed at
every cut of the text, the streamed pieces adding up to the whole split (pieces are only ever
appended, so a piece of a marker sent early would stay in the sum)."""

from __future__ import annotations

import json

import pytest

from tokenmill.server.harmony import HarmonyCall, HarmonyOutput, HarmonyStream, finish_reason, parse_harmony
from tokenmill.server.tools import HARMONY, ToolPlan

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]

# outputs as gpt-oss writes them after the template's "<|start|>assistant" (its <|return|> and
# <|call|> are stop tokens, so the text ends before them)
ANSWER = ("<|channel|>analysis<|message|>User asks capital of France. Easy.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>The capital of France is **Paris**.")
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}')
CALL_RECIPIENT_FIRST = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
                        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                        '{"city": "Paris"}')
FINAL_ONLY = "<|channel|>final<|message|>Hi! <b>ok</b> a < b, and <|x|> is text."
CUT_SHORT = "<|channel|>analysis<|message|>Let me think about <|"    # max_tokens inside a message
PREAMBLE = ("<|channel|>analysis<|message|>Two steps.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Checking the weather now.<|end|>"
            "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}")


@pytest.mark.parametrize("text, want", [
    (ANSWER, HarmonyOutput("User asks capital of France. Easy.", "The capital of France is **Paris**.")),
    (CALL, HarmonyOutput("Need the weather tool.", "", [HarmonyCall("get_weather", '{"city":"Paris"}')])),
    (CALL_RECIPIENT_FIRST, HarmonyOutput("Need the weather tool.", "", [HarmonyCall("get_weather",
                                                                                     '{"city": "Paris"}')])),
    (FINAL_ONLY, HarmonyOutput("", "Hi! <b>ok</b> a < b, and <|x|> is text.")),
    (CUT_SHORT, HarmonyOutput("Let me think about <|")),
    (PREAMBLE, HarmonyOutput("Two steps.", "Checking the weather now.", [HarmonyCall("now", "{}")])),
    # the first message opens with its recipient, as when the template's prompt ends in "<|start|>assistant"
    (' to=functions.now<|channel|>commentary json<|message|>{"a": 1}<|call|>',
     HarmonyOutput("", "", [HarmonyCall("now", '{"a": 1}')])),
    # two analysis messages (a built-in tool's call between them is thinking too), joined by a newline
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis to=python<|message|>1+1<|call|>"
     "<|start|>assistant<|channel|>analysis<|message|>b<|end|><|start|>assistant<|channel|>final<|message|>2<|return|>",
     HarmonyOutput("a\n1+1\nb", "2")),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan", HarmonyOutput("a")),   # a header cut short
    ("<|channel|>analys", HarmonyOutput()),
    ('{"city": "Paris"}', HarmonyOutput("", '{"city": "Paris"}')),   # no header (a structured output): content
    ("", HarmonyOutput()),
])
def test_whole_outputs_split(text, want):
    assert parse_harmony(text) == want


def streamed(text: str, step: int) -> tuple[str, str, list[dict], int]:
    """(reasoning, content, calls as OpenAI's deltas build them, deltas) of `text` fed in cuts of `step`."""
    stream, reasoning, content, calls, deltas = HarmonyStream(), "", "", [], 0
    cuts = list(range(step, len(text), step)) + [len(text)]
    for cut in cuts:
        delta = stream.delta(text[:cut], finished=cut == len(text))
        if delta is None:
            continue
        deltas += 1
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["id"].startswith("call_") and call["type"] == "function"
                calls.append({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return reasoning, content, calls, deltas


@pytest.mark.parametrize("text", [ANSWER, CALL, CALL_RECIPIENT_FIRST, FINAL_ONLY, CUT_SHORT, PREAMBLE,
                                  "plain <|channel text", " to", '{"a": 1}'])
def test_streamed_pieces_add_up_to_the_whole_split_at_every_cut(text):
    whole = parse_harmony(text)
    for step in (1, 2, 3, 7, len(text)):
        reasoning, content, calls, _ = streamed(text, step)
        assert (reasoning, content) == (whole.reasoning, whole.content), step
        assert calls == [{"name": c.name, "arguments": c.arguments} for c in whole.calls], step


def test_a_call_streams_its_arguments_as_they_come():
    """Token by token (each marker one token, as a tokenizer with harmony's special tokens gives them)."""
    pieces = ["<|channel|>", "commentary", " to", "=functions", ".get", "_weather", " ", "<|constrain|>", "json",
              "<|message|>", '{"', "city", '":"', "Paris", '"}']
    stream, text, deltas = HarmonyStream(), "", []
    for k, piece in enumerate(pieces):
        text += piece
        deltas.append(stream.delta(text, finished=k == len(pieces) - 1))
    assert deltas[:9] == [None] * 9 and deltas[9]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                                     "arguments": ""}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas[10:]] == ['{"', "city", '":"', "Paris", '"}']
    assert stream.num_calls == 1


def test_finish_reason_is_tool_calls_only_for_a_call_the_model_chose_and_finished():
    assert finish_reason(1, "stop") == "tool_calls"
    assert finish_reason(1, "length") == "length"          # arguments cut short: as OpenAI's API answers
    assert finish_reason(1, "stop", named=True) == "stop"  # a named function it was made to call
    assert finish_reason(0, "stop") == "stop"


def test_a_forced_call_is_a_grammar_of_harmonys_call_header_with_each_functions_schema():
    named = ToolPlan("named", TOOLS, name="get_weather", parser=HARMONY).constraint()
    lines = named["grammar"].split("\n")
    assert lines[:4] == ["start: analysis? call",
                         'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
                         "THOUGHT: /(.|\\n)*/", "call: call_0"]
    head, _, schema = lines[4].partition(" %json ")
    assert head == 'call_0: <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|>'
    assert json.loads(schema) == {**TOOLS[0]["function"]["parameters"], "additionalProperties": False,
                                  "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                                 "key_separator": ": "}}
    required = ToolPlan("required", TOOLS, parser=HARMONY).constraint()["grammar"].split("\n")
    assert required[3] == "call: call_0 | call_1" and required[5].startswith(
        'call_1: <|channel|> "commentary to=functions.now " <|constrain|> "json" <|message|> %json {"type": "object"')
