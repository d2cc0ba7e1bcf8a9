"""Tool calling's pieces without a model: plans from tools and tool_choice, the calls'
constraints, the parsers of each model format, and the streamed deltas."""

from __future__ import annotations

import json

import pytest

from tokenmill.server.tools import ToolStream, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
HERMES_TEXT = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name": "now", "arguments": {}}</tool_call>')


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


@pytest.mark.parametrize("tools, choice, parser, message", [
    (None, "required", None, "tool_choice needs tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "'nope', which is not among"),
    ([WEATHER], {"type": "function", "function": "get_weather"}, None, "None, which is not among"),
    ([WEATHER], "sometimes", "hermes", "tool_choice must be"),
    ([WEATHER], None, None, "start the server with --tool-call-parser"),
    ([{"type": "function", "function": {"parameters": {}}}], "required", None, "tools must be functions"),
    ([{"type": "retrieval"}], "required", None, "tools must be functions"),
    ([{"type": "function", "function": {"name": "get weather"}}], "required", None,
     "tools.0.function.name must be 1 to 64 letters, digits, underscores or dashes, got 'get weather'"),
    ([{"type": "function", "function": {"name": "f" * 65}}], "required", None, "tools.0.function.name must be"),
    ([WEATHER, WEATHER], "required", None, "tools.1.function.name 'get_weather' names an earlier tool too"),
])
def test_plans_refuse_what_cannot_be_served(tools, choice, parser, message):
    with pytest.raises(ValueError, match=message):
        plan_tools(tools, choice, parser)


def test_a_parameters_schema_nested_past_the_limit_is_refused_naming_the_tool():
    from tokenmill.sampling_params import MAX_SCHEMA_DEPTH

    def tool(levels: int) -> dict:
        """A function whose parameters nest `levels` objects deep: 2 * levels - 1 of JSON (a
        schema and its properties each)."""
        schema = {"type": "object"}
        for _ in range(levels - 1):
            schema = {"type": "object", "properties": {"a": schema}}
        return {"type": "function", "function": {"name": "deep", "parameters": schema}}
    fits = (MAX_SCHEMA_DEPTH + 1) // 2
    assert plan_tools([tool(fits)], "auto", "hermes").choice == "auto"
    with pytest.raises(ValueError, match=f"tools.1.function.parameters nests objects and arrays deeper than "
                                         f"{MAX_SCHEMA_DEPTH} levels"):
        plan_tools([WEATHER, tool(fits + 1)], "auto", "hermes")
    with pytest.raises(ValueError, match="nests objects and arrays deeper"):  # a thousand deep: refused, not compiled
        plan_tools([tool(1000)], "required", None)


@pytest.mark.parametrize("parser, text", [
    ("hermes", "<tool_call>" + "[" * 5000), ("llama3_json", "{" + '"a":' * 5000),
    ("mistral", "[TOOL_CALLS]" + "[" * 5000), ("pythonic", "[f(a=" + "[" * 5000 + "])]"),
])
def test_model_output_nested_past_jsons_limit_stays_content(parser, text):
    """A model can write brackets until max_tokens: past the decoder's recursion limit the text is
    content, not a 500."""
    assert plan_tools([WEATHER], "auto", parser).parse(text) == (text, [])
    assert plan_tools([WEATHER], "required", None).parse("[" * 5000) == ("[" * 5000, [])


def test_constraints_of_named_and_required_choices():
    named = plan_tools([WEATHER, NOW], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.constraint() == {"json": WEATHER["function"]["parameters"], "disable_additional_properties": True}
    assert calls(named.parse('{"city": "Rome"}')) == [("get_weather", {"city": "Rome"})]
    required = plan_tools([WEATHER, NOW], "required", None)
    schema = required.constraint()["json"]
    assert schema["minItems"] == 1 and [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == [
        "get_weather", "now"]
    # none given: an empty parameter list, as OpenAI reads an omitted `parameters`
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"$ref": "#/$defs/now"}
    assert schema["$defs"]["now"] == {"type": "object", "properties": {}}
    assert "maxItems" not in schema
    assert plan_tools([WEATHER, NOW], "required", None, parallel=False).constraint()["json"]["maxItems"] == 1
    text = '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert required.parse(text)[0] is None and calls(required.parse(text)) == [("now", {}), ("get_weather",
                                                                                             {"city": "Oslo"})]
    assert plan_tools([WEATHER], "auto", "hermes").constraint() is None
    assert plan_tools(None, "none", None) is None and plan_tools([WEATHER], "none", None).choice == "none"


