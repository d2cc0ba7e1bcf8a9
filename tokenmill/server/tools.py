"""Tool calling in the chat endpoint: OpenAI's `tools` and `tool_choice`, as vLLM serves them.

The tools go to the chat template; `tool_choice` decides how calls come out:
  a named function  the output is constrained (a structured output) to that function's
                    parameters schema, and is its arguments, streamed as they come: cut by
                    max_tokens or a stop string, they are as far as they came
  "required"        the output is constrained to a JSON array of {"name", "parameters"} calls,
                    at least one, each naming one of the tools; cut by max_tokens, the calls
                    as far as they came (finish reason "length"), or the text as content if no
                    call's name was whole yet; ended by a stop string before the array did, the
                    text as content
  "auto"            the model decides, and its text is parsed for calls in its own format:
                    the server's tool-call parser (PARSERS; read from the chat template by
                    tool_detection.py unless --tool-call-parser names it):
                      hermes       <tool_call>{...}</tool_call> blocks after the content (Qwen 2.5 / 3, Hermes)
                      llama3_json  the message is a JSON call, or several joined by ";" (Llama 3.1+)
                      mistral      [TOOL_CALLS] then a JSON array of calls (Mistral 7B v0.3, Nemo), or
                                   name[ARGS]{...} / name{...} after each [TOOL_CALLS] (tokenizers v11+)
                      pythonic     the message is a Python list of calls, [f(a=1), g(b="x")] (Llama 3.2, 4)
                      phi4_mini_json  after the content, a JSON list of {"name", "arguments"} calls after
                                   <|tool_call|> (Phi-4-mini's own token, its <|/tool_call|> optional) or
                                   after the word functools, as vLLM's Phi-4-mini template asks: functools[...]
                    or gpt-oss's harmony (harmony.py), whose forced calls are a grammar of its own
  "none"            no calls are made
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from tokenmill.sampling_params import check_schema_depth
from tokenmill.server.harmony import call_grammar
from tokenmill.server.reasoning import partial_tag

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name

PARSERS = ("hermes", "llama3_json", "mistral", "phi4_mini_json", "pythonic")
HARMONY = "harmony"                     # gpt-oss's format: chosen by its architecture, not --tool-call-parser
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"                                     # Llama 3.1's, before a JSON call
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"   # Llama 4's, around pythonic calls
MISTRAL_START, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PHI4_START, PHI4_END = "<|tool_call|>", "<|/tool_call|>"          # Phi-4-mini's special tokens around calls
PHI4_FUNCTOOLS = "functools["                                     # the prefix vLLM's Phi-4-mini template asks for
# content first, then calls after one of these tags; or the whole message is calls, opening with one of these
CALLS_AFTER = {"hermes": (HERMES_START,), "mistral": (MISTRAL_START,), "phi4_mini_json": (PHI4_START, PHI4_FUNCTOOLS)}
CALLS_OPEN_WITH = {"llama3_json": ("{", PYTHON_TAG), "pythonic": ("[", PYTHON_START)}


@dataclass
class ToolCall:
    name: str
    arguments: str                      # JSON text, as OpenAI sends it
    id: str = ""                        # given by the plan (ToolPlan.call_id)

    def to_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def parameters_schema(function: dict) -> dict:
    """A function's parameters schema for its calls' arguments. One that is left out, or declares
    no properties and says nothing else of its object, is an empty parameter list (as OpenAI reads
    an omitted `parameters`): its calls' arguments are {}."""
    schema = function.get("parameters") or {}
    keys = set(schema) - {"type", "title", "description", "$schema"}
    if keys or schema.get("type", "object") != "object":
        return schema
    return {**schema, "type": "object", "properties": {}}


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, never schemas to rewrite


def _rerooted(schema, root: str, top: bool = True):
    """A schema moved from a document's root to `root` (a JSON pointer into the new document;
    a tool's name holds no '/' or '~' to escape): its local references ("#", "#/$defs/Address",
    as pydantic writes them) point there too. Its own `$id` goes (references would resolve
    against it); a nested schema with an `$id` of its own is a resource whose references stay."""
    if isinstance(schema, list):
        return [_rerooted(item, root, False) for item in schema]
    if not isinstance(schema, dict) or (not top and "$id" in schema):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else _rerooted(value, root, False)
           for key, value in schema.items() if not (top and key == "$id")}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


