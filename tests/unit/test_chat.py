"""Chat rendering shared by the offline API and the server: content parts, roles, template errors."""

from __future__ import annotations

import pytest

from tokenmill.chat import content_text, render_chat


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None, **variables):
        if any(m["role"] == "bad" for m in messages):
            raise RuntimeError("template says no")
        self.seen = messages, tools, variables
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + ("|>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens):
        return [len(word) for word in text.split("|")]


def test_content_parts_are_joined_with_newlines_and_only_text_is_taken():
    assert content_text(None) == "" and content_text("hi") == "hi"
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    with pytest.raises(ValueError, match="image_url"):
        content_text([{"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(ValueError, match="must be a string"):
        content_text([{"type": "text", "text": {"not": "text"}}])
    with pytest.raises(ValueError, match="'text' must be a string, got None"):  # OpenAI's part requires its text
        content_text([{"type": "text"}])
    with pytest.raises(ValueError, match="content must be a string, null or a list of text parts, got 5"):
        content_text(5)


def test_render_chat_checks_roles_and_turns_template_errors_into_value_errors():
    out = render_chat(FakeTokenizer(), [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert out["prompt"] == "user:hi|>" and out["prompt_token_ids"] == [7, 1]
    bare = render_chat(FakeTokenizer(), [{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert bare["prompt"] == "user:x"
    with pytest.raises(ValueError, match="role"):
        render_chat(FakeTokenizer(), [{"content": "x"}])
    with pytest.raises(ValueError, match="^a conversation is a list of messages, got str 'hi'$"):
        render_chat(FakeTokenizer(), "hi")
    with pytest.raises(ValueError, match="cannot apply the chat template: template says no"):
        render_chat(FakeTokenizer(), [{"role": "bad", "content": "x"}])


def test_a_developer_message_is_the_system_message_unless_the_template_has_that_role():
    conversation = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert render_chat(FakeTokenizer(), conversation)["prompt"] == "system:Be terse.|user:hi|>"
    knows = FakeTokenizer()
    knows.chat_template = "{% if message['role'] == 'developer' %}# Instructions{% endif %}"  # as gpt-oss's does
    assert render_chat(knows, conversation)["prompt"] == "developer:Be terse.|user:hi|>"
    assert conversation[0]["role"] == "developer"  # the caller's messages are left as they were


def test_tool_calls_reach_the_template_with_object_arguments_and_the_tools_beside():
    tokenizer, tools = FakeTokenizer(), [{"type": "function", "function": {"name": "f"}}]
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "2", "type": "function", "function": {"name": "f", "arguments": "not json"}}]
    render_chat(tokenizer, [{"role": "assistant", "content": None, "tool_calls": calls},
                            {"role": "tool", "tool_call_id": "1", "content": "2"}], tools=tools)
    messages, seen_tools, _ = tokenizer.seen
    assert [c["function"]["arguments"] for c in messages[0]["tool_calls"]] == [{"x": 1}, "not json"]
    assert messages[0]["content"] == "" and messages[1]["tool_call_id"] == "1" and seen_tools == tools
    assert calls[0]["function"]["arguments"] == '{"x": 1}'  # the caller's messages are left as they were


def test_template_variables_pass_through_but_not_over_the_renderers_own():
    tokenizer = FakeTokenizer()
    render_chat(tokenizer, [{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": False})
    assert tokenizer.seen[2] == {"enable_thinking": False}
    with pytest.raises(ValueError, match="may not set tools"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], template_kwargs={"tools": []})


def test_template_variables_cannot_replace_the_template_or_its_options():
    """apply_chat_template's own parameters are not variables: a request's own template is code
    the server would run (one looping for minutes kept a server thread busy; a few, all of them)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ greeting }}"
    hi = [{"role": "user", "content": "a"}]
    assert render_chat(tokenizer, hi, template_kwargs={"greeting": "!"})["prompt"] == "a!"
    for option in ("chat_template", "tokenizer_kwargs", "return_dict", "continue_final_message", "messages"):
        with pytest.raises(ValueError, match=f"may not set {option}"):
            render_chat(tokenizer, hi, template_kwargs={option: "{% for i in range(10**9) %}{% endfor %}"})


class Phi4MiniTokenizer(FakeTokenizer):
    """Its template (the markers are what count) reads the tools from the system message."""
    chat_template = ("{% for m in messages %}{% if m['role'] == 'system' and 'tools' in m %}{{ '<|system|>' + "
                     "m['content'] + '<|tool|>' + message['tools'] + '<|/tool|><|end|>' }}{% endif %}{% endfor %}")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_phi4_minis_template_gets_the_tools_in_the_system_message_and_calls_in_the_content():
    tokenizer = Phi4MiniTokenizer()
    render_chat(tokenizer, [{"role": "user", "content": "weather?"}], tools=[WEATHER])
    assert tokenizer.seen[0] == [
        {"role": "system", "content": "You are a helpful assistant with some tools.",
         "tools": '[{"name": "get_weather", "parameters": {"type": "object"}}]'},
        {"role": "user", "content": "weather?"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    render_chat(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
                            {"role": "assistant", "content": None, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}], tools=[WEATHER])
    system, _, assistant, tool = tokenizer.seen[0]
    assert system == {"role": "system", "content": "Be brief.",
                      "tools": '[{"name": "get_weather", "parameters": {"type": "object"}}]'}
    assert assistant["content"] == '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]<|/tool_call|>'
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}
    own = {"role": "system", "content": "Hi.", "tools": "[]"}                 # tools given the Phi way stay
    render_chat(tokenizer, [own, {"role": "user", "content": "x"}], tools=[WEATHER])
    assert tokenizer.seen[0][0] == own
    render_chat(tokenizer, [{"role": "user", "content": "x"}])                  # no tools: no system message
    assert tokenizer.seen[0] == [{"role": "user", "content": "x"}]
    plain = FakeTokenizer()                                                     # other templates: as given
    render_chat(plain, [{"role": "user", "content": "x"}], tools=[WEATHER])
    assert plain.seen[:2] == ([{"role": "user", "content": "x"}], [WEATHER])
