"""POST /v1/responses: OpenAI's Responses API, served by the chat endpoint's machinery.

A request becomes a chat conversation: its `instructions` as a system message, then the stored
conversation of its `previous_response_id` (that response's input and output; not its
instructions, as OpenAI's API reads them), then its `input`, where a message item is a message, a
function_call item an assistant's tool call and a function_call_output item a tool message. The
conversation goes through the model's chat template (chat.py) with the tools; `text.format` is a
structured output (structured.py) and the tools and tool_choice a tool plan (tools.py), and a
server started with a reasoning parser splits the thinking off as a `reasoning` item, as in chat
completions (a gpt-oss model's harmony messages give the reasoning item, the message and the calls,
as in chat). Reasoning items in the input are dropped, as chat templates drop earlier thinking.

The answer is a Response object whose output is a `message` item (its text as one `output_text`
part) and/or `function_call` items; cut short by max_output_tokens it is "incomplete". A stream
sends the same answer as typed server-sent events, each with its sequence number (both in
responses_output.py). A stored response (`store`, the default) keeps its conversation in the
app's ResponseStore, a bounded map that forgets the least recently used first.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from tokenmill.async_engine import EngineDeadError
from tokenmill.chat import render_chat
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError, check_model
from tokenmill.server.harmony import harmony_params
from tokenmill.server.protocol_responses import FunctionChoice, InputItem, ResponsesRequest
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.responses_output import ResponseEvents, ResponseHead, new_id, output_items, status_of, usage
from tokenmill.server.serving import SHUTDOWN_MESSAGE, ServingEngine, TimedStreamingResponse, with_tool_plan
from tokenmill.server.tools import ToolPlan

# SamplingParams' and the engine's names for the request's fields
FIELD_NAMES = {"max_tokens": "max_output_tokens", "structured_outputs": "text.format"}


class ResponseStore:
    """The last `capacity` stored responses, by response id: each one's conversation (chat
    messages: input and output, what previous_response_id continues) and the response itself
    (what GET /v1/responses/{id} answers), holding at most `max_chars` characters of them in all
    (a stored conversation can be megabytes); reading one makes it the most recently used.
    Capacity 0 keeps none."""

    def __init__(self, capacity: int, max_chars: int = 256 * 1024 * 1024) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store's capacity must be >= 0, got {capacity}")
        self.capacity, self.max_chars = capacity, max_chars
        # id -> (messages, the response, their characters)
        self._entries: OrderedDict[str, tuple[list[dict], dict, int]] = OrderedDict()
        self._chars = 0

    def get(self, response_id: str) -> list[dict] | None:
        """The response's conversation, or None."""
        entry = self._touch(response_id)
        return None if entry is None else entry[0]

    def response(self, response_id: str) -> dict | None:
        """The response as it was answered, or None."""
        entry = self._touch(response_id)
        return None if entry is None else entry[1]

    def _touch(self, response_id: str) -> tuple[list[dict], dict, int] | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, conversation: list[dict], response: dict) -> None:
        if self.capacity == 0:
            return
        chars = len(json.dumps(conversation, default=str)) + len(json.dumps(response, default=str))
        if chars > self.max_chars:
            return  # (larger than the whole store: kept nowhere)
        self.delete(response_id)
        self._chars += chars
        self._entries[response_id] = (conversation, response, chars)
        while len(self._entries) > self.capacity or self._chars > self.max_chars:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._chars -= dropped

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was kept."""
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry[2]
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found: it was not stored (store: false), was "
                         "deleted, or was forgotten (--responses-store-size)", param="response_id")


# ---- the conversation ----------------------------------------------------------------------------

def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def input_messages(items: str | list[InputItem]) -> list[dict]:
    """`input` as chat messages. A string is a user message; a developer message is a system one
    (chat templates know no developer role); function_call items are an assistant message's
    tool_calls (calls in a row, and calls right after an assistant's text, in one message) and
    function_call_output items tool messages; reasoning items are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for item in items:
        if item.type == "message":
            messages.append({"role": "system" if item.role == "developer" else item.role,
                             "content": _text(item.content)})
        elif item.type == "function_call":
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def check_call_ids(conversation: list[dict]) -> None:
    """Every function_call_output answers a function call made before it (in this input or the
    previous responses'), as OpenAI requires: a 400 naming the call_id otherwise."""
    made = set()
    for message in conversation:
        made.update(call["id"] for call in message.get("tool_calls", []))
        if message["role"] == "tool" and message["tool_call_id"] not in made:
            raise APIError(400, f"No tool call found for function call output with call_id "
                                f"{message['tool_call_id']}.", param="input")


def output_message(output: list[dict]) -> dict:
    """A response's output items as the assistant message a later turn's conversation holds."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, effort: str | None) -> dict:
    try:
        return render_chat(tokenizer, messages, True, tools, {"reasoning_effort": effort} if effort else None)
    except ValueError as exc:
        raise APIError(400, str(exc), param="input") from None


# ---- sampling and tools --------------------------------------------------------------------------

def _sampling_params(req: ResponsesRequest) -> SamplingParams:
    """The request's SamplingParams; an invalid value is an APIError(400) naming its field."""
    values = {"max_tokens": req.max_output_tokens, "structured_outputs": req.text_format.constraint()}
    values.update({name: getattr(req, name) for name in ("temperature", "top_p") if getattr(req, name) is not None})
    try:
        return SamplingParams(**values)
    except ValueError as exc:  # SamplingParams names the field first in its message
        field, _, rest = str(exc).partition(" ")
        name = FIELD_NAMES.get(field, field)
        raise APIError(400, f"{name} {rest}", param=name) from None


def _with_tools(req: ResponsesRequest, params: SamplingParams,
                parser: str | None) -> tuple[ToolPlan | None, SamplingParams]:
    """How the request's function tools are called (tools.py's plans, for the chat form of the
    tools), and its params with the calls' constraint where tool_choice makes one."""
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    return with_tool_plan(params, [tool.as_chat_tool() for tool in req.tools or []], choice, parser,
                          req.parallel_tool_calls, "text.format")


# ---- the handler ---------------------------------------------------------------------------------

@dataclass
class ResponsesHandler:
    serving: ServingEngine
    tokenizer: object
    model_name: str                      # the name clients send
    tool_call_parser: str | None         # the model's tool-call format (tools.PARSERS), for tool_choice 'auto'
    store: ResponseStore                 # the conversations previous_response_id reads
    thinking: ReasoningParser | None = None  # splits <think> blocks off as reasoning items
    harmony: bool = False                # the model writes harmony (gpt-oss): reasoning, content and calls

    async def create(self, req: ResponsesRequest, raw: Request):
        check_model(req.model, self.model_name)
        conversation = self._history(req.previous_response_id) + input_messages(req.input)
        if not conversation:
            raise APIError(400, "input must hold at least one item", param="input")
        check_call_ids(conversation)
        params = _sampling_params(req)
        plan, params = _with_tools(req, params, self.tool_call_parser)
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        prompt = await asyncio.to_thread(_render, self.tokenizer, system + conversation,  # tokenizes
                                         plan.tools if plan is not None else None,
                                         req.reasoning.effort if req.reasoning is not None else None)
        if plan is not None and plan.choice == "none":
            plan = None
        if self.harmony:
            params = harmony_params(params, self.tokenizer)
        elif plan is not None and plan.keeps_special_tokens:
            params = params.clone(skip_special_tokens=False)
        response_id = new_id("resp")
        request = await self._request(prompt, params, response_id, req)
        head = ResponseHead.of(req, params, response_id, self.model_name)
        kept = conversation if req.store else None
        # as in chat: under a structured output, thinking only where the grammar itself opens a block
        split = (self.thinking if self.thinking is None or params.structured_outputs is None
                 else ReasoningParser("qwen3"))
        if req.stream:
            events = self._stream(self.serving.stream([request], raw), ResponseEvents(head, plan, split, self.harmony),
                                  kept)
            return TimedStreamingResponse(events, self.serving.write_timeout, media_type="text/event-stream")
        out = (await self.serving.collect([request], raw))[0]  # (a 500 if a step failed)
        status = status_of(out.outputs[0].finish_reason)
        output = output_items(plan, out.outputs[0].text, status, split, self.harmony)
        response = head.snapshot(status, output, usage(out), out.outputs[0].finish_reason)
        if kept is not None:
            self.store.put(response_id, kept + [output_message(output)], response)
        return response

    async def stored(self, response_id: str, raw: Request) -> dict:
        """GET /v1/responses/{id}: a stored response as it was answered; DELETE: forget it (a later
        previous_response_id naming it is a 404)."""
        if raw.method == "DELETE":
            if not self.store.delete(response_id):
                raise _not_stored(response_id)
            return {"id": response_id, "object": "response.deleted", "deleted": True}
        response = self.store.response(response_id)
        if response is None:
            raise _not_stored(response_id)
        return response

    def _history(self, previous_response_id: str | None) -> list[dict]:
        if previous_response_id is None:
            return []
        conversation = self.store.get(previous_response_id)
        if conversation is None:
            raise APIError(404, f"Previous response with id '{previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        return conversation

    async def _request(self, prompt: dict, params: SamplingParams, response_id: str, req: ResponsesRequest):
        """The engine request, with the request's cache_salt, priority and deadline; its errors name
        the Responses API's fields (max_output_tokens)."""
        return (await self.serving.build_requests([prompt], params, req.priority, (response_id, response_id),
                                                  input_name="input", cache_salt=req.cache_salt,
                                                  deadline=req.deadline, field_names=FIELD_NAMES))[0]

    async def _stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]], events: ResponseEvents,
                      kept: list[dict] | None) -> AsyncIterator[str]:
        """The response's events as its request's `outputs` come; a stored response is kept once it
        ended. Closing it (a client that went away) closes `outputs`, which aborts the request."""
        yield "".join(events.start())
        try:
            async for _, out in outputs:
                if out.finished and self.serving.ended_by_shutdown([out]):  # cut short: failed, not kept
                    yield "".join(events.failed(SHUTDOWN_MESSAGE))
                    return
                yield "".join(events.step(out))
        except EngineDeadError as exc:
            yield "".join(events.failed(str(exc)))
            return
        if kept is not None and events.final is not None:
            self.store.put(events.final["id"], kept + [output_message(events.final["output"])], events.final)
