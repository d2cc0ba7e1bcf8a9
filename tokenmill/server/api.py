"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    POST /v1/completions, /v1/chat/completions    (streaming with SSE, or whole)
    GET  /v1/models, /health, /metrics, /version; POST /tokenize, /detokenize

Every bad input gets an OpenAI-style error body: 400 for invalid requests, 401 for a
missing or wrong API key, 404 for an unknown model, 413 for an oversized body, 500 when
the step that ran a request failed (streams get an error event instead). A client that
disconnects has its requests aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.async_engine import AsyncLLMEngine, EngineDeadError
from tokenmill.chat import render_chat
from tokenmill.outputs import RequestOutput
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from tokenmill.server.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream
from tokenmill.server.streaming import AccessLogMiddleware, ApiKeyMiddleware, BodyLimitMiddleware, merge_streams
from tokenmill.server.tools import PARSERS, ToolStream, plan_tools
from tokenmill.server.tools import finish_reason as tool_finish_reason

logger = logging.getLogger("tokenmill.server")

MAX_COMPLETIONS = 1024  # engine requests one HTTP request may make


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte in a
    byte-level BPE vocabulary -> that byte. Printable Latin-1 bytes stand for themselves; the
    others, in order, for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


BYTE_ALPHABET = _byte_alphabet()


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """A token's own bytes, as OpenAI's `bytes` field gives them: a piece of a character (an
    emoji's first bytes) decodes to "\ufffd", so its bytes come from its vocabulary entry, in
    GPT-2's byte alphabet or as sentencepiece's <0xNN>."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return [int(piece[3:5], 16)]
    if all(c in BYTE_ALPHABET for c in piece):
        return [BYTE_ALPHABET[c] for c in piece]
    return list(text.encode())


def _is_type_name(part) -> bool:
    return part in ("str", "int", "float", "bool") or "[" in str(part)


def _by_text(entry: dict[int, float], token_text) -> dict[str, float]:
    """{token text: logprob} of a logprobs entry. Of tokens that decode to the same text (byte
    pieces of one character all read "\ufffd") the first stays: the entry lists the chosen token,
    then the top ones best first. (Overwriting left the lowest of them.)"""
    out: dict[str, float] = {}
    for token, lp in entry.items():
        out.setdefault(token_text(token), lp)
    return out


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def create_app(engine, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = 4 * 1024 * 1024, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {reasoning_parser!r}")
    thinking = ReasoningParser(reasoning_parser) if reasoning_parser is not None else None
    metrics = ServerMetrics(engine)
    async_engine = AsyncLLMEngine(engine, on_step=metrics.on_step)
    tokenizer = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.abort_all()
        async_engine.stop()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)  # (the last added runs first)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(AccessLogMiddleware, logger=logger)

    # ---- errors ----------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, exc: EngineDeadError):
        return JSONResponse(error_body(str(exc), "server_error"), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        # the location without "body" and the union members pydantic names ("prompt.str", "list[int]")
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_name(p)]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "request body is not valid JSON"
            loc = []
        elif loc:
            message = f"{'.'.join(loc)}: {message}"
        return JSONResponse(error_body(message, param=".".join(loc) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "not_found_error" if exc.status_code == 404
                                       else "invalid_request_error"), status_code=exc.status_code)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"the model '{name}' does not exist (this server serves '{served_model_name}')",
                           "not_found_error", param="model", code="model_not_found")

    async def build_requests(prompts: list, params, priority: int, prefix: str):
        """One engine request per (prompt, sample); raises APIError(400) for any invalid one.
        Tokenizing runs on a worker thread, so that a body of a few MB does not stall every open
        stream for seconds; the number of requests is capped, as a body of a few MB could ask for
        millions."""
        if len(prompts) * params.n > MAX_COMPLETIONS:
            raise APIError(400, f"at most {MAX_COMPLETIONS} completions per request (prompts x n), "
                                f"got {len(prompts)} x {params.n}", param="prompt")
        return await asyncio.to_thread(make_requests, prompts, params, priority, prefix)

    def make_requests(prompts: list, params, priority: int, prefix: str):
        requests = []
        try:
            for i, prompt in enumerate(prompts):
                text, ids = engine.tokenize_prompt(prompt)  # once for its n samples
                for j in range(params.n):
                    sub = params.for_sample(j)
                    requests.append(async_engine.make_request(f"{prefix}-{i}-{j}",
                                                              {"prompt": text, "prompt_token_ids": ids}, sub,
                                                              priority=priority))
        except ValueError as exc:
            raise APIError(400, str(exc), param="priority" if str(exc).startswith("priority") else None) from None
        return requests

    def sampling(req, max_tokens, logprobs, prompt_logprobs=None):
        try:
            return req.sampling_params(max_tokens, logprobs, default_max_tokens=None, prompt_logprobs=prompt_logprobs)
        except ValueError as exc:  # SamplingParams names the field first in its message
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None

    # ---- generation ------------------------------------------------------------------------

    async def collect(requests, raw: Request) -> list[RequestOutput]:
        """Final outputs of every request; aborts them all if the client disconnects first."""
        finals: dict[int, RequestOutput] = {}

        async def run():
            async for i, out in merge_streams([async_engine.generate(r) for r in requests]):
                if out.finished:
                    finals[i] = out
        task = asyncio.create_task(run())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
        task.result()
        return [finals[i] for i in range(len(requests))]

    def raise_if_failed(outputs: list[RequestOutput]) -> None:
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:
            raise APIError(500, failed.error, "server_error")

    def usage(outputs: list[RequestOutput], n: int, generated: bool = True) -> dict:
        """Token counts; generated=False: the outputs' tokens are not returned (echo with max_tokens 0)."""
        prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])
        completion = sum(len(o.outputs[0].token_ids) for o in outputs) if generated else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def completion_logprobs(entries: list[dict[int, float] | None], token_ids: list[int], offset: int) -> dict:
        """OpenAI's legacy logprobs; an entry of None (a prompt's first token) gives nulls."""
        tokens, lps, tops, offsets = [], [], [], []
        for token, entry in zip(token_ids, entries):
            text = token_text(token)
            tokens.append(text)
            lps.append(entry.get(token) if entry is not None else None)
            tops.append(_by_text(entry, token_text) if entry is not None else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(entries: list[dict[int, float]], token_ids: list[int], top_n: int) -> dict:
        content = []
        for token, entry in zip(token_ids, entries):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": token_text(token), "logprob": entry.get(token),
                            "bytes": token_bytes(tokenizer, token),
                            "top_logprobs": [{"token": token_text(t), "logprob": lp, "bytes": token_bytes(tokenizer, t)}
                                             for t, lp in top]})
        return {"content": content}

    def sse(payload: dict | str) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

    async def event_stream(requests, make_chunks, final_usage) -> AsyncIterator[str]:
        """SSE: chunks as outputs arrive, an error event if a step failed, optional usage, [DONE]."""
        outputs: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge_streams([async_engine.generate(r) for r in requests]):
                if out.error is not None:
                    yield sse(error_body(out.error, "server_error"))
                    return
                outputs[i] = out
                for chunk in make_chunks(i, out):
                    yield sse(chunk)
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), "server_error"))
            return
        if final_usage is not None:
            yield sse(final_usage([outputs[i] for i in range(len(requests))]))
        yield sse("[DONE]")

    async def respond(req, requests, n: int, raw: Request, base: dict, chunk_base: dict, make_chunks, make_choice,
                      generated: bool = True):
        """SSE stream of `make_chunks(i, output)` (plus the usage chunk when asked), or the whole
        response with one `make_choice(i, final output)` per request once all are done. n: the
        completions per prompt (usage counts each prompt once)."""
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            final = ((lambda outs: {**chunk_base, "choices": [], "usage": usage(outs, n, generated)})
                     if include_usage else None)
            return StreamingResponse(event_stream(requests, make_chunks, final), media_type="text/event-stream")
        outputs = await collect(requests, raw)
        raise_if_failed(outputs)
        return {**base, "choices": [make_choice(i, out) for i, out in enumerate(outputs)],
                "usage": usage(outputs, n, generated)}

    # ---- endpoints -------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        # echo with max_tokens 0 returns the prompt alone (with its logprobs: how clients score a text);
        # the engine still samples one token, which is dropped
        echo_only = req.echo and req.max_tokens == 0
        if echo_only and req.min_tokens > 0:  # (checked here: the engine is asked for 1 token)
            raise APIError(400, f"min_tokens ({req.min_tokens}) must be <= max_tokens (0)", param="min_tokens")
        params = sampling(req, 1 if echo_only else req.max_tokens, req.logprobs,
                          prompt_logprobs=req.logprobs if req.echo else None)
        prompts = req.prompts()
        requests = await build_requests(prompts, params, req.priority, f"cmpl-{uuid.uuid4().hex}")
        base = {"id": requests[0].request_id.rsplit("-", 2)[0], "object": "text_completion",
                "created": int(time.time()), "model": served_model_name}

        def prompt_text(i: int) -> str:
            r = requests[i]
            return r.prompt if r.prompt is not None else tokenizer.decode(r.prompt_token_ids)

        # per choice: the next token's text_offset (the echo's and earlier tokens' characters: text
        # held back for a stop string lags behind the tokens), and whether the prompt went out
        offsets = [0] * len(requests)
        echoed = [not req.echo] * len(requests)

        def finish_reason(out: RequestOutput) -> str | None:
            reason = out.outputs[0].finish_reason
            return "length" if echo_only and reason == "stop" else reason  # the dropped token was EOS

        def with_prompt(lp: dict | None, out: RequestOutput) -> dict | None:
            """The echoed prompt's logprobs (offsets from 0) before those of `lp`, which follow it."""
            if req.logprobs is None:
                return None
            head = completion_logprobs(out.prompt_logprobs, out.prompt_token_ids, 0)
            return {key: head[key] + (lp[key] if lp else []) for key in head}

        def chunks(i: int, out: RequestOutput):
            new_text, new_ids = ("", []) if echo_only else (out.new_text, out.new_token_ids)
            echo = ""
            if not echoed[i]:
                echo, echoed[i] = prompt_text(i), True
                offsets[i] = len(echo)
            lp = None
            if req.logprobs is not None and new_ids:  # offsets into the whole text, echo first
                lp = completion_logprobs(out.outputs[0].logprobs[-len(new_ids):], new_ids, offsets[i])
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if echo:
                lp = with_prompt(lp, out)
            text = echo + new_text
            if not text and not out.finished and lp is None:
                return []
            return [{**base, "choices": [{"index": i, "text": text, "logprobs": lp,
                                          "finish_reason": finish_reason(out)}]}]

        def choice(i: int, out: RequestOutput) -> dict:
            c = out.outputs[0]
            text, ids, entries = ("", [], []) if echo_only else (c.text, c.token_ids, c.logprobs)
            lp = (completion_logprobs(entries, ids, len(prompt_text(i)) if req.echo else 0)
                  if req.logprobs is not None else None)
            if req.echo:
                lp = with_prompt(lp, out)
            return {"index": i, "text": (prompt_text(i) if req.echo else "") + text, "logprobs": lp,
                    "finish_reason": finish_reason(out)}
        return await respond(req, requests, params.n, raw, base, base, chunks, choice, generated=not echo_only)

    def chat_prompt(messages, add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> dict:
        try:  # (with the messages' other fields: an assistant's tool_calls, a tool's tool_call_id)
            return render_chat(tokenizer, [m.model_dump(exclude_none=True) for m in messages],
                               add_generation_prompt, tools, template_kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        top_n = req.top_logprobs or 0
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
        if req.max_completion_tokens is not None and req.max_completion_tokens < 1:  # 0 is not "no limit"
            raise APIError(400, f"max_completion_tokens must be >= 1, got {req.max_completion_tokens}",
                           param="max_completion_tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling(req, max_tokens, top_n if req.logprobs else None)
        try:
            plan = plan_tools(req.tools, req.tool_choice, tool_call_parser, req.parallel_tool_calls is not False)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice" if "tool_choice" in str(exc) else "tools") from None
        calls_constraint = plan.constraint() if plan is not None else None
        if calls_constraint is not None:  # the calls are a structured output
            if params.structured_outputs is not None:
                raise APIError(400, "tool_choice 'required' or a named function makes the output a structured "
                               "output already: drop response_format or structured_outputs", param="tool_choice")
            params = params.clone(structured_outputs=calls_constraint)
        prompt = await asyncio.to_thread(chat_prompt, req.messages, req.add_generation_prompt,  # tokenizes
                                         req.tools, req.chat_template_kwargs)
        if plan is not None and plan.choice == "none":
            plan = None
        if plan is not None and plan.keeps_special_tokens:
            params = params.clone(skip_special_tokens=False)
        requests = await build_requests([prompt], params, req.priority, f"chatcmpl-{uuid.uuid4().hex}")
        base = {"id": requests[0].request_id.rsplit("-", 2)[0], "object": "chat.completion",
                "created": int(time.time()), "model": served_model_name}
        chunk_base = {**base, "object": "chat.completion.chunk"}
        started = [False] * len(requests)
        tool_streams = [ToolStream(plan) if plan is not None else None for _ in requests]
        # a structured output constrains the output from its first token: thinking only where the
        # grammar itself opens a block (deepseek_r1's rule would take all of it as thinking)
        split = thinking if thinking is None or params.structured_outputs is None else ReasoningParser("qwen3")
        reasoning_streams = [ReasoningStream(split) if split is not None else None for _ in requests]

        def chunks(i: int, out: RequestOutput):
            result = []
            if not started[i]:  # the role comes first, in a delta of its own
                started[i] = True
                result.append({**chunk_base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}]})
            lp = None
            if req.logprobs and out.new_token_ids:
                lp = chat_logprobs(out.outputs[0].logprobs[-len(out.new_token_ids):], out.new_token_ids, top_n)
            stream, reason = tool_streams[i], out.outputs[0].finish_reason
            text, new_text, delta = out.outputs[0].text, out.new_text, {}
            if reasoning_streams[i] is not None:  # the thinking first; what follows it is the answer
                new_reasoning, text, new_text = reasoning_streams[i].step(text, out.finished)
                if new_reasoning:
                    delta["reasoning_content"] = new_reasoning
            if stream is None:
                if new_text:
                    delta["content"] = new_text
            else:
                delta.update(stream.delta(text, new_text, out.finished) or {})
                reason = stream.finish_reason(reason)
            if delta or lp is not None:
                result.append({**chunk_base, "choices": [{"index": i, "delta": delta or {"content": ""},
                                                          "logprobs": lp, "finish_reason": None}]})
            if out.finished:
                result.append({**chunk_base, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                          "finish_reason": reason}]})
            return result

        def choice(i: int, out: RequestOutput) -> dict:
            c = out.outputs[0]
            message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if split is not None:
                reasoning, message["content"] = split.split(c.text)
                message["reasoning_content"] = reasoning or None
            if plan is not None:
                message["content"], calls = plan.parse(message["content"])
                if calls:
                    message["tool_calls"] = [call.to_dict() for call in calls]
                reason = tool_finish_reason(plan, calls, reason)
            return {"index": i, "message": message,
                    "logprobs": chat_logprobs(c.logprobs, c.token_ids, top_n) if req.logprobs else None,
                    "finish_reason": reason}
        return await respond(req, requests, params.n, raw, base, chunk_base, chunks, choice)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tokenmill", "max_model_len": engine.max_model_len}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return (await models())["data"][0]

    @app.get("/health")
    async def health():
        if not async_engine.is_alive:
            return JSONResponse(error_body(f"engine loop is not running: {async_engine.error!r}", "server_error"),
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            ids = (await asyncio.to_thread(chat_prompt, req.messages))["prompt_token_ids"]
        else:
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        vocab = engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    return app
