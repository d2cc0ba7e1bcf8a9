"""The Response object of OpenAI's Responses API, whole or as its stream of typed events.

A response's output is a `message` item (its text as one `output_text` part) and/or
`function_call` items, in that order (a model writes its text before its calls), after a
`reasoning` item (its thinking as one `reasoning_text` part) where the server splits thinking off
(--reasoning-parser, or gpt-oss's harmony); a response cut short by max_output_tokens is "incomplete". Streamed, the
same items are opened, filled and closed one at a time, each event numbered in order
(`sequence_number`):

    response.created, response.in_progress
    for each item: response.output_item.added
        reasoning:        response.content_part.added, response.reasoning_text.delta ...,
                          response.reasoning_text.done, response.content_part.done
        a message:        response.content_part.added, response.output_text.delta ...,
                          response.output_text.done, response.content_part.done
        a function call:  response.function_call_arguments.delta ..., response.function_call_arguments.done
    response.output_item.done
    response.completed, or response.incomplete (or response.failed, if a step failed)

Text streams as it comes where no tools may turn it into calls; under a tool plan, as the chat
endpoint streams it (tools.ToolStream): a named function's arguments as they come, otherwise
content while it is surely content and the calls once the output is whole.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.harmony import HarmonyStream, call_id, parse_harmony
from tokenmill.server.protocol_responses import FunctionChoice, ResponsesRequest
from tokenmill.server.reasoning import ReasoningParser, ReasoningStream
from tokenmill.server.tools import ToolPlan, ToolStream

# The items that hold text, and the prefix of their text's delta and done events
TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> str:
    """The response's status for its request's finish reason: cut short ("length", or "abort" at
    shutdown) it is incomplete."""
    return "incomplete" if finish_reason in ("length", "abort") else "completed"


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def text_part(kind: str, text: str) -> dict:
    """The one content part of a message or a reasoning item."""
    return output_text(text) if kind == "message" else {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, content: list[dict], status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, content: list[dict], status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(plan: ToolPlan | None, text: str, status: str, thinking: ReasoningParser | None = None,
                 harmony: bool = False) -> list[dict]:
    """A whole output's items, each with `status`: its thinking (split off by `thinking`, if
    any), the message (when there is text, or no call), then the function calls parsed from it
    (harmony: all three read from its messages)."""
    if harmony:
        parsed = parse_harmony(text)
        reasoning, content, calls = parsed.reasoning, parsed.content, [(call_id(), c.name, c.arguments)
                                                                      for c in parsed.calls]
    else:
        reasoning, text = thinking.split(text) if thinking is not None else ("", text)
        content, found = plan.parse(text, status == "incomplete") if plan is not None else (text, [])
        calls = [(call.id, call.name, call.arguments) for call in found]
    items = [reasoning_item(new_id("rs"), [text_part("reasoning", reasoning)], status)] if reasoning else []
    if content or not calls:
        items.append(message_item(new_id("msg"), [output_text(content or "")], status))
    return items + [call_item(new_id("fc"), *call, status) for call in calls]


def usage(out: RequestOutput) -> dict:
    prompt, output = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    cached = out.metrics.num_uncomputed_tokens if out.metrics is not None else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output}


@dataclass
class ResponseHead:
    """What every snapshot of one response shares: its id, model and creation time, and the
    request's settings as OpenAI's API echoes them."""

    fields: dict

    @classmethod
    def of(cls, req: ResponsesRequest, params: SamplingParams, response_id: str, model: str) -> ResponseHead:
        choice = req.tool_choice
        return cls({"id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
                    "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                    "previous_response_id": req.previous_response_id, "store": req.store,
                    "metadata": req.metadata or {}, "temperature": params.temperature, "top_p": params.top_p,
                    "text": {"format": req.text_format.as_dict()},
                    "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
                    "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
                    "parallel_tool_calls": req.parallel_tool_calls, "truncation": "disabled",
                    "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
                    "user": req.user})

    def snapshot(self, status: str, output: list[dict], usage: dict | None = None,
                 finish_reason: str | None = None, error: dict | None = None) -> dict:
        """The Response object with this status and output (incomplete_details says why it is cut short)."""
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {**self.fields, "status": status, "error": error, "incomplete_details": incomplete,
                "output": output, "usage": usage}


class ResponseEvents:
    """The server-sent events of one streamed response, numbered in order. `output` holds the
    items so far, the last one maybe still open (being written); `final` is the Response object
    once the response ended (None until then, and for a response that failed)."""

    def __init__(self, head: ResponseHead, plan: ToolPlan | None, thinking: ReasoningParser | None = None,
                 harmony: bool = False) -> None:
        self.head, self.plan = head, plan
        self.tools = ToolStream(plan) if plan is not None and not harmony else None
        self.thinking = ReasoningStream(thinking) if thinking is not None else None
        self.harmony = HarmonyStream() if harmony else None
        self.sequence = 0
        self.output: list[dict] = []
        self.open: dict | None = None        # the item being written (the last of output), if any
        self.text = ""                       # the open message's or reasoning's text so far
        self.final: dict | None = None

    def start(self) -> list[str]:
        """The events before any output; with neither tools nor thinking, the message opens at once."""
        created = self.head.snapshot("in_progress", [])
        events = [self._event("response.created", response=created),
                  self._event("response.in_progress", response=created)]
        opens = self.plan is None and self.thinking is None and self.harmony is None
        return events + (self._open_text("message") if opens else [])

    def step(self, out: RequestOutput) -> list[str]:
        """The events an output of the response's request adds."""
        if out.error is not None:
            return self.failed(out.error)
        events, text, new_text = [], out.outputs[0].text, out.new_text
        if self.harmony is not None:  # reasoning, content and calls all from its messages
            delta = self.harmony.delta(text, out.finished) or {}
            events += self._text("reasoning", delta["reasoning_content"]) if "reasoning_content" in delta else []
        else:
            delta = self._delta(text, new_text, out.finished, events,
                                status_of(out.outputs[0].finish_reason) == "incomplete")
        events += self._text("message", delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls", []):  # (a named function's first delta opens its call)
            if "id" in call:
                events += self._open_call(call["id"], call["function"]["name"])
            if call["function"].get("arguments"):
                events += self._arguments(call["function"]["arguments"])
        return events + (self._finish(out) if out.finished else [])

    def _delta(self, text: str, new_text: str, finished: bool, events: list[str], cut: bool) -> dict:
        """The content and calls an output adds (cut: it ended early); its thinking's events (if
        split off) added to `events`."""
        if self.thinking is not None:  # the thinking first; what follows it is the answer
            new_reasoning, text, new_text = self.thinking.step(text, finished)
            events += self._text("reasoning", new_reasoning) if new_reasoning else []
        return {"content": new_text} if self.tools is None else self.tools.delta(text, new_text, finished, cut) or {}

    def failed(self, message: str) -> list[str]:
        """The events that end a response whose request failed (a step's error, the engine's death)."""
        events = self._close("incomplete")
        error = {"code": "server_error", "message": message}
        return events + [self._event("response.failed", response=self.head.snapshot("failed", self.output,
                                                                                    error=error))]

    def _finish(self, out: RequestOutput) -> list[str]:
        reason = out.outputs[0].finish_reason
        status = status_of(reason)
        answered = any(item["type"] != "reasoning" for item in self.output)
        events = [] if answered else self._open_text("message")  # no text and no call: an empty message
        events += self._close(status)
        self.final = self.head.snapshot(status, self.output, usage(out), reason)
        return events + [self._event(f"response.{status}", response=self.final)]

    def _open_text(self, kind: str) -> list[str]:
        """Open a message or a reasoning item, with its one text part."""
        events = self._close("completed")
        item = message_item(new_id("msg"), [], "in_progress") if kind == "message" else reasoning_item(
            new_id("rs"), [], "in_progress")
        self.open, self.text = item, ""
        self.output.append(item)
        return events + [self._event("response.output_item.added", output_index=self.index, item=item),
                         self._event("response.content_part.added", item_id=item["id"],
                                     output_index=self.index, content_index=0, part=text_part(kind, ""))]

    def _text(self, kind: str, piece: str) -> list[str]:
        events = [] if self.open is not None and self.open["type"] == kind else self._open_text(kind)
        self.text += piece
        logprobs = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(f"{TEXT_EVENTS[kind]}.delta", item_id=self.open["id"], output_index=self.index,
                                     content_index=0, delta=piece, **logprobs)]

    def _open_call(self, call_id: str, name: str) -> list[str]:
        events = self._close("completed")
        self.open = call_item(new_id("fc"), call_id, name, "", "in_progress")
        self.output.append(self.open)
        return events + [self._event("response.output_item.added", output_index=self.index, item=self.open)]

    def _arguments(self, piece: str) -> list[str]:
        self.open["arguments"] += piece
        return [self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                            output_index=self.index, delta=piece)]

    def _close(self, status: str) -> list[str]:
        """The events that close the open item (none without one), which ends with `status`."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        if item["type"] in TEXT_EVENTS:
            item["content"] = [text_part(item["type"], self.text)]
            logprobs = {"logprobs": []} if item["type"] == "message" else {}
            events = [self._event(f"{TEXT_EVENTS[item['type']]}.done", **where, content_index=0, text=self.text,
                                  **logprobs),
                      self._event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        else:
            events = [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    @property
    def index(self) -> int:
        """The open item's output_index."""
        return len(self.output) - 1

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"
