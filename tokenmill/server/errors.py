"""The server's errors, each answered with an OpenAI-style error body.

Handlers raise APIError with the status and the body's fields (`context_length_error` builds
OpenAI's answer to a prompt past the context, for every generating endpoint);
`add_error_handlers` turns it, the engine loop's death (503), a new request while the server
drains at shutdown (503), pydantic's validation errors (400)
and Starlette's own HTTP errors (404, 405, ...) into JSON responses of the same shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.async_engine import EngineDeadError, EngineDrainingError
from tokenmill.server.protocol import error_body

if TYPE_CHECKING:
    from tokenmill.input_processor import ContextLengthError


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def check_model(requested: str | None, served: str) -> None:
    """A request naming a model (None: names none) must name the one this server serves: a 404
    with OpenAI's type and code for it (invalid_request_error, model_not_found), and vLLM's param."""
    if requested is not None and requested != served:
        raise APIError(404, f"the model '{requested}' does not exist (this server serves '{served}')",
                       param="model", code="model_not_found")


def context_length_error(exc: ContextLengthError, input_name: str, generates: bool = True) -> APIError:
    """A prompt past the model's context as OpenAI answers it: a 400 with code
    context_length_exceeded, `param` the endpoint's input (`input_name`: "prompt", "messages",
    "input"), and a message that opens with "This model's maximum context length is N tokens",
    which clients look for before they trim the conversation and retry: LiteLLM raises its
    ContextWindowExceededError on those words, LangChain its ContextOverflowError on the code in
    the error's text or on "prompt is too long" (the openai SDK's error text is the message alone,
    without the code). `generates` false: an input that makes no output (embeddings), which may
    fill the context: its message says nothing of room for output."""
    head = f"This model's maximum context length is {exc.max_model_len} tokens. However, "
    if not generates:
        message = (f"{head}your {input_name} resulted in {exc.prompt_tokens} tokens. "
                   f"Please reduce the length of the {input_name}.")
    elif exc.max_tokens is None:
        message = (f"{head}your {input_name} resulted in {exc.prompt_tokens} tokens: the prompt is too long, with "
                   f"no room for output. Please reduce the length of the {input_name}.")
    else:
        message = (f"{head}you requested {exc.prompt_tokens + exc.max_tokens} tokens ({exc.prompt_tokens} in the "
                   f"{input_name}, {exc.max_tokens} in the completion): the prompt is too long for that completion. "
                   f"Please reduce the length of the {input_name} or the completion's maximum tokens.")
    return APIError(400, message, param=input_name, code="context_length_exceeded")


def _is_type_name(part) -> bool:
    return part in ("str", "int", "float", "bool") or "[" in str(part)


async def _api_error(_, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)


async def _engine_dead(_, exc: EngineDeadError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), "server_error"), status_code=503)


async def _draining(_, exc: EngineDrainingError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), "server_error", code="server_shutting_down"), status_code=503)


async def _validation_error(_, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    # the location without "body" and the union members pydantic names ("prompt.str", "list[int]")
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_name(p)]
    message = first.get("msg", "invalid request")
    if first.get("type") == "value_error" and "error" in first.get("ctx", {}):
        message = str(first["ctx"]["error"])  # a validator's own text, without pydantic's "Value error, "
    if first.get("type") == "json_invalid":
        message = "request body is not valid JSON"
        loc = []
    elif first.get("type") == "missing" and not loc:  # no body at all
        message = "request body is missing: a JSON object is expected"
    elif loc:
        message = f"{'.'.join(loc)}: {message}"
    return JSONResponse(error_body(message, param=".".join(loc) or None), status_code=400)


async def _http_error(_, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors in the OpenAI shape, with their headers (a 405's Allow)."""
    return JSONResponse(error_body(str(exc.detail), "not_found_error" if exc.status_code == 404
                                   else "invalid_request_error"), status_code=exc.status_code, headers=exc.headers)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(EngineDeadError, _engine_dead)
    app.add_exception_handler(EngineDrainingError, _draining)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
