"""Tool calling in the chat endpoint: OpenAI's `tools` and `tool_choice`, as vLLM serves them.

The tools go to the chat template; `tool_choice` decides how calls come out:
  a named function  the output is constrained (a structured output) to that function's
                    parameters schema, and is its arguments
  "required"        the output is constrained to a JSON array of {"name", "parameters"} calls,
                    at least one, each naming one of the tools
  "auto"            the model decides, and its text is parsed for calls in its own format:
                    the server's tool-call parser, "hermes" (<tool_call>{...}</tool_call> blocks:
                    Qwen 2.5 / 3, Hermes) or "llama3_json" (Llama 3.1+: the message is a JSON call)
  "none"            no calls are made
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tokenmill.server.reasoning import partial_tag

PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str                      # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class ToolPlan:
    choice: str                         # "none", "auto", "required" or "named"
    tools: list[dict]                   # as the request gave them (for the chat template)
    name: str | None = None             # the named function
    parser: str | None = None           # for "auto"
    parallel: bool = True               # parallel_tool_calls: false makes "required" one call

    def constraint(self) -> dict | None:
        """The structured output that makes the calls (StructuredOutputsParams fields), if any."""
        functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.choice == "named":
            return {"json": functions[self.name]}
        if self.choice == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"const": name}, "parameters": schema}}
                     for name, schema in functions.items()]
            return {"json": {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                             "items": {"anyOf": calls}}}
        return None

    def content_end(self, text: str) -> int:
        """How much of a partial output is surely content, not the start of a call (streaming)."""
        if self.choice in ("named", "required"):
            return 0
        if self.choice != "auto":
            return len(text)
        if self.parser == "hermes":
            found = text.find(HERMES_START)
            if found != -1:
                return found
            return len(text) - partial_tag(text, HERMES_START)  # a start tag may be on its way
        head = text.lstrip()  # llama3_json: the whole message is the call, or it is content
        undecided = not head or PYTHON_TAG.startswith(head) or head.startswith(("{", PYTHON_TAG))
        return 0 if undecided else len(text)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) from a whole output. Text that does not parse as calls is content."""
        if self.choice == "named":
            return None, [ToolCall(self.name, text)]
        if self.choice == "required":
            try:
                calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens
                return text, []
            return None, calls
        if self.choice != "auto":
            return text, []
        if self.parser == "hermes":
            return _parse_hermes(text)
        return _parse_llama3_json(text)


def _call(obj) -> ToolCall:
    """A call from a parsed {"name", "arguments" | "parameters"} object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(HERMES_START)
    if start == -1:
        return text, []
    calls, at = [], start
    try:
        while at != -1:
            end = text.find(HERMES_END, at)
            body = text[at + len(HERMES_START):end if end != -1 else len(text)]
            calls.append(_call(json.loads(body)))
            at = -1 if end == -1 else text.find(HERMES_START, end)
    except ValueError:
        return text, []
    return text[:start] or None, calls


def _parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    body = body[len(PYTHON_TAG):].strip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while at < len(body):  # calls separated by ";" (Llama 3's parallel calls)
            obj, at = decoder.raw_decode(body, at)
            calls.append(_call(obj))
            while at < len(body) and body[at] in " \n;":
                at += 1
    except ValueError:
        return text, []
    return None, calls


def plan_tools(tools: list | None, tool_choice, parser: str | None, parallel: bool = True) -> ToolPlan | None:
    """Check a request's tools and tool_choice (ValueError naming the field); None without tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (tool.get("type", "function") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not function["name"]
                or not isinstance(function.get("parameters", {}), dict)):
            raise ValueError(f"tools must be functions with a name and a parameters schema, got {tool!r}")
    names = [t["function"]["name"] for t in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
        return ToolPlan("named", tools, name=name)
    choice = tool_choice or "auto"
    if choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}")
    if choice == "auto" and parser is None:
        raise ValueError("tool_choice 'auto' (the default with tools) needs the server started with "
                         f"--tool-call-parser ({' or '.join(PARSERS)}); 'required' and a named function work without")
    return ToolPlan(choice, tools, parser=parser, parallel=parallel)


class ToolStream:
    """One streamed choice's deltas under a tool plan: a named function's arguments as they come;
    otherwise content while it is surely content, and the calls once the output is whole."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.sent = 0                          # characters of content already streamed
        self.calls: list[ToolCall] = []

    def delta(self, text: str, new_text: str, finished: bool) -> dict | None:
        """The delta for an output whose text is now `text` (`new_text` of it new)."""
        if self.plan.choice == "named":
            if self.calls and new_text:
                return {"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}
            if not self.calls and (new_text or finished):
                self.calls = [ToolCall(self.plan.name, new_text)]
                return {"tool_calls": [self.calls[0].to_dict(0)]}
            return None
        if not finished:
            end = self.plan.content_end(text)
            piece, self.sent = text[self.sent:end], max(self.sent, end)
            return {"content": piece} if piece else None
        content, self.calls = self.plan.parse(text)
        delta = {}
        if (content or "")[self.sent:]:
            delta["content"] = content[self.sent:]
        if self.calls:
            delta["tool_calls"] = [call.to_dict(k) for k, call in enumerate(self.calls)]
        return delta or None

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(self.plan, self.calls, reason)


def finish_reason(plan: ToolPlan, calls: list[ToolCall], reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (not for a named function it was made to)."""
    return "tool_calls" if calls and reason == "stop" and plan.choice != "named" else reason
