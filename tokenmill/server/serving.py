"""What the generating endpoints (completions, chat completions) share: engine requests built
from an HTTP request's prompts, and their outputs answered either as an SSE stream or, once all
are done, as one JSON body.

Each endpoint describes its own answer with a `Response` (serving_completion.py,
serving_chat.py): the chunks one output adds to the stream, and the choice a final output makes
in the whole body. `ServingEngine.respond` runs the requests and uses whichever the client asked
for. Endpoints that answer in shapes of their own take the outputs with `collect` (whole) or
`stream` (as they come).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.async_engine import AsyncLLMEngine, EngineDeadError
from tokenmill.input_processor import ContextLengthError
from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError, context_length_error
from tokenmill.server.otel import RequestSpans
from tokenmill.server.protocol import error_body
from tokenmill.server.request_log import RequestLog
from tokenmill.server.streaming import merge_streams
from tokenmill.server.tools import ToolPlan, plan_tools

if TYPE_CHECKING:
    from tokenmill.engine import LLMEngine
    from tokenmill.request import Request as EngineRequest
    from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.server")

MAX_COMPLETIONS = 1024  # engine requests one HTTP request may make
MAX_REQUEST_ID_CHARS = 256  # a client's own id for an answer (X-Request-Id)


SHUTDOWN_MESSAGE = "the server is shutting down: the request was ended before it finished"  # (server_shutting_down)


def answer_ids(kind: str, raw: Request, asked: str | None = None) -> tuple[str, str]:
    """(the answer's id, the prefix of its engine requests' ids), as vLLM names them: `kind`, a
    dash, then the X-Request-Id header (its bytes read as UTF-8, as the request log's URL path is),
    else the body's request_id (`asked`), else a random hex. A client's id leaves the engine's
    unique, in case it sends the same one twice at once (the request log then keeps the later
    answer under it)."""
    fresh = uuid.uuid4().hex
    given = asked
    if header := raw.headers.get("x-request-id"):
        try:
            given = header.encode("latin-1").decode("utf-8")  # Starlette decodes header bytes as latin-1
        except UnicodeDecodeError:
            raise APIError(400, "X-Request-Id must be UTF-8", param="request_id") from None
    if not given:
        return f"{kind}-{fresh}", f"{kind}-{fresh}"
    if len(given) > MAX_REQUEST_ID_CHARS or not given.isprintable():
        raise APIError(400, f"a request id (X-Request-Id, or request_id) must be at most {MAX_REQUEST_ID_CHARS} "
                            "printable characters", param="request_id")
    return f"{kind}-{given}", f"{kind}-{given}-{fresh[:12]}"


class Response(Protocol):
    """One HTTP request's answer, built from its engine requests' outputs (index i: the i-th)."""

    base: dict        # the fields of the whole response (id, object, created, model)
    chunk_base: dict  # the same for each streamed chunk

    def chunks(self, i: int, out: RequestOutput) -> list[dict]:
        """The chunks (maybe none) that output `out` of request i adds to the stream."""

    def choice(self, i: int, out: RequestOutput) -> dict:
        """Request i's choice in the whole response, from its final output."""

    def whole_fields(self, outputs: list[RequestOutput]) -> dict:
        """The whole response's fields beside its choices and usage."""


def sampling_params(req, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams; an invalid value is an APIError(400) naming its field."""
    try:
        return req.sampling_params(max_tokens, logprobs, default_max_tokens=None, prompt_logprobs=prompt_logprobs)
    except ValueError as exc:  # SamplingParams names the field first in its message
        raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None


def with_tool_plan(params: SamplingParams, tools: list | None, choice, parser: str | None, parallel: bool,
                   own_format: str) -> tuple[ToolPlan | None, SamplingParams]:
    """How a request's tools (chat form) are called, and its params with the calls' constraint:
    tool_choice "required" or a named function makes the calls a structured output, which the
    request's own format (`own_format`, the field that names it) must then leave out."""
    try:
        plan = plan_tools(tools, choice, parser, parallel)
    except ValueError as exc:  # (a schema too deep is named by its place: tools.0.function.parameters)
        where, message = str(exc).split(" ", 1)[0], str(exc)
        param = where if where.startswith("tools.") else "tool_choice" if "tool_choice" in message else "tools"
        raise APIError(400, message, param=param) from None
    constraint = plan.constraint() if plan is not None else None
    if constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(400, "tool_choice 'required' or a named function makes the output a structured "
                           f"output already: drop {own_format}", param="tool_choice")
        params = params.clone(structured_outputs=constraint)
    return plan, params


def raise_if_failed(outputs: list[RequestOutput]) -> None:
    failed = next((o for o in outputs if o.error is not None), None)
    if failed is not None:
        raise APIError(500, failed.error, "server_error")


def usage(outputs: list[RequestOutput], n: int, generated: bool = True) -> dict:
    """Token counts, with OpenAI's count of the prompt tokens not computed (cached_tokens, each
    prompt's first sample's); generated=False: the outputs' tokens are not returned (echo with
    max_tokens 0)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])
    cached = sum(o.metrics.num_uncomputed_tokens for o in outputs[::n] if o.metrics is not None)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs) if generated else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def opens_choice(chunk: dict) -> bool:
    """Whether a chunk is a chat choice's opening role delta, which carries no completion tokens
    (in vLLM's continuous usage too), though it goes out with the choice's first token."""
    return any("role" in choice.get("delta", {}) for choice in chunk["choices"])


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class TimedStreamingResponse(StreamingResponse):
    """A stream whose client must take each chunk within `write_timeout` seconds. A client that
    stops reading fills the socket's buffers, and then a send waits for it; past the timeout the
    response ends as if the client had gone away: its body iterator is closed, which aborts its
    requests and frees their KV blocks, and the connection is closed (the server has no more to
    say on it). Until then the engine keeps one merged output per request for it."""

    def __init__(self, content: AsyncIterator[str], write_timeout: float, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.write_timeout = write_timeout

    async def stream_response(self, send) -> None:
        async def timed_send(message) -> None:
            async with asyncio.timeout(self.write_timeout):
                await send(message)
        try:
            await super().stream_response(timed_send)
        except TimeoutError:
            logger.warning("a client took no output for %.3g s: its stream ends and its requests are aborted",
                           self.write_timeout)
            await self.body_iterator.aclose()


@dataclass
class ServingEngine:
    """The engine as the generating endpoints use it: `engine` tokenizes prompts, `async_engine`
    makes and runs the requests; a stream whose client takes nothing for `write_timeout` seconds
    is ended and its requests aborted. Each response's requests go into `request_log` under the
    response's id (the prefix of their ids), where GET /v1/requests/{id} finds their timelines."""

    engine: LLMEngine
    async_engine: AsyncLLMEngine
    write_timeout: float = 60.0
    request_log: RequestLog = field(default_factory=lambda: RequestLog(1000))
    spans: RequestSpans | None = None   # --otlp-traces-endpoint (server/otel.py)

    async def build_requests(self, prompts: list, params: SamplingParams, priority: int,
                             ids: tuple[str, str], input_name: str = "prompt", cache_salt: str | None = None,
                             add_special_tokens: bool = True, deadline: float | None = None,
                             field_names: dict[str, str] | None = None) -> list[EngineRequest]:
        """One engine request per (prompt, sample), each with the request's cache_salt, priority and
        deadline (seconds from its arrival, for the edf policy), a text
        prompt tokenized with or without its tokenizer's special tokens, logged under the answer's
        id (`ids`: the answer's id and its requests' prefix, from answer_ids); raises
        APIError(400) for any invalid one, a prompt past the context as OpenAI answers it, naming the
        endpoint's input (`input_name`) and an engine field by the request's own name for it
        (`field_names`: structured_outputs -> response_format, say).
        Tokenizing runs on a worker thread, so that a body of a few MB does not stall every open
        stream for seconds; the number of requests is capped, as a body of a few MB could ask for
        millions."""
        if len(prompts) * params.n > MAX_COMPLETIONS:
            raise APIError(400, f"at most {MAX_COMPLETIONS} completions per request (prompts x n), "
                                f"got {len(prompts)} x {params.n}", param="prompt")
        arrival = time.monotonic()  # the requests' timelines start here, before tokenizing
        answer_id, prefix = ids
        due = arrival + deadline if deadline is not None else None
        requests = await asyncio.to_thread(self._make_requests, prompts, params, priority, due, prefix, arrival,
                                           input_name, cache_salt, add_special_tokens, field_names or {})
        self.request_log.add(answer_id, requests)
        return requests

    def _make_requests(self, prompts: list, params: SamplingParams, priority: int, due: float | None, prefix: str,
                       arrival: float, input_name: str, cache_salt: str | None,
                       add_special_tokens: bool, field_names: dict[str, str]) -> list[EngineRequest]:
        requests = []
        try:
            for i, prompt in enumerate(prompts):  # tokenized once for its n samples
                text, ids = self.engine.input_processor.tokenize_prompt(prompt, add_special_tokens)
                tokenized = {"prompt": text, "prompt_token_ids": ids, "cache_salt": cache_salt}
                for j in range(params.n):
                    requests.append(self.async_engine.make_request(f"{prefix}-{i}-{j}", tokenized,
                                                                   params.for_sample(j), priority=priority,
                                                                   deadline=due, arrival_time=arrival))
        except ContextLengthError as exc:
            raise context_length_error(exc, input_name) from None
        except ValueError as exc:
            field = getattr(exc, "field", None)  # an input_processor.FieldError names its field
            names = {"prompt": input_name, **field_names}  # the prompt by the endpoint's name for its input
            raise APIError(400, str(exc), param=names.get(field, field)) from None
        return requests

    async def respond(self, req, requests: list[EngineRequest], n: int, raw: Request, response: Response,
                      generated: bool = True):
        """An SSE stream of `response.chunks` (plus the usage chunk when asked, and with vLLM's
        continuous_usage_stats each chunk's choice's usage so far), or the whole response with one
        `response.choice` per request once all are done. n: the completions per prompt (usage
        counts each prompt once)."""
        if self.spans is not None:
            self.spans.start([r.request_id for r in requests], raw.headers)
        if req.stream:
            options = req.stream_options
            include_usage = options is not None and options.include_usage
            final = ((lambda outs: {**response.chunk_base, "choices": [], "usage": usage(outs, n, generated)})
                     if include_usage else None)
            running = ((lambda out, chunk: usage([out], 1, generated and not opens_choice(chunk)))
                       if include_usage and options.continuous_usage_stats else None)
            return TimedStreamingResponse(self._event_stream(requests, response, final, running), self.write_timeout,
                                          media_type="text/event-stream")
        outputs = await self._collect(requests, raw)
        raise_if_failed(outputs)
        body = {**response.base, "choices": [response.choice(i, out) for i, out in enumerate(outputs)],
                "usage": usage(outputs, n, generated), **response.whole_fields(outputs)}
        if outputs and outputs[0].kv_transfer_params is not None:  # a prefill instance's hand-off (vLLM's field)
            body["kv_transfer_params"] = outputs[0].kv_transfer_params
        return body

    async def collect(self, requests: list[EngineRequest], raw: Request) -> list[RequestOutput]:
        """The final outputs of requests answered whole by an endpoint that streams nothing
        (embeddings, a Responses API answer): their spans started, a 500 if a step failed, all of them aborted if the
        client disconnects first."""
        if self.spans is not None:
            self.spans.start([r.request_id for r in requests], raw.headers)
        outputs = await self._collect(requests, raw)
        raise_if_failed(outputs)
        return outputs

    def _outputs(self, requests: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) of the requests' outputs as they come; those a consumer that lags has
        not taken yet are merged into one per request."""
        return merge_streams([self.async_engine.generate(r) for r in requests], RequestOutput.merged)

    async def _collect(self, requests: list[EngineRequest], raw: Request) -> list[RequestOutput]:
        """Final outputs of every request; aborts them all if the client disconnects first. One
        that shutdown ended (abort_all) makes the answer a 503, as the router's is: a 200 would pass
        a cut-short or empty answer off as a whole one."""
        finals: dict[int, RequestOutput] = {}

        async def run():
            async for i, out in self._outputs(requests):
                if out.finished:
                    finals[i] = out
        task = asyncio.create_task(run())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
        task.result()
        outputs = [finals[i] for i in range(len(requests))]
        if self.ended_by_shutdown(outputs):
            raise APIError(503, SHUTDOWN_MESSAGE, "server_error", code="server_shutting_down")
        return outputs

    def ended_by_shutdown(self, outputs: Iterable[RequestOutput]) -> bool:
        """Whether the shutdown ended any of these (final) outputs (finish_reason "abort")."""
        return self.async_engine.closing and any(o.outputs and o.outputs[0].finish_reason == "abort" for o in outputs)

    async def _event_stream(self, requests: list[EngineRequest], response: Response,
                            final_usage: Callable[[list[RequestOutput]], dict] | None,
                            chunk_usage: Callable[[RequestOutput, dict], dict] | None = None) -> AsyncIterator[str]:
        """SSE: chunks as outputs arrive (each with its output's usage, given `chunk_usage`), then an
        error event (a step failed, the engine died, or the shutdown ended the request) or the
        optional usage, then [DONE] (after an error too, as vLLM's)."""
        finals: dict[int, RequestOutput] = {}  # (for the usage)
        error = None
        try:
            async for i, out in self._outputs(requests):
                if out.error is not None:
                    error = error_body(out.error, "server_error")
                    break
                if out.finished:
                    finals[i] = out
                for chunk in response.chunks(i, out):
                    yield sse(chunk if chunk_usage is None else {**chunk, "usage": chunk_usage(out, chunk)})
        except EngineDeadError as exc:
            error = error_body(str(exc), "server_error")
        if error is None and self.ended_by_shutdown(finals.values()):
            # after the "abort" chunks: so that a client does not take the text for whole
            error = error_body(SHUTDOWN_MESSAGE, "server_error", code="server_shutting_down")
        if error is not None:
            yield sse(error)
        elif final_usage is not None:
            yield sse(final_usage([finals[i] for i in range(len(requests))]))
        yield sse("[DONE]")

    def stream(self, requests: list[EngineRequest], raw: Request) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) of requests whose endpoint streams events of its own (the Responses API),
        as they come: their spans started; closing the iterator (a client that went away) aborts them."""
        if self.spans is not None:
            self.spans.start([r.request_id for r in requests], raw.headers)
        return self._outputs(requests)