@pytest.mark.parametrize("text, cut", [
    ('[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Os',
     [("now", "{}"), ("get_weather", '{"city": "Os')]),
    ('[{"name": "now", "parameters": {}},\n {"name": "get_weather", "parameters": ',
     [("now", "{}"), ("get_weather", "")]),
    ('[{"name": "get_weather", "par', [("get_weather", "")]),
    ('[{"name": "now", "parameters": {}}, {"name": "get_wea', [("now", "{}")]),
    ('[{"name": "now", "parameters": {}}', [("now", "{}")]),
    ('[{"na', []), ("[", []), ("", []),
])
def test_a_required_array_cut_by_max_tokens_gives_its_calls_as_far_as_they_came(text, cut):
    """Whole calls as they are, then the last one's unterminated arguments once its name is whole;
    cut before any name was whole, no call and no content: the array's syntax is no answer (it
    had come back as the message's text, and into the next turn's history). Ended by a stop
    string instead, no call is read from it (a cut call with "stop" would read as a finished
    one): the text is content."""
    required = plan_tools([WEATHER, NOW], "required", None)
    parsed = required.parse(text, cut=True)
    assert parsed[0] is None and [(c.name, c.arguments) for c in parsed[1]] == cut
    assert required.parse(text) == (text, [])


def test_hermes_and_llama3_json_outputs_parse_into_calls():
    hermes = plan_tools([WEATHER, NOW], "auto", "hermes")
    assert hermes.parse(HERMES_TEXT)[0] == "Let me look."
    assert calls(hermes.parse(HERMES_TEXT)) == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert hermes.parse("just text") == ("just text", [])
    assert hermes.parse("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    llama = plan_tools([WEATHER, NOW], "auto", "llama3_json")
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}'
    assert llama.parse(text)[0] is None and calls(llama.parse(text)) == [("get_weather", {"city": "Paris"}),
                                                                         ("now", {})]
    assert llama.parse('It is {"not": "a call"}') == ('It is {"not": "a call"}', [])


@pytest.mark.parametrize("text, content", [
    ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]',
     "Sure."),                                                                  # Mistral 7B v0.3, Nemo
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}', None),     # tokenizers v13
    ('[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now{}', None),                 # v11
    ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}', None),
])
def test_mistral_outputs_parse_into_calls_with_mistral_ids(text, content):
    mistral = plan_tools([WEATHER, NOW], "auto", "mistral")
    parsed = mistral.parse(text)
    assert parsed[0] == content and calls(parsed) == [("get_weather", {"city": "Paris"}), ("now", {})]
    # Mistral's chat templates take back only 9-character alphanumeric ids
    assert all(len(c.id) == 9 and c.id.isalnum() for c in parsed[1])
    assert mistral.keeps_special_tokens and not plan_tools([WEATHER], "auto", "hermes").keeps_special_tokens


def test_mistral_text_that_is_not_calls_stays_content():
    mistral = plan_tools([WEATHER, NOW], "auto", "mistral")
    for text in ["No tools needed.", "[TOOL_CALLS] [{\"name\": \"now\", \"argu", "[TOOL_CALLS]{\"city\": 1}",
                 "[TOOL_CALLS]now[ARGS][1, 2]", "[TOOL_CALLS]now"]:
        assert mistral.parse(text) == (text, []), text
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, "mistral")
    assert len(named.parse('{"city": "Rome"}')[1][0].id) == 9     # every call of a Mistral server
    assert named.parse('{"city": "Rome"}')[1][0].id != named.parse('{"city": "Rome"}')[1][0].id


