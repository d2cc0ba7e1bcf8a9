"""gpt-oss's harmony format: its outputs split into reasoning, content and tool calls, whole or
streamed, and the grammar that makes it call a tool when tool_choice says it must.

Harmony writes every message as `<|start|>{role}{header}<|message|>{body}` and an end token:
<|end|> after a message the model goes on from, <|call|> after a tool call and <|return|> after
the answer (those two are stop tokens, so their text is not in the output). The header names the
message's channel and maybe its recipient, in either order, and maybe a content type:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}
    <|start|>assistant<|channel|>final<|message|>It is sunny.

The chat template's generation prompt ends with `<|start|>assistant`, so an output opens in the
middle of its first header. The markers are special tokens: outputs are decoded with them kept.

Each message goes to one place in the chat answer:
    a recipient functions.NAME          a tool call to NAME, its arguments the body (any channel)
    final, or commentary to no one      content (a commentary message is a preamble the user sees)
    analysis, or any other recipient    reasoning_content (a built-in tool's call is thinking here)
Several messages of one kind are joined with a newline. An output that opens with no header (one
a structured output held to JSON) is all content. A call cut short by max_tokens comes back as far
as it was written, with finish_reason "length" (as OpenAI's API answers); calls are read whatever
tool_choice says, as the model made them ("none" still shows the tools to the chat template).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tokenmill.server.reasoning import partial_tag
from tokenmill.structured import JSON_LAYOUT, forbid_undeclared_properties

HARMONY_ARCHITECTURES = ("gpt_oss", "gpt-oss")   # config.json's model_type, GGUF's general.architecture
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
STOP_TOKENS = ("<|return|>", "<|call|>")         # the end of an answer and of a tool call
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
OPENINGS = (CHANNEL, START, " to=")               # how an output's first header can start
FUNCTIONS = "functions."
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


@dataclass
class HarmonyCall:
    name: str
    arguments: str                     # the message's body: JSON text as the model wrote it


@dataclass
class HarmonyOutput:
    reasoning: str = ""
    content: str = ""
    calls: list[HarmonyCall] = field(default_factory=list)


def is_harmony(architecture: str) -> bool:
    """Whether a model of this architecture (ModelConfig.architecture) writes harmony."""
    return architecture in HARMONY_ARCHITECTURES


def _held(text: str) -> int:
    """How much of the end of `text` may be the start of a marker still to come."""
    return max(partial_tag(text, marker) for marker in MARKERS)


def _body_end(text: str, start: int) -> tuple[int, int]:
    """(where the body starting at `start` ends, where the next message's header starts); the
    text's length twice for a body still open."""
    found = [(i, len(m)) for m in (*ENDS, START) if (i := text.find(m, start)) != -1]
    if not found:
        return len(text), len(text)
    end, size = min(found)
    after = end + size
    return end, after + len(START) if text.startswith(START, after) else after


def parse_harmony(text: str, final: bool = True) -> HarmonyOutput:
    """The reasoning, content and calls of an output whose text is `text`. For a partial one
    (final False), without an end that may still turn out to be a marker, and without a message
    whose header is not yet whole: each part then only grows as the output does."""
    out = HarmonyOutput()
    if not text.startswith(OPENINGS):
        if not final and any(o.startswith(text) for o in OPENINGS):
            return out                                  # a header may be on its way
        out.content = text
        return out
    at = len(START) if text.startswith(START) else 0
    while at < len(text):
        header_end = text.find(MESSAGE, at)
        if header_end == -1:
            break                                       # a header not yet whole (or cut short)
        header, body_start = text[at:header_end], header_end + len(MESSAGE)
        body_end, at = _body_end(text, body_start)
        body = text[body_start:body_end]
        if body_end == len(text) and not final:
            body = body[:len(body) - _held(body)]
        _add(out, header, body)
    return out


def _add(out: HarmonyOutput, header: str, body: str) -> None:
    """One message, with this header, where its recipient and channel put it."""
    recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
    recipient, channel = recipient.group(1) if recipient else None, channel.group(1) if channel else ""
    if recipient is not None and recipient.startswith(FUNCTIONS):
        out.calls.append(HarmonyCall(recipient[len(FUNCTIONS):], body))
    elif channel == "final" or (channel == "commentary" and recipient is None):
        out.content += "\n" + body if out.content else body
    else:
        out.reasoning += "\n" + body if out.reasoning else body


def with_thinking(message: dict) -> dict:
    """A chat message for a harmony chat template: an assistant's reasoning_content (as this server
    returns it) as `thinking`, the field gpt-oss's template writes on the analysis channel."""
    if message.get("role") != "assistant" or "reasoning_content" not in message or "thinking" in message:
        return message
    return {**message, "thinking": message["reasoning_content"]}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_dict(call: HarmonyCall, call_id_: str, index: int | None = None) -> dict:
    """A call as OpenAI's chat API writes it (with `index`: as a stream's delta does)."""
    out = {"id": call_id_, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


class HarmonyStream:
    """One streamed choice's deltas: new reasoning, new content, and each call opened (id and
    name) once its header is whole, then its arguments as they come."""

    def __init__(self) -> None:
        self.reasoning_sent = 0
        self.content_sent = 0
        self.arguments_sent: list[int] = []   # per call opened: characters of its arguments sent
        self.ids: list[str] = []
        self.num_calls = 0                     # calls in the output once it ended

    def delta(self, text: str, finished: bool) -> dict | None:
        """The delta (reasoning_content, content, tool_calls) for an output whose text is now `text`."""
        out = parse_harmony(text, final=finished)
        delta = {}
        if out.reasoning[self.reasoning_sent:]:
            delta["reasoning_content"] = out.reasoning[self.reasoning_sent:]
        if out.content[self.content_sent:]:
            delta["content"] = out.content[self.content_sent:]
        self.reasoning_sent, self.content_sent = len(out.reasoning), len(out.content)
        calls = []
        for k, call in enumerate(out.calls):
            if k == len(self.ids):
                self.ids.append(call_id())
                self.arguments_sent.append(len(call.arguments))
                calls.append(call_dict(call, self.ids[k], k))
            elif call.arguments[self.arguments_sent[k]:]:
                calls.append({"index": k, "function": {"arguments": call.arguments[self.arguments_sent[k]:]}})
                self.arguments_sent[k] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        self.num_calls = len(out.calls)
        return delta or None


def finish_reason(num_calls: int, reason: str | None, named: bool = False) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call and stopped (not for a named function
    it was made to call); a call cut short keeps "length"."""
    return "tool_calls" if num_calls and reason == "stop" and not named else reason


def harmony_params(params, tokenizer):
    """SamplingParams `params` for a harmony output: decoded with its markers, which are special
    tokens, and ended by <|return|> and <|call|> besides the stops it already has."""
    stops = [t for t in stop_token_ids(tokenizer) if t not in params.stop_token_ids]
    return params.clone(skip_special_tokens=False, stop_token_ids=params.stop_token_ids + stops)


def stop_token_ids(tokenizer) -> list[int]:
    """The ids of <|return|> and <|call|> in this tokenizer (those it has as tokens of their own)."""
    ids = []
    for token in STOP_TOKENS:
        found = tokenizer.convert_tokens_to_ids(token)
        if isinstance(found, int) and found != tokenizer.unk_token_id:
            ids.append(found)
    return ids


def call_grammar(functions: dict[str, dict]) -> str:
    """An llguidance grammar (Lark) for an output made to call one of `functions` (name ->
    parameters schema): maybe its reasoning on the analysis channel, then one call in harmony's
    header, its arguments JSON that the function's schema holds (with no key it does not declare,
    as tools.ToolPlan's constraints have it). Harmony makes one call an output: <|call|> stops it."""
    lines = ["start: analysis? call",
             'analysis: <|channel|> "analysis" <|message|> THOUGHT <|end|> <|start|> "assistant"',
             "THOUGHT: /(.|\\n)*/",
             "call: " + " | ".join(f"call_{k}" for k in range(len(functions)))]
    for k, (name, schema) in enumerate(functions.items()):
        header = json.dumps(f"commentary to={FUNCTIONS}{name} ")
        schema = {**forbid_undeclared_properties(schema), "x-guidance": JSON_LAYOUT}
        lines.append(f'call_{k}: <|channel|> {header} <|constrain|> "json" <|message|> %json {json.dumps(schema)}')
    return "\n".join(lines)