@dataclass
class ToolPlan:
    choice: str                         # "none", "auto", "required" or "named"
    tools: list[dict]                   # as the request gave them (for the chat template)
    name: str | None = None             # the named function
    parser: str | None = None           # the server's: parses "auto" outputs, and shapes every call's id
    parallel: bool = True               # parallel_tool_calls: false makes "required" one call

    def constraint(self) -> dict | None:
        """The structured output that makes the calls (StructuredOutputsParams fields), if any.
        Arguments never carry a key the function's parameters do not declare (unless its schema
        allows others itself): a call made as f(**arguments) would fail on it."""
        functions = {t["function"]["name"]: parameters_schema(t["function"]) for t in self.tools}
        if self.parser == HARMONY and self.choice in ("named", "required"):  # one call, in harmony's header
            return {"grammar": call_grammar({self.name: functions[self.name]} if self.name else functions)}
        if self.choice == "named":
            return {"json": functions[self.name], "disable_additional_properties": True}
        if self.choice == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{name}"}}}
                     for name in functions]
            defs = {name: _rerooted(schema, f"#/$defs/{name}") for name, schema in functions.items()}
            return {"json": {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                             "items": {"anyOf": calls}, "$defs": defs}, "disable_additional_properties": True}
        return None

    def call_id(self) -> str:
        """A new call's id: OpenAI's call_ form, or 9 letters and digits for Mistral (its chat
        templates refuse any other id when the call comes back in the conversation)."""
        return uuid.uuid4().hex[:9] if self.parser == "mistral" else f"call_{uuid.uuid4().hex[:24]}"

    @property
    def keeps_special_tokens(self) -> bool:
        """Mistral's [TOOL_CALLS] and Phi-4-mini's <|tool_call|> are special tokens: outputs must be
        decoded with them (harmony's markers too: harmony.harmony_params)."""
        return self.choice == "auto" and self.parser in ("mistral", "phi4_mini_json")

    def content_end(self, text: str) -> int:
        """How much of a partial output is surely content, not the start of a call (streaming)."""
        if self.choice in ("named", "required"):
            return 0
        if self.choice != "auto":
            return len(text)
        if self.parser in CALLS_AFTER:
            found = [at for tag in CALLS_AFTER[self.parser] if (at := text.find(tag)) != -1]
            if found:
                return min(found)
            return len(text) - max(partial_tag(text, tag) for tag in CALLS_AFTER[self.parser])  # one may be coming
        head = text.lstrip()  # the whole message is the calls, or it is content
        undecided = not head or any(o.startswith(head) or head.startswith(o) for o in CALLS_OPEN_WITH[self.parser])
        return 0 if undecided else len(text)

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) from a whole output; cut: max_tokens ended it (a "required" array is
        then read as far as it came, and is never content: cut before its first name was whole, it
        gives neither, as vLLM's content is empty under "required"). Other text that does not
        parse as calls is content."""
        content, calls = self._parse(text, cut)
        for call in calls:
            call.id = self.call_id()
        return content, calls

    def _parse(self, text: str, cut: bool) -> tuple[str | None, list[ToolCall]]:
        if self.choice == "named":
            return None, [ToolCall(self.name, text)]
        if self.choice == "required":
            try:
                return None, [_required_call(c) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError, RecursionError):  # cut short, or nested past the decoder's limit
                if cut:  # the array's syntax, not words of the model's: no content
                    return None, _cut_calls(text)
                return text, []
        if self.choice != "auto":
            return text, []
        return _PARSE[self.parser](text)


def _required_call(obj) -> ToolCall:
    """A call from one {"name", "parameters"} object of a "required" array."""
    return ToolCall(obj["name"], json.dumps(obj["parameters"], ensure_ascii=False))


CUT_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(,\s*"parameters"\s*:\s*)?')


def _cut_calls(text: str) -> list[ToolCall]:
    """The calls of a "required" array cut short: each whole one, then the last as far as it came
    once its name is whole, its arguments unterminated JSON text (as a named function's are when
    cut; the finish reason "length" says so)."""
    decoder, calls, at = json.JSONDecoder(), [], text.find("[") + 1
    if at == 0:
        return []
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            obj, end = decoder.raw_decode(text, at)
            calls.append(_required_call(obj))
        except (ValueError, TypeError, KeyError, RecursionError):
            break
        at = end
    head = CUT_CALL_HEAD.match(text, at)
    if head is not None:
        calls.append(ToolCall(json.loads(head.group(1)), text[head.end():] if head.group(2) else ""))
    return calls


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
    except (ValueError, RecursionError):  # (a model's JSON nested past the decoder's limit)
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
    except (ValueError, RecursionError):  # (a model's JSON nested past the decoder's limit)
        return text, []
    return None, calls


def _parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find(MISTRAL_START)
    if start == -1:
        return text, []
    calls = []
    try:
        for piece in text[start + len(MISTRAL_START):].split(MISTRAL_START):
            body = piece.strip()
            if body.startswith(("[", "{")):  # before v11: a JSON array of calls (or one call)
                found = json.loads(body)
                calls += [_call(c) for c in (found if isinstance(found, list) else [found])]
                continue
            if MISTRAL_ARGS in body:  # v11+: name[ARGS]{...}, maybe name[CALL_ID]id[ARGS]{...}
                head, _, args = body.partition(MISTRAL_ARGS)
            else:  # or name{...}
                brace = body.find("{")
                if brace <= 0:
                    raise ValueError("not a call")
                head, args = body[:brace], body[brace:]
            name = head.partition(MISTRAL_CALL_ID)[0].strip()
            arguments = json.loads(args)
            if not name or not isinstance(arguments, dict):
                raise ValueError("not a call")
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
    except (ValueError, RecursionError):  # (a model's JSON nested past the decoder's limit)
        return text, []
    return text[:start] or None, calls


def _parse_pythonic(text: str) -> tuple[str | None, list[ToolCall]]:
    """[f(a=1), g(b="x")]: read with Python's own parser, never run; arguments must be literals."""
    body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    if not body.startswith("["):
        return text, []
    try:
        found = ast.parse(body, mode="eval").body
        if not isinstance(found, ast.List) or not found.elts:
            raise ValueError("not a list of calls")
        calls = []
        for node in found.elts:
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
                    or any(k.arg is None for k in node.keywords)):  # f(x) or f(**x): no parameter names
                raise ValueError("not a call with named arguments")
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):  # TypeError: a set, bytes
        return text, []
    return None, calls


