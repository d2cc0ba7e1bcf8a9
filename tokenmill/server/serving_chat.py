"""POST /v1/chat/completions: messages rendered through the model's chat template, answered
streamed or whole, with tool calls (server/tools.py) and reasoning content
(server/reasoning.py) split out of the text when the server knows their format: the tool-call
format its chat template shows (server/tool_detection.py) or a flag names, the reasoning one a flag;
or all three out of gpt-oss's harmony messages (server/harmony.py), for a model that writes them.

A stream opens each choice with a delta holding only the role, then sends content (or
reasoning, or tool-call) deltas, and closes the choice with an empty delta carrying the
finish reason and vLLM's stop_reason (the stop token id or string that ended it). With vLLM's
return_token_ids, the opening chunk carries the prompt's token ids and each delta its tokens'.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from tokenmill.chat import render_chat
from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError, check_model
from tokenmill.server.harmony import HarmonyStream, call_dict, call_id, harmony_params, parse_harmony, with_thinking
from tokenmill.server.harmony import finish_reason as harmony_finish_reason
from tokenmill.server.logprobs import chat_logprobs, prompt_logprobs
from tokenmill.server.protocol import ChatCompletionRequest, ChatRendering, TokenizeRequest
from tokenmill.server.reasoning import ReasoningParser, ReasoningStream
from tokenmill.server.serving import ServingEngine, answer_ids, sampling_params, with_tool_plan
from tokenmill.server.tools import HARMONY, ToolPlan, ToolStream
from tokenmill.server.tools import finish_reason as tool_finish_reason

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams


def render_request(tokenizer, req: ChatCompletionRequest | TokenizeRequest, harmony: bool) -> dict:
    """{"prompt": text, "prompt_token_ids": ids} of a request's messages, rendered with its
    rendering fields (protocol.ChatRendering: chat's and /tokenize's alike); a template that
    rejects them is an APIError(400) on `messages`. harmony: an assistant's reasoning_content
    goes to the template as `thinking` (gpt-oss's keeps it before the calls that followed it)."""
    conversation = [m.model_dump(exclude_none=True) for m in req.messages]
    try:  # (with the messages' other fields: an assistant's tool_calls, a tool's tool_call_id)
        return render_chat(tokenizer, [with_thinking(m) for m in conversation] if harmony else conversation,
                           req.add_generation_prompt, req.tools, req.template_kwargs(), req.continue_final_message)
    except ValueError as exc:  # (the message names the place of a bad tool call: messages.1.tool_calls.0...)
        where = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=where if where.startswith("messages.") else "messages") from None


def check_continuation(req: ChatRendering) -> None:
    """A 400 for a request that continues the last message and opens a new one too."""
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt=false: the last message is "
                       "continued, no new one opened", param="continue_final_message")


def _chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    """The request's SamplingParams, after the checks of the fields only chat has."""
    check_continuation(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:  # 0 is not "no limit"
        raise APIError(400, f"max_completion_tokens must be >= 1, got {req.max_completion_tokens}",
                       param="max_completion_tokens")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)


