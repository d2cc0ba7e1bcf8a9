"""POST /tokenize and /detokenize: the server's tokenizer, for clients that count or build
token ids themselves. Messages are rendered as the chat endpoint renders them (the same
rendering fields, protocol.ChatRendering), so the count is the prompt's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tokenmill.server.errors import APIError, check_model
from tokenmill.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.server.serving_chat import check_continuation, render_request
from tokenmill.server.tools import plan_tools


@dataclass
class TokenizationHandler:
    tokenizer: object
    model_name: str      # the name clients send
    max_model_len: int   # the engine's context length, returned with the count
    vocab_size: int      # token ids to detokenize are below it
    harmony: bool = False  # the chat endpoint renders messages for harmony (gpt-oss)

    async def tokenize(self, req: TokenizeRequest):
        # the ids of a prompt, or of messages rendered through the chat template (on a worker
        # thread: a long prompt would stall every open stream)
        check_model(req.model, self.model_name)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            check_continuation(req)
            try:  # tools as chat checks them (a malformed one is a 400 there too)
                plan_tools(req.tools, "none", None)
            except ValueError as exc:
                raise APIError(400, str(exc), param="tools") from None
            ids = (await asyncio.to_thread(render_request, self.tokenizer, req, self.harmony))["prompt_token_ids"]
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt,
                                          add_special_tokens=req.add_special_tokens)
        out = {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}
        return {**out, "token_strs": self.tokenizer.convert_ids_to_tokens(ids)} if req.return_token_strs else out

    async def detokenize(self, req: DetokenizeRequest):
        check_model(req.model, self.model_name)
        if any(t < 0 or t >= self.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {self.vocab_size})", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}
