"""The tool-call format read from a chat template: short templates of each family, written here
with the markers their real templates hold (the real tokenizers are not downloadable here)."""

from __future__ import annotations

import logging

import pytest

from tokenmill.server.tool_detection import detect_tool_parser, template_text, tool_parser_of

QWEN = ("{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
        "Return each call as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
        "<|im_end|>{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}\n<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
        "<|im_end|>\n{% endfor %}")
LLAMA31 = ("{{- bos_token }}{%- if tools %}<|start_header_id|>user<|end_header_id|>\n\nAnswer with a function call "
           "as {\"name\": function name, \"parameters\": dictionary of arguments}.{% endif %}"
           "{%- for m in messages %}{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
           "{{ m.content | tojson }}<|eot_id|>{%- endif %}{%- endfor %}")
LLAMA31_BUILTIN = "{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name }}{%- endif %}"
MISTRAL = ("{%- for m in messages %}{%- if m.role == 'user' %}{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
           "[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]{%- elif m.tool_calls %}[TOOL_CALLS]"
           "{{ m.tool_calls | tojson }}</s>{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
           "{%- endif %}{%- endfor %}")
LLAMA4 = ("{%- for m in messages %}<|header_start|>{{ m.role }}<|header_end|>\n\n{%- if m.tool_calls %}"
          "<|python_start|>[{% for c in m.tool_calls %}{{ c.function.name }}(...){% endfor %}]<|python_end|>"
          "{%- else %}{{ m.content }}{%- endif %}<|eot|>{%- endfor %}")
LLAMA32_PYTHONIC = ("{%- if tools %}If you decide to invoke any of the function(s), you MUST put it in the format of "
                    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
                    "{% endif %}<|start_header_id|>ipython<|end_header_id|>")
PHI4_MINI = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
             "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
             "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
             "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
             "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
PHI4_MINI_VLLM = ("{%- if tools %}<|system|>If you decide to call functions:\n  * prefix function calls with "
                  "functools marker (no closing marker required)\n  * all function calls should be generated in a "
                  "single JSON list formatted as functools[{\"name\": [function name], \"arguments\": [function "
                  "arguments as JSON]}, ...]{% for t in tools %}{{ t | tojson(indent=4) }}{% endfor %}<|end|>"
                  "{% endif %}{%- for message in messages %}<|{{ message.role }}|>{%- if message.tool_calls %}"
                  "{%- for call in message.tool_calls %}{\"name\": \"{{ call.function.name }}\", \"arguments\": "
                  "{{ call.function.arguments }}}{% endfor %}{%- else %}{{ message.content }}{%- endif %}<|end|>"
                  "{%- endfor %}")
PHI35 = ("{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
         "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
         "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
         "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}")
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, parser", [
    (QWEN, "hermes"), (LLAMA31, "llama3_json"), (LLAMA31_BUILTIN, "llama3_json"), (MISTRAL, "mistral"),
    (LLAMA4, "pythonic"), (LLAMA32_PYTHONIC, "pythonic"), (PHI4_MINI, "phi4_mini_json"),
    (PHI4_MINI_VLLM, "phi4_mini_json"), (PHI35, None), (CHATML, None), ("", None),
], ids=["qwen hermes", "llama 3.1 json", "llama 3.1 builtin tools", "mistral", "llama 4", "llama 3.2 pythonic",
        "phi-4-mini", "vllm's phi-4-mini template", "phi-3.5 without tools", "chatml without tools", "no template"])
def test_each_familys_template_names_its_parser(template, parser):
    assert detect_tool_parser(template) == parser


class Tokenizer:
    def __init__(self, chat_template) -> None:
        self.chat_template = chat_template


def test_a_tokenizers_named_templates_are_all_read():
    """transformers keeps several named templates as a dict; tokenizer_config.json as a list."""
    assert detect_tool_parser(template_text(Tokenizer({"default": CHATML, "tool_use": QWEN}))) == "hermes"
    assert detect_tool_parser(template_text(Tokenizer([{"name": "default", "template": CHATML},
                                                       {"name": "tool_use", "template": MISTRAL}]))) == "mistral"
    assert template_text(Tokenizer(None)) == "" and template_text(object()) == ""


def test_the_choice_is_said_once_in_the_log_found_or_not(caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.server"):
        assert tool_parser_of(Tokenizer(QWEN)) == "hermes"
        assert tool_parser_of(Tokenizer(CHATML)) is None
    assert [r.getMessage() for r in caplog.records] == [
        "tool calls: the chat template writes hermes calls, which tool_choice 'auto' parses (--tool-call-parser "
        "overrides)",
        "tool calls: the chat template shows no tool-call format tokenmill parses; tool_choice 'auto' needs "
        "--tool-call-parser (hermes, llama3_json, mistral, phi4_mini_json, pythonic)"]