def test_pythonic_outputs_parse_into_calls():
    pythonic = plan_tools([WEATHER, NOW], "auto", "pythonic")
    for text in ['[get_weather(city="Paris"), now()]', '<|python_start|>[get_weather(city=\'Paris\'), now()]'
                 '<|python_end|>', ' [get_weather(city="Paris"),\n now()] ']:
        assert pythonic.parse(text)[0] is None and calls(pythonic.parse(text)) == [("get_weather", {"city": "Paris"}),
                                                                                   ("now", {})], text
    nested = pythonic.parse('[f(a=[1, -2.5], b={"k": None}, c=True, d=(1, 2))]')
    assert calls(nested) == [("f", {"a": [1, -2.5], "b": {"k": None}, "c": True, "d": [1, 2]})]
    assert nested[1][0].id.startswith("call_")
    for text in ["[1] See the footnote.", "[get_weather('Paris')]", "[f(**kw)]", "[f(**{'a': 1})]",
                 "[os.system(cmd='ls')]", "[f(a=open('x'))]", "[f(a={1, 2})]", "[f(a=1e999)]", "[]", "[f(a=1)",
                 "get_weather(city='Paris')"]:
        assert pythonic.parse(text) == (text, []), text


def stream(plan, pieces: list[str]) -> tuple[list[dict], ToolStream]:
    s, text, deltas = ToolStream(plan), "", []
    for k, piece in enumerate(pieces):
        text += piece
        delta = s.delta(text, piece, k == len(pieces) - 1)
        if delta is not None:
            deltas.append(delta)
    return deltas, s


def test_streamed_deltas_add_up_to_the_whole_answer():
    hermes = plan_tools([WEATHER, NOW], "auto", "hermes")
    pieces = [HERMES_TEXT[i:i + 5] for i in range(0, len(HERMES_TEXT), 5)]
    deltas, s = stream(hermes, pieces)
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."   # no piece of "<tool_call>" leaks
    assert [c["function"]["name"] for c in deltas[-1]["tool_calls"]] == ["get_weather", "now"]
    assert s.finish_reason("stop") == "tool_calls" and s.finish_reason("length") == "length"
    deltas, s = stream(hermes, ["Hi <tool", "s are nice"])       # a tag that never came
    assert "".join(d.get("content", "") for d in deltas) == "Hi <tools are nice" and s.finish_reason("stop") == "stop"
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    deltas, s = stream(named, ['{"ci', 'ty": "Ro', 'me"}'])
    first = deltas[0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Rome"}'
    assert s.finish_reason("stop") == "stop"  # made to call: OpenAI's "stop"
    llama = plan_tools([WEATHER], "auto", "llama3_json")
    deltas, _ = stream(llama, [" Hel", "lo"])
    assert "".join(d.get("content", "") for d in deltas) == " Hello"
    deltas, _ = stream(llama, [' {"name": "get_wea', 'ther", "parameters": {"city": "X"}}'])
    assert len(deltas) == 1 and "content" not in deltas[0] and deltas[0]["tool_calls"][0]["function"]["name"] == (
        "get_weather")


def test_streamed_content_holds_back_what_may_open_mistral_or_pythonic_calls():
    mistral = plan_tools([NOW], "auto", "mistral")
    deltas, s = stream(mistral, ["One mo", "ment.[TOOL", "_CALLS]now", "[ARGS]{}"])
    assert "".join(d.get("content", "") for d in deltas) == "One moment."   # no piece of the tag leaks
    assert deltas[-1]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    assert s.finish_reason("stop") == "tool_calls"
    deltas, s = stream(mistral, ["Costs [TO", "P] dollars"])                 # a tag that never came
    assert "".join(d.get("content", "") for d in deltas) == "Costs [TOP] dollars" and s.finish_reason("stop") == "stop"
    pythonic = plan_tools([NOW], "auto", "pythonic")
    deltas, _ = stream(pythonic, ["[no", "w()]"])
    assert len(deltas) == 1 and "content" not in deltas[0] and deltas[0]["tool_calls"][0]["function"]["name"] == "now"
    deltas, _ = stream(pythonic, ["<|python", "_start|>[now()]"])
    assert len(deltas) == 1 and deltas[0]["tool_calls"][0]["function"]["name"] == "now"
    deltas, _ = stream(pythonic, ["It is", " noon."])
    assert [d.get("content") for d in deltas] == ["It is", " noon."]          # plain text streams as it comes


PHI4_CALLS = [("get_weather", {"city": "Paris"}), ("now", {})]


@pytest.mark.parametrize("text, content", [
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]'
     '<|/tool_call|>', None),                                                     # Phi-4-mini's own tokens
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]',
     None),                                                                       # its closing token left out
    ('<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "parameters": {}}'
     '<|/tool_call|>', None),                                                     # calls with no list around them
    ('<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}<|/tool_call|>\n'
     '<|tool_call|>{"name": "now", "arguments": {}}<|/tool_call|>', None),        # a block a call
    ('functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]',
     None),                                                                       # vLLM's template's prefix
    ('I will check. functools[{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
     ' {"name": "now", "arguments": {}}]\n', "I will check. "),
])
def test_phi4_mini_outputs_parse_into_calls(text, content):
    phi4 = plan_tools([WEATHER, NOW], "auto", "phi4_mini_json")
    parsed = phi4.parse(text)
    assert parsed[0] == content and calls(parsed) == PHI4_CALLS
    assert [c.arguments for c in parsed[1]] == ['{"city": "Paris"}', "{}"]
    assert all(c.id.startswith("call_") for c in parsed[1])
    assert phi4.keeps_special_tokens   # <|tool_call|> is a special token of Phi-4-mini's
    assert not plan_tools([WEATHER], "required", "phi4_mini_json").keeps_special_tokens


