"""Reasoning models' thinking, split from their answer (vLLM's --reasoning-parser).

Qwen3 and DeepSeek-R1 think between <think> and </think> before they answer; the chat endpoint
returns the thinking as `reasoning_content` beside `content` (streamed: reasoning deltas, then
content deltas). Where the chat template opens the block itself (DeepSeek-R1, Qwen3's
thinking-only releases) the output holds only the closing tag: "deepseek_r1" takes everything
before it as reasoning, and all of an output cut short while thinking; "qwen3" only a block the
output opens (with enable_thinking false the template writes an empty block into the prompt,
and the output is all answer). Text is split as it is, with no whitespace trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that a `tag` to come could complete (text a stream holds
    back; also the tool-call parsers')."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


@dataclass
class ReasoningParser:
    kind: str                                   # one of REASONING_PARSERS

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of an output; for a partial one (final False), without the end
        that may still turn out to be a tag, so that both only grow as the output does."""
        if not final and START.startswith(text) and text != START:
            return "", ""                       # an opening tag may be on its way
        opened = text.startswith(START)
        if self.kind == "qwen3" and not opened:
            return "", text                     # no block opened: all answer, a "</think>" in it too
        body = text[len(START):] if opened else text
        end = body.find(END)
        if end != -1:
            return body[:end], body[end + len(END):]
        return body[:len(body) - (0 if final else partial_tag(body, END))], ""


class ReasoningStream:
    """One streamed choice: the new reasoning and the answer so far, delta by delta."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning_sent = 0
        self.content_sent = 0

    def step(self, text: str, finished: bool) -> tuple[str, str, str]:
        """(new reasoning, the answer so far, its new part) for an output whose text is now `text`."""
        reasoning, content = self.parser.split(text, final=finished)
        new_reasoning, self.reasoning_sent = reasoning[self.reasoning_sent:], max(self.reasoning_sent, len(reasoning))
        new_content, self.content_sent = content[self.content_sent:], max(self.content_sent, len(content))
        return new_reasoning, content, new_content
