"""The tool-call format a model writes, read from its chat template, as llama.cpp's server picks
it: so that tool_choice "auto" (every framework's default with tools) works without flags.

A template that renders a conversation's calls back to the model writes them in the format the
model was trained to produce, so the markers it holds name the parser (tools.PARSERS):

    [TOOL_CALLS]                                  mistral      (Mistral 7B v0.3, Nemo, Small)
    <tool_call>                                   hermes       (Qwen 2.5 / 3, Hermes 2 Pro / 3)
    <|python_start|>, [func_name1(params_name1=   pythonic     (Llama 4, Llama 3.2's pythonic template)
    <|tool|>, functools[                          phi4_mini_json  (Phi-4-mini / -multimodal, vLLM's template)
    <|python_tag|>, ipython turns, "parameters"   llama3_json  (Llama 3.1 / 3.2 / 3.3)

Phi-4-mini's own template renders no calls: it shows the tools to the model between <|tool|> and
<|/tool|> (a token no other family's template holds), and the model answers with <|tool_call|>.
Pythonic is tried before llama3_json: a Llama 4 template may keep Llama 3's ipython role. A
template with none of them (or no template) gives None, and tool_choice "auto" stays a 400 that
says to start the server with --tool-call-parser.
"""

from __future__ import annotations

import logging

from tokenmill.server.tools import HERMES_START, MISTRAL_START, PARSERS, PHI4_FUNCTOOLS, PYTHON_START, PYTHON_TAG

logger = logging.getLogger("tokenmill.server")

# (parser, markers): the first parser any of whose markers the template holds
TEMPLATE_MARKERS = (
    ("mistral", (MISTRAL_START,)),
    ("hermes", (HERMES_START,)),
    ("pythonic", (PYTHON_START, "[func_name1(")),
    ("phi4_mini_json", ("<|tool|>", PHI4_FUNCTOOLS)),
    ("llama3_json", (PYTHON_TAG, "ipython<|end_header_id|>", '"parameters"')),
)


def template_text(tokenizer) -> str:
    """The tokenizer's chat template as one text: a tokenizer may hold several named ones (a
    "tool_use" one beside the default), all of which the model was trained on."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    if isinstance(template, list):  # the form tokenizer_config.json stores: [{"name", "template"}]
        return "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""


def detect_tool_parser(template: str) -> str | None:
    """The tool-call parser for a model whose chat template is `template`, or None."""
    for parser, markers in TEMPLATE_MARKERS:
        if any(marker in template for marker in markers):
            return parser
    return None


def tool_parser_of(tokenizer) -> str | None:
    """The parser for the model's own tool-call format, read from its tokenizer's chat template
    and said once in the log, found or not."""
    parser = detect_tool_parser(template_text(tokenizer))
    if parser is None:
        logger.info("tool calls: the chat template shows no tool-call format tokenmill parses; tool_choice 'auto' "
                    "needs --tool-call-parser (%s)", ", ".join(PARSERS))
    else:
        logger.info("tool calls: the chat template writes %s calls, which tool_choice 'auto' parses "
                    "(--tool-call-parser overrides)", parser)
    return parser