def _parse_phi4_mini(text: str) -> tuple[str | None, list[ToolCall]]:
    """Content, then calls: each <|tool_call|> (its <|/tool_call|> optional) or functools[ opens a
    JSON list of calls, or calls separated by commas; nothing else may follow them."""
    found = [at for tag in CALLS_AFTER["phi4_mini_json"] if (at := text.find(tag)) != -1]
    if not found:
        return text, []
    start = min(found)
    decoder, calls, at = json.JSONDecoder(), [], start
    try:
        while True:
            while at < len(text) and text[at] in " \t\r\n,":
                at += 1
            if at == len(text):
                break
            tag = next((t for t in (PHI4_START, PHI4_END) if text.startswith(t, at)), None)
            if tag is not None:
                at += len(tag)
                continue
            if text.startswith(PHI4_FUNCTOOLS, at):
                at += len(PHI4_FUNCTOOLS) - 1  # to its "[", which opens the list
            found_calls, at = decoder.raw_decode(text, at)
            calls += [_call(c) for c in (found_calls if isinstance(found_calls, list) else [found_calls])]
    except (ValueError, RecursionError):  # (a model's JSON nested past the decoder's limit)
        return text, []
    return (text[:start] or None, calls) if calls else (text, [])


_PARSE = {"hermes": _parse_hermes, "llama3_json": _parse_llama3_json, "mistral": _parse_mistral,
          "phi4_mini_json": _parse_phi4_mini, "pythonic": _parse_pythonic}


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
    for i, (tool, name) in enumerate(zip(tools, names)):
        if not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"tools.{i}.function.name must be 1 to 64 letters, digits, underscores or dashes, "
                             f"got {name!r}")
        if name in names[:i]:
            raise ValueError(f"tools.{i}.function.name {name!r} names an earlier tool too: each tool needs its own")
        check_schema_depth(tool["function"].get("parameters", {}), f"tools.{i}.function.parameters")
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})")
        return ToolPlan("named", tools, name=name, parser=parser)
    choice = tool_choice or "auto"
    if choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}")
    if choice == "auto" and parser is None:
        raise ValueError("tool_choice 'auto' (the default with tools) needs the model's tool-call format, and its "
                         "chat template shows none tokenmill parses: start the server with --tool-call-parser "
                         f"({' or '.join(PARSERS)}); 'required' and a named function work without")
    return ToolPlan(choice, tools, parser=parser, parallel=parallel)


class ToolStream:
    """One streamed choice's deltas under a tool plan: a named function's arguments as they come;
    otherwise content while it is surely content, and the calls once the output is whole."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.sent = 0                          # characters of content already streamed
        self.calls: list[ToolCall] = []

    def delta(self, text: str, new_text: str, finished: bool, cut: bool = False) -> dict | None:
        """The delta for an output whose text is now `text` (`new_text` of it new); cut: max_tokens
        ended it."""
        if self.plan.choice == "named":
            if self.calls and new_text:
                return {"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}
            if not self.calls and (new_text or finished):
                self.calls = [ToolCall(self.plan.name, new_text, self.plan.call_id())]
                return {"tool_calls": [self.calls[0].to_dict(0)]}
            return None
        if not finished:
            end = self.plan.content_end(text)
            piece, self.sent = text[self.sent:end], max(self.sent, end)
            return {"content": piece} if piece else None
        content, self.calls = self.plan.parse(text, cut)
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