@dataclass
class ChatHandler:
    serving: ServingEngine
    tokenizer: object
    model_name: str                      # the name clients send
    tool_call_parser: str | None         # the model's tool-call format (tools.PARSERS), for tool_choice 'auto'
    thinking: ReasoningParser | None     # splits <think> blocks off as reasoning_content
    harmony: bool = False                # the model writes harmony (gpt-oss): reasoning, content and calls

    async def create(self, req: ChatCompletionRequest, raw: Request):
        check_model(req.model, self.model_name)
        params = _chat_sampling_params(req)
        plan, params = with_tool_plan(params, req.tools, req.tool_choice,
                                      HARMONY if self.harmony else self.tool_call_parser,
                                      req.parallel_tool_calls is not False,
                                      "response_format or structured_outputs")
        prompt = await asyncio.to_thread(render_request, self.tokenizer, req, self.harmony)  # tokenizes
        if plan is not None and plan.choice == "none":
            plan = None
        if self.harmony:
            params = harmony_params(params, self.tokenizer)
        elif plan is not None and plan.keeps_special_tokens:
            params = params.clone(skip_special_tokens=False)
        ids = answer_ids("chatcmpl", raw, req.request_id)
        requests = await self.serving.build_requests([prompt], params, req.priority, ids, input_name="messages",
                                                     cache_salt=req.cache_salt, deadline=req.deadline,
                                                     field_names={"structured_outputs": req.constraint_field()})
        base = {"id": ids[0], "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name}
        # a structured output constrains the output from its first token: thinking only where the
        # grammar itself opens a block (deepseek_r1's rule would take all of it as thinking)
        split = (self.thinking if self.thinking is None or params.structured_outputs is None
                 else ReasoningParser("qwen3"))
        response = ChatResponse(req, len(requests), self.tokenizer, base, plan, split, self.harmony)
        return await self.serving.respond(req, requests, params.n, raw, response)


@dataclass
class ChatResponse:
    """The chunks and choices of one chat completion request (a serving.Response)."""

    req: ChatCompletionRequest
    num_choices: int
    tokenizer: object
    base: dict
    plan: ToolPlan | None            # how tool calls come out; None: the text is the content
    split: ReasoningParser | None    # splits thinking off the answer; None: no reasoning content
    harmony: bool = False            # the output is harmony messages (plan and split unused)
    chunk_base: dict = field(init=False)
    started: list[bool] = field(init=False)  # per choice: whether its role delta went out
    tool_streams: list[ToolStream | None] = field(init=False)
    reasoning_streams: list[ReasoningStream | None] = field(init=False)
    harmony_streams: list[HarmonyStream] = field(init=False)

    def __post_init__(self) -> None:
        self.chunk_base = {**self.base, "object": "chat.completion.chunk"}
        self.started = [False] * self.num_choices
        self.tool_streams = [ToolStream(self.plan) if self.plan is not None and not self.harmony else None
                             for _ in self.started]
        self.reasoning_streams = [ReasoningStream(self.split) if self.split is not None else None
                                  for _ in self.started]
        self.harmony_streams = [HarmonyStream() for _ in self.started]

    @property
    def top_n(self) -> int:
        return self.req.top_logprobs or 0

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        result, ids = [], self.req.return_token_ids
        if not self.started[i]:  # the role comes first, in a delta of its own
            self.started[i] = True
            first = self._chunk(i, {"role": "assistant", "content": ""})
            result.append({**first, "prompt_token_ids": out.prompt_token_ids} if ids else first)
        lp = None
        if self.req.logprobs and out.new_token_ids:
            lp = chat_logprobs(self.tokenizer, out.outputs[0].logprobs[-len(out.new_token_ids):],
                               out.new_token_ids, self.top_n, self.req.return_tokens_as_token_ids)
        delta, reason = self._delta(i, out)
        if delta or lp is not None or ids and out.new_token_ids:
            result.append(self._chunk(i, delta or {"content": ""}, lp, token_ids=out.new_token_ids if ids else None))
        if out.finished:
            result.append(self._chunk(i, {}, finish_reason=reason, stop_reason=out.outputs[0].stop_reason))
        return result

    def whole_fields(self, outputs: list[RequestOutput]) -> dict:
        """vLLM's prompt_logprobs and prompt_token_ids, once for the one prompt its choices share."""
        fields = {}
        if self.req.prompt_logprobs is not None:
            fields["prompt_logprobs"] = prompt_logprobs(self.tokenizer, outputs[0].prompt_logprobs,
                                                        outputs[0].prompt_logprob_ranks, self.req.prompt_logprobs)
        if self.req.return_token_ids:
            fields["prompt_token_ids"] = outputs[0].prompt_token_ids
        return fields

    def _delta(self, i: int, out: RequestOutput) -> tuple[dict, str | None]:
        """Choice i's delta for output `out`, and its finish reason so far."""
        stream, reason = self.tool_streams[i], out.outputs[0].finish_reason
        text, new_text, delta = out.outputs[0].text, out.new_text, {}
        if self.harmony:
            delta = self.harmony_streams[i].delta(text, out.finished) or {}
            return delta, harmony_finish_reason(self.harmony_streams[i].num_calls, reason, self._named)
        if self.reasoning_streams[i] is not None:  # the thinking first; what follows it is the answer
            new_reasoning, text, new_text = self.reasoning_streams[i].step(text, out.finished)
            if new_reasoning:
                delta["reasoning_content"] = new_reasoning
        if stream is None:
            if new_text:
                delta["content"] = new_text
        else:
            delta.update(stream.delta(text, new_text, out.finished, reason == "length") or {})
            reason = stream.finish_reason(reason)
        return delta, reason

    @property
    def _named(self) -> bool:
        return self.plan is not None and self.plan.choice == "named"

    def choice(self, i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        parse = self._harmony_message if self.harmony else self._message
        message, reason = parse(c.text, c.finish_reason)
        lp = (chat_logprobs(self.tokenizer, c.logprobs, c.token_ids, self.top_n, self.req.return_tokens_as_token_ids)
              if self.req.logprobs else None)
        choice = {"index": i, "message": message, "logprobs": lp, "finish_reason": reason, "stop_reason": c.stop_reason}
        return {**choice, "token_ids": c.token_ids} if self.req.return_token_ids else choice

    def _message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The message of a whole output, its thinking and calls split off where the server knows how."""
        message = {"role": "assistant", "content": text}
        if self.split is not None:
            reasoning, message["content"] = self.split.split(text)
            message["reasoning_content"] = reasoning or None
        if self.plan is not None:
            message["content"], calls = self.plan.parse(message["content"], reason == "length")
            if calls:
                message["tool_calls"] = [call.to_dict() for call in calls]
            reason = tool_finish_reason(self.plan, calls, reason)
        return message, reason

    def _harmony_message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        parsed = parse_harmony(text)
        message = {"role": "assistant", "content": parsed.content or (None if parsed.calls else ""),
                   "reasoning_content": parsed.reasoning or None}
        if parsed.calls:
            message["tool_calls"] = [call_dict(call, call_id()) for call in parsed.calls]
        return message, harmony_finish_reason(len(parsed.calls), reason, self._named)

    def _chunk(self, i: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None,
               stop_reason: int | str | None = None, token_ids: list[int] | None = None) -> dict:
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
        return {**self.chunk_base, "choices": [{**choice, "token_ids": token_ids} if token_ids is not None else choice]}
