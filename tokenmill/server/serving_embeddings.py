"""POST /v1/embeddings: one vector per input, from the loaded model: a generative one, or an
encoder (a BERT / sentence-transformers directory, models/bert.py).

Each input is an embedding request through the same engine, and the same batches, as generation:
its prompt runs (chunked, from the prefix cache, preempted as any other; an encoder's whole, in one
step), nothing is sampled, and the final hidden states of the prompt are pooled (pooling_params.py):
by default the last token's, L2-normalised, as vLLM does for a generative model used for
embeddings, and as its checkpoint says for an encoder. An encoder generates nothing: the
generating endpoints answer it with a 400 (`embeddings_only`).

Vectors come as JSON numbers, or with encoding_format "base64" as the bytes of little-endian
float32 values (what the openai SDK decodes). The model was not trained for shorter vectors
(matryoshka), so `dimensions` other than its own width is a 400. `truncate_prompt_tokens` (vLLM's)
embeds an input's first k tokens, -1 as many as the context holds; without it an input past the
context is a 400.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.input_processor import ContextLengthError, FieldError
from tokenmill.pooling_params import PoolingParams
from tokenmill.server.errors import APIError, check_model, context_length_error
from tokenmill.server.protocol import EmbeddingRequest
from tokenmill.server.serving import ServingEngine, answer_ids

if TYPE_CHECKING:
    from tokenmill.request import Request as EngineRequest

MAX_INPUTS = 2048  # inputs one request may embed (OpenAI's limit)


@dataclass
class EmbeddingHandler:
    serving: ServingEngine
    model_name: str   # the name clients send
    hidden_size: int  # the vectors' width

    async def create(self, req: EmbeddingRequest, raw: Request) -> JSONResponse:
        check_model(req.model, self.model_name)
        if req.dimensions is not None and req.dimensions != self.hidden_size:
            raise APIError(400, f"dimensions: this model does not support shortening its embeddings "
                                f"(its vectors have {self.hidden_size} dimensions), got {req.dimensions}",
                           param="dimensions")
        inputs = req.inputs()
        if len(inputs) > MAX_INPUTS:
            raise APIError(400, f"input: at most {MAX_INPUTS} inputs per request, got {len(inputs)}", param="input")
        ids = answer_ids("embd", raw, req.request_id)
        try:
            pooling = self.serving.engine.input_processor.pooling_params(req.pooling, req.normalize,
                                                                         req.truncate_prompt_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc), param="truncate_prompt_tokens") from None
        requests = await self._build_requests(inputs, pooling, ids)
        outputs = await self.serving.collect(requests, raw)
        data = [{"object": "embedding", "index": i, "embedding": encode(out.embedding, req.encoding_format)}
                for i, out in enumerate(outputs)]
        tokens = sum(len(out.prompt_token_ids) for out in outputs)
        # (JSONResponse: FastAPI's own encoder would walk every number of every vector)
        return JSONResponse({"id": ids[0], "object": "list", "created": int(time.time()), "model": self.model_name,
                             "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _build_requests(self, inputs: list[str | list[int]], pooling: PoolingParams,
                              ids: tuple[str, str]) -> list[EngineRequest]:
        """One engine request per input, tokenized on a worker thread (a body of a few MB would
        stall every open stream); an input the engine refuses (too long, a token id past the
        vocabulary) is a 400. The requests go into the request log under the response's id (`ids`:
        that id and the requests' prefix, from answer_ids)."""
        arrival, (answer_id, prefix) = time.monotonic(), ids

        def build() -> list[EngineRequest]:
            try:
                return [self.serving.async_engine.make_embedding_request(f"{prefix}-{i}", prompt, pooling, arrival)
                        for i, prompt in enumerate(inputs)]
            except ContextLengthError as exc:
                raise context_length_error(exc, "input", generates=False) from None
            except FieldError as exc:
                raise APIError(400, str(exc), param="input" if exc.field == "prompt" else exc.field) from None
            except ValueError as exc:
                raise APIError(400, f"input: {exc}", param="input") from None
        requests = await asyncio.to_thread(build)
        self.serving.request_log.add(answer_id, requests)
        return requests


def embeddings_only(model_name: str, architecture: str) -> Callable[[Request], Awaitable[None]]:
    """The handler of a generating endpoint (completions, chat, responses) for an encoder, which
    has no LM head: a 400 that says so, whatever the body. (Annotated None rather than NoReturn,
    which FastAPI would try to make a response model of.)"""
    async def refuse(raw: Request) -> None:
        raise APIError(400, f"{model_name} is an embedding model (a {architecture} encoder): it serves "
                            f"POST /v1/embeddings only, not text generation", param="model")
    return refuse


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as JSON numbers ("float") or as base64 of its little-endian float32 bytes ("base64")."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
