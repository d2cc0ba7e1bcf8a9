"""The OpenAPI schema (/openapi.json) as the server answers: its error statuses and content types.

FastAPI documents a 422 with its own body for every route that takes input; this server answers
invalid input with a 400 in OpenAI's error shape (errors.py) instead. Routes declare the error
statuses they can send with `error_responses`, streams their SSE content type with
`STREAM_RESPONSES`; `OpenAIStyleAPI` drops the 422s and adds the 401 of the paths the API key
guards.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every error's body: {"error": {"message", "type", "param", "code"}}, as OpenAI's API sends."""

    error: ErrorDetail


ERROR_DESCRIPTIONS = {
    400: "Invalid request (a body that is no JSON, a field of the wrong type or out of range)",
    401: "Missing or wrong API key",
    404: "The model named is not the one served",
    413: "Request body over the server's limit",
    500: "The engine step that ran the request failed",
    503: "The engine loop is not running",
}

# One server-sent event, as OpenAPI 3.1 reads an event stream's schema: its fields ("event" is "message"
# when the server names none).
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}}}
# Generating routes answer JSON, or with "stream": true server-sent events ("data: {...}" lines, then "data: [DONE]";
# the Responses API's: "event: TYPE" and "data: {...}" lines).
STREAM_RESPONSES = {200: {"description": "The completion (JSON), or its stream of chunks (server-sent events)",
                          "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """FastAPI `responses=` entries for these error statuses, each with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


class OpenAIStyleAPI(FastAPI):
    """FastAPI whose schema has no 422 (the server answers 400) and documents a 401 on the paths
    starting with `key_protected` (those the API key guards; none without a key)."""

    key_protected: tuple[str, ...] = ()

    def openapi(self) -> dict:
        schema = super().openapi()  # cached by FastAPI; the changes below are the same each time
        unauthorized = {"description": ERROR_DESCRIPTIONS[401],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if self.key_protected and path.startswith(self.key_protected):
                    operation["responses"]["401"] = unauthorized
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        return schema
