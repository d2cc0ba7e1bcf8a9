"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    POST /v1/completions, /v1/chat/completions    (streaming with SSE, or whole)
    POST /v1/embeddings                           (pooled hidden states of the loaded model; an
                                                  encoder's only endpoint that runs requests)
    GET  /v1/models, /health (and vLLM's /ping), /metrics, /version; POST /tokenize, /detokenize
    GET  /v1/requests/{id}                        (a response's request timelines)
    GET  /dashboard, /dashboard/state             (a live page of the scheduler, and its data)
    POST /v1/responses                            (OpenAI's Responses API, serving_responses.py)
    GET, DELETE /v1/responses/{id}                (a stored response)

Every bad input gets an OpenAI-style error body: 400 for invalid requests (and for a Host
header the server does not answer for, access.py), 401 for a missing or wrong API key, 404
for an unknown model, 413 for an oversized body, 500 when the step that ran a request failed
(streams get an error event instead). A client that disconnects has its requests aborted.

The endpoints live by family in module-level handlers, each holding what it uses:
serving_completion.py, serving_chat.py, serving_embeddings.py, serving_models.py and
serving_tokenization.py (those that run requests share serving.py; errors.py answers every
error). `create_app` builds the handlers and wires their routes.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from tokenmill import __version__
from tokenmill.async_engine import AsyncLLMEngine
from tokenmill.cpu_kernels import this_cpu
from tokenmill.server.access import FullApiKeyMiddleware, HostAllowListMiddleware, add_cors
from tokenmill.server.dashboard import DashboardHandler
from tokenmill.server.errors import add_error_handlers
from tokenmill.server.harmony import is_harmony
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.openapi import STREAM_RESPONSES, OpenAIStyleAPI, error_responses
from tokenmill.server.otel import RequestSpans
from tokenmill.server.reasoning import REASONING_PARSERS, ReasoningParser
from tokenmill.server.request_log import RequestLog, RequestLogHandler
from tokenmill.server.serving import ServingEngine
from tokenmill.server.serving_chat import ChatHandler
from tokenmill.server.serving_completion import CompletionHandler
from tokenmill.server.serving_embeddings import EmbeddingHandler, embeddings_only
from tokenmill.server.serving_models import ModelsHandler
from tokenmill.server.serving_responses import ResponsesHandler, ResponseStore
from tokenmill.server.serving_tokenization import TokenizationHandler
from tokenmill.server.step_history import StepHistory
from tokenmill.server.streaming import AccessLogMiddleware, ApiKeyMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from tokenmill.server.tool_detection import tool_parser_of
from tokenmill.server.tools import HARMONY, PARSERS

logger = logging.getLogger("tokenmill.server")


def _writes_harmony(engine, tool_call_parser: str | None, reasoning_parser: str | None) -> bool:
    """Whether the model's outputs are read as harmony (gpt-oss's messages), after checking the
    parsers' names: asked for, or a harmony model's default when no parser is named."""
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
    if reasoning_parser is not None and reasoning_parser not in (*REASONING_PARSERS, HARMONY):
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or {HARMONY}, "
                         f"got {reasoning_parser!r}")
    harmony = reasoning_parser == HARMONY or (reasoning_parser is None and tool_call_parser is None
                                              and is_harmony(engine.model_config.architecture))
    if harmony and tool_call_parser is not None:
        raise ValueError(f"harmony carries its own tool calls: tool_call_parser must be None, got {tool_call_parser!r}")
    return harmony


def create_app(engine, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = 4 * 1024 * 1024, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None, protect_metrics_and_docs: bool = False,
               allowed_hosts: list[str] | None = None, stream_write_timeout: float = 60.0,
               request_log_size: int = 1000, spans: RequestSpans | None = None,
               responses_store_size: int = 1000, allowed_origins: list[str] | None = None) -> FastAPI:
    """The app serving `engine` as `served_model_name`; its engine loop runs while the app does.

    responses_store_size: how many stored /v1/responses answers previous_response_id finds (0: none).
    api_key: required on /v1 routes, /tokenize, /detokenize and /dashboard/state, and with protect_metrics_and_docs
    on /metrics, /docs, /redoc and /openapi.json too. allowed_hosts: the Host header names the app
    answers (any port; None: every name). allowed_origins: the web origins whose pages may call it
    and read its answers (CORS; "*": any; None: none). A stream whose client takes nothing for
    `stream_write_timeout` seconds is ended and its requests aborted. GET /v1/requests/{id} keeps
    the timelines of the last `request_log_size` responses that ended (0: none). spans: where each
    request's OpenTelemetry span goes when it ends (server/otel.py; shut down with the app).
    tool_call_parser: the model's tool-call format (tools.PARSERS) for tool_choice 'auto'; None:
    the one its chat template shows (server/tool_detection.py), if any. reasoning_parser: how
    thinking is split off (REASONING_PARSERS, or "harmony": gpt-oss's messages, calls and all,
    which a gpt-oss model gets without asking)."""
    if protect_metrics_and_docs and api_key is None:
        raise ValueError("protect_metrics_and_docs needs an api_key")
    harmony = _writes_harmony(engine, tool_call_parser, reasoning_parser)
    metrics = ServerMetrics(engine, served_model_name)
    history = StepHistory()
    async_engine = AsyncLLMEngine(engine, listeners=[metrics.on_step, history.on_step]
                                  + ([spans.on_step] if spans else []))

    app = OpenAIStyleAPI(title="tokenmill", version=__version__, lifespan=_lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.spans = spans
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)  # (the last added runs first)
    if api_key is not None:
        key_middleware = FullApiKeyMiddleware if protect_metrics_and_docs else ApiKeyMiddleware
        app.add_middleware(key_middleware, api_key=api_key)
        app.key_protected = key_middleware.PROTECTED
    if allowed_hosts is not None:
        app.add_middleware(HostAllowListMiddleware, hosts=allowed_hosts)
    add_cors(app, allowed_origins)
    app.add_middleware(AccessLogMiddleware, logger=logger)
    app.add_middleware(RequestIdMiddleware)
    add_error_handlers(app)

    if not stream_write_timeout > 0:
        raise ValueError(f"stream_write_timeout must be > 0 seconds, got {stream_write_timeout}")
    request_log = RequestLog(request_log_size)
    serving = ServingEngine(engine, async_engine, write_timeout=stream_write_timeout, request_log=request_log,
                            spans=spans)
    tokenizer = engine.tokenizer
    tool_call_parser = HARMONY if harmony else tool_call_parser or tool_parser_of(tokenizer)
    app.state.tool_call_parser = tool_call_parser
    thinking = ReasoningParser(reasoning_parser) if reasoning_parser is not None and not harmony else None
    completion = CompletionHandler(serving, tokenizer, served_model_name)
    chat = ChatHandler(serving, tokenizer, served_model_name, tool_call_parser, thinking, harmony)
    responses = ResponsesHandler(serving, tokenizer, served_model_name, tool_call_parser,
                                 ResponseStore(responses_store_size), thinking, harmony)
    machine = {"device": str(engine.device), "cpu": this_cpu().as_dict(), "arithmetic": engine.arithmetic}
    models = ModelsHandler(served_model_name, engine.max_model_len, async_engine, metrics, machine)
    tokenization = TokenizationHandler(tokenizer, served_model_name, engine.max_model_len,
                                       engine.model_config.vocab_size, harmony)
    generating = {**STREAM_RESPONSES, **error_responses(400, 404, 413, 500, 503)}
    create_completion, create_chat, create_response = completion.create, chat.create, responses.create
    if engine.model_config.encoder is not None:  # an encoder generates nothing: a 400 that says so
        create_completion = create_chat = create_response = embeddings_only(served_model_name,
                                                                             engine.model_config.architecture)
    app.add_api_route("/v1/completions", create_completion, methods=["POST"], name="completions",
                      responses=generating)
    app.add_api_route("/v1/chat/completions", create_chat, methods=["POST"], name="chat_completions",
                      responses=generating)
    embeddings = EmbeddingHandler(serving, served_model_name, engine.model_config.hidden_size)
    app.add_api_route("/v1/embeddings", embeddings.create, methods=["POST"], name="embeddings",
                      responses=error_responses(400, 404, 413, 500, 503))
    app.add_api_route("/v1/models", models.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", models.model, methods=["GET"], responses=error_responses(404))
    app.add_api_route("/health", models.health, methods=["GET"], responses=error_responses(503))
    # vLLM's /ping (what SageMaker's and other hosts' health checks call): /health's answer
    app.add_api_route("/ping", models.health, methods=["GET", "POST"], responses=error_responses(503))
    app.add_api_route("/metrics", models.metrics, methods=["GET"], name="prometheus_metrics",
                      response_class=PlainTextResponse)
    app.add_api_route("/version", models.version, methods=["GET"])
    app.add_api_route("/v1/requests/{response_id:path}", RequestLogHandler(request_log).request, methods=["GET"],
                      name="request_timeline", responses=error_responses(404))
    app.add_api_route("/v1/responses", create_response, methods=["POST"], name="responses", responses=generating)
    # one route for both methods: a 405 for another method then lists them both in its Allow header
    app.add_api_route("/v1/responses/{response_id}", responses.stored, methods=["GET", "DELETE"],
                      responses=error_responses(404))
    scheduler = engine.scheduler
    dashboard = DashboardHandler(async_engine, scheduler, history, scheduler.config.max_num_seqs,
                                 scheduler.config.max_num_batched_tokens)
    app.add_api_route("/dashboard", dashboard.dashboard, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/state", dashboard.state, methods=["GET"], include_in_schema=False)
    app.add_api_route("/tokenize", tokenization.tokenize, methods=["POST"], responses=error_responses(400, 404, 413))
    app.add_api_route("/detokenize", tokenization.detokenize, methods=["POST"],
                      responses=error_responses(400, 404, 413))
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """The engine loop runs while the app does; at shutdown every request still in flight ends, and
    the engine lets go of its ranks, KV connector and trace file."""
    async_engine = app.state.async_engine
    async_engine.start()
    yield
    async_engine.abort_all()
    async_engine.stop()
    async_engine.engine.close()
    if app.state.spans is not None:
        app.state.spans.shutdown()