@pytest.mark.parametrize("text", [
    "No tools needed.", "Use functools.lru_cache here.", "functools[]", "<|tool_call|><|/tool_call|>",
    '<|tool_call|>[{"name": "now", "argu', 'functools[{"name": "now", "arguments": {}}', 'functools[{"city": "Paris"}]',
    'functools[{"name": 3, "arguments": {}}]', 'functools["now"]', '<|tool_call|>{"name": "now"}<|/tool_call|> Done.',
    'functools[{"name": "now", "arguments": {}}] and more', "<|tool_call|>" + "[" * 5000,
])
def test_phi4_mini_text_that_is_not_calls_stays_content(text):
    """Cut short, not calls, or followed by text that is not a call: all of it is content."""
    assert plan_tools([WEATHER, NOW], "auto", "phi4_mini_json").parse(text) == (text, [])


PHI4_TEXT = ('Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "now", "arguments": {}}]<|/tool_call|>')


@pytest.mark.parametrize("size", [1, 3, 7, 16, len(PHI4_TEXT)])
@pytest.mark.parametrize("text, content", [
    (PHI4_TEXT, "Checking."), (PHI4_TEXT.replace("<|tool_call|>", "functools").removesuffix("<|/tool_call|>"),
                               "Checking."),
])
def test_streamed_phi4_mini_content_stops_before_the_calls(size, text, content):
    phi4 = plan_tools([WEATHER, NOW], "auto", "phi4_mini_json")
    deltas, s = stream(phi4, [text[i:i + size] for i in range(0, len(text), size)])
    assert "".join(d.get("content", "") for d in deltas) == content   # no piece of a marker leaks
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in deltas[-1]["tool_calls"]] == (
        PHI4_CALLS)
    assert [c["index"] for c in deltas[-1]["tool_calls"]] == [0, 1] and s.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("size", [1, 4, 100])
def test_streamed_phi4_mini_text_without_calls_is_all_content(size):
    phi4 = plan_tools([WEATHER], "auto", "phi4_mini_json")
    text = "Try functools.partial or <|tool_cal in prose."
    deltas, s = stream(phi4, [text[i:i + size] for i in range(0, len(text), size)])
    assert "".join(d.get("content", "") for d in deltas) == text and s.finish_reason("stop") == "stop"
    assert all("tool_calls" not in d for d in deltas)
