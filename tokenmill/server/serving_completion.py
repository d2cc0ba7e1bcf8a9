"""POST /v1/completions: text completion of one or several prompts, n samples each, streamed
or whole, with the prompt echoed and legacy logprobs when asked; vLLM's prompt_logprobs, its
stop_reason (the stop token id or string that ended a choice) and, with return_token_ids, the
prompt's token ids (a stream's first chunk of each choice) and the output's (each chunk's own).

Echo with max_tokens 0 returns the prompt alone, with its logprobs: that is how clients score a
text. The engine still samples one token, which is dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError, check_model
from tokenmill.server.logprobs import TextOffsets, completion_logprobs, prompt_logprobs, top_prompt_entries
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.serving import ServingEngine, answer_ids, sampling_params

if TYPE_CHECKING:
    from tokenmill.request import Request as EngineRequest


@dataclass
class CompletionHandler:
    serving: ServingEngine
    tokenizer: object
    model_name: str  # the name clients send

    async def create(self, req: CompletionRequest, raw: Request):
        check_model(req.model, self.model_name)
        echo_only = req.echo and req.max_tokens == 0
        if echo_only and req.min_tokens > 0:  # (checked here: the engine is asked for 1 token)
            raise APIError(400, f"min_tokens ({req.min_tokens}) must be <= max_tokens (0)", param="min_tokens")
        params = sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs,
                                 prompt_logprobs=req.logprobs if req.echo else None)
        ids = answer_ids("cmpl", raw, req.request_id)
        requests = await self.serving.build_requests(req.prompts(), params, req.priority, ids,
                                                     cache_salt=req.cache_salt, deadline=req.deadline,
                                                     add_special_tokens=req.add_special_tokens,
                                                     field_names={"structured_outputs": req.constraint_field()})
        base = {"id": ids[0], "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}
        response = CompletionResponse(req, requests, self.tokenizer, base, echo_only)
        return await self.serving.respond(req, requests, params.n, raw, response, generated=not echo_only)


@dataclass
class CompletionResponse:
    """The chunks and choices of one completion request (a serving.Response)."""

    req: CompletionRequest
    requests: list[EngineRequest]
    tokenizer: object
    base: dict
    echo_only: bool  # echo with max_tokens 0: the prompt alone
    # per choice: the next token's text_offset (the echo's and earlier tokens' characters: text
    # held back for a stop string lags behind the tokens), and whether its first chunk went out
    # (with the echoed prompt, and the prompt's token ids when asked)
    offsets: list[TextOffsets] = field(init=False)
    started: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = [TextOffsets() for _ in self.requests]
        self.started = [False] * len(self.requests)

    @property
    def chunk_base(self) -> dict:
        return self.base

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        new_text, new_ids = ("", []) if self.echo_only else (out.new_text, out.new_token_ids)
        first, echo = not self.started[i], ""
        self.started[i] = True
        if first and self.req.echo:
            echo = self._prompt_text(i)
            self.offsets[i] = TextOffsets(len(echo))
        lp = None
        if self.req.logprobs is not None and new_ids:  # offsets into the whole text, echo first
            lp = completion_logprobs(self.tokenizer, out.outputs[0].logprobs[-len(new_ids):], new_ids,
                                     self.offsets[i], self.req.return_tokens_as_token_ids)
        if echo:
            lp = self._with_prompt(lp, out)
        text, ids = echo + new_text, self.req.return_token_ids
        if not text and not out.finished and lp is None and not (ids and (first or new_ids)):
            return []
        choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": self._finish_reason(out),
                  "stop_reason": self._stop_reason(out)}
        if ids:
            choice.update({"prompt_token_ids": out.prompt_token_ids} if first else {}, token_ids=new_ids)
        return [{**self.base, "choices": [choice]}]

    def choice(self, i: int, out: RequestOutput) -> dict:
        c = out.outputs[0]
        text, ids, entries = ("", [], []) if self.echo_only else (c.text, c.token_ids, c.logprobs)
        start = len(self._prompt_text(i)) if self.req.echo else 0
        lp = (completion_logprobs(self.tokenizer, entries, ids, TextOffsets(start), self.req.return_tokens_as_token_ids)
              if self.req.logprobs is not None else None)
        if self.req.echo:
            lp = self._with_prompt(lp, out)
        choice = {"index": i, "text": (self._prompt_text(i) if self.req.echo else "") + text, "logprobs": lp,
                  "finish_reason": self._finish_reason(out), "stop_reason": self._stop_reason(out)}
        if self.req.prompt_logprobs is not None:  # vLLM's, in each choice
            choice["prompt_logprobs"] = prompt_logprobs(self.tokenizer, out.prompt_logprobs, out.prompt_logprob_ranks,
                                                        self.req.prompt_logprobs)
        if self.req.return_token_ids:
            choice.update(prompt_token_ids=out.prompt_token_ids, token_ids=ids)
        return choice

    def whole_fields(self, outputs: list[RequestOutput]) -> dict:
        return {}

    def _prompt_text(self, i: int) -> str:
        r = self.requests[i]
        return r.prompt if r.prompt is not None else self.tokenizer.decode(r.prompt_token_ids)

    def _finish_reason(self, out: RequestOutput) -> str | None:
        reason = out.outputs[0].finish_reason
        return "length" if self.echo_only and reason == "stop" else reason  # the dropped token was EOS

    def _stop_reason(self, out: RequestOutput) -> int | str | None:
        """vLLM's: the stop token id or string that ended the choice (None for EOS or a length)."""
        return None if self.echo_only else out.outputs[0].stop_reason

    def _with_prompt(self, lp: dict | None, out: RequestOutput) -> dict | None:
        """The echoed prompt's logprobs (offsets from 0) before those of `lp`, which follow it."""
        if self.req.logprobs is None:
            return None
        entries = top_prompt_entries(out.prompt_logprobs, out.prompt_logprob_ranks, self.req.logprobs)
        head = completion_logprobs(self.tokenizer, entries, out.prompt_token_ids, TextOffsets(),
                                   self.req.return_tokens_as_token_ids)
        return {key: head[key] + (lp[key] if lp else []) for key in head}
