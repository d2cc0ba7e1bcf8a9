"""Prompts and sampling parameters -> a validated Request, or a ValueError for anything the
engine could never serve.

It touches no engine state (only the tokenizer, the model's limits and the grammar compiler),
so the server calls it on a thread of its own and answers 400s without waiting for a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.pooling_params import PoolingParams
from tokenmill.request import Request
from tokenmill.sampler import bad_words_token_ids
from tokenmill.sampling_params import SamplingParams, is_unicode
from tokenmill.structured import GrammarCompiler

Prompt = str | list[int] | dict


class FieldError(ValueError):
    """A value the engine refuses in one named field of the request (the API error's `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ContextLengthError(FieldError):
    """A prompt that leaves no room for output in the model's context, or whose max_tokens would
    run past it; its numbers let the server answer in OpenAI's words (errors.context_length_error)."""

    def __init__(self, max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> None:
        self.max_model_len, self.prompt_tokens, self.max_tokens = max_model_len, prompt_tokens, max_tokens
        if max_tokens is None and prompt_tokens > max_model_len:  # (an embedding's prompt may fill the context)
            super().__init__("prompt", f"prompt has {prompt_tokens} tokens, more than the model's context length "
                                       f"({max_model_len})")
        elif max_tokens is None:
            super().__init__("prompt", f"prompt has {prompt_tokens} tokens but the model's context length is "
                                       f"{max_model_len}: no room for any output")
        else:
            super().__init__("max_tokens", f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) "
                                           f"exceeds the model's context length ({max_model_len})")


def cache_salt(prompt: Prompt) -> str | None:
    """A dict prompt's "cache_salt" (vLLM's): its blocks are shared only with prompts of the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise FieldError("cache_salt", f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


@dataclass
class InputProcessor:
    tokenizer: object
    vocab_size: int                  # the logits' width: every token id must lie below it
    eos_token_ids: frozenset[int]
    max_model_len: int               # prompt + output
    scheduling_policy: str
    grammars: GrammarCompiler
    encoder: str | None = None       # an encoder's architecture ("bert"): it serves embeddings only
    default_pooling: PoolingParams = PoolingParams()  # an embedding request's, unless it says otherwise

    def tokenize_prompt(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) from a string, a list of token ids, or {"prompt_token_ids": [...]}; a
        text with the special tokens its tokenizer adds (a BOS), or without them."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not is_unicode(prompt):  # bytes that were no UTF-8 (a shell argument, stdin)
                raise ValueError("prompt is not valid UTF-8 text")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                     arrival_time: float | None = None, priority: int = 0,
                     deadline: float | None = None, fit_to_context: bool = False) -> Request:
        """Tokenize and validate. fit_to_context: a max_tokens past the context ends the output
        there instead (the offline API's choice, as vLLM's; the server answers 400, as vLLM's and
        OpenAI's do). The request's timeline starts at arrival_time (default: now, before
        tokenizing) and records when tokenizing and validating ended."""
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.check_generates()
        params = params or SamplingParams()
        if priority and self.scheduling_policy != "priority":  # as vLLM: not silently ignored
            raise FieldError("priority", f"priority {priority} needs scheduling_policy 'priority' "
                             f"(this engine runs '{self.scheduling_policy}')")
        if deadline is not None and self.scheduling_policy != "edf":
            raise FieldError("deadline", f"a deadline needs scheduling_policy 'edf' "
                             f"(this engine runs '{self.scheduling_policy}')")
        self._check_limits(params)
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        keep = self._truncation(params.truncate_prompt_tokens, reserve=params.max_tokens or 1)
        if keep is not None and len(ids) > keep:  # its last tokens, as vLLM truncates a prompt to generate from
            text, ids = None, ids[-keep:]
        self._check_token_ids(ids, params)
        bad_words = [seq for seq in bad_words_token_ids(self.tokenizer, params.bad_words or [])
                     if all(t < self.vocab_size for t in seq)]  # (a word with a token past the logits is never sampled)
        self._check_allowed_tokens(params, {seq[0] for seq in bad_words if len(seq) == 1})
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ContextLengthError(self.max_model_len, len(ids), None)
        if params.max_tokens is not None and params.max_tokens > room and not fit_to_context:
            raise ContextLengthError(self.max_model_len, len(ids), params.max_tokens)
        try:
            grammar = (self.grammars.compile(params.structured_outputs)
                       if params.structured_outputs is not None else None)
        except ValueError as exc:  # the server names the request's own field for it (response_format, ...)
            raise FieldError("structured_outputs", str(exc)) from None
        request = Request(request_id=request_id, prompt_token_ids=ids, params=params,
                          max_tokens=min(params.max_tokens or room, room), eos_token_ids=self.eos_token_ids,
                          prompt=text, priority=priority, deadline=deadline, arrival_time=arrival_time,
                          grammar=grammar, bad_words_token_ids=bad_words, cache_salt=cache_salt(prompt))
        request.timeline.add(time.monotonic(), "tokenized")
        return request

    def check_generates(self) -> None:
        """Refuse generation from an encoder, which has no LM head."""
        if self.encoder is not None:
            raise FieldError("model", f"this model is an encoder ({self.encoder}): it serves embeddings only "
                                      "(LLM.embed, POST /v1/embeddings), not text generation")

    def pooling_params(self, pooling: str | None = None, normalize: bool | None = None,
                       truncate_prompt_tokens: int | None = None) -> PoolingParams:
        """An embedding request's PoolingParams: what it says, the rest from default_pooling."""
        default = self.default_pooling
        return PoolingParams(default.pooling if pooling is None else pooling,
                             default.normalize if normalize is None else normalize, truncate_prompt_tokens)

    def _check_limits(self, params: SamplingParams) -> None:
        """A value SamplingParams cannot check without the model: a top_k past the vocabulary (0
        or -1 keep every token)."""
        if params.top_k > self.vocab_size:
            raise FieldError("top_k", f"top_k must be <= the vocabulary size ({self.vocab_size}), or 0 or -1 "
                                      f"for every token, got {params.top_k}")

    def _truncation(self, truncate: int | None, reserve: int = 0) -> int | None:
        """The tokens truncate_prompt_tokens keeps: -1, as many as leave `reserve` tokens of the
        context for the output (vLLM's); a count past the context is refused, as vLLM refuses it."""
        if truncate is not None and truncate > self.max_model_len:
            raise FieldError("truncate_prompt_tokens", f"truncate_prompt_tokens must be <= the model's context "
                             f"length ({self.max_model_len}), got {truncate}")
        return max(1, self.max_model_len - reserve) if truncate == -1 else truncate

    def make_embedding_request(self, request_id: str, prompt: Prompt, pooling: PoolingParams | None = None,
                               arrival_time: float | None = None) -> Request:
        """Tokenize and validate an embedding request: its prompt only, which may fill the whole
        context (it generates nothing); pooled as default_pooling unless `pooling` is given."""
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        pooling = pooling or self.default_pooling
        keep = self._truncation(pooling.truncate_prompt_tokens)
        if keep is not None and len(ids) > keep:  # its first tokens (vLLM's truncation for embeddings, and
            # sentence-transformers'): a text through the tokenizer, which keeps the special tokens around it
            # (unless they alone are more than `keep`: the tokenizer then cuts nothing)
            from_text = isinstance(prompt, str) or isinstance(prompt, dict) and "prompt_token_ids" not in prompt
            text, ids = None, (encode_truncated(self.tokenizer, text, keep) if from_text else ids)[:keep]
        params = SamplingParams(max_tokens=1)  # (never sampled: the request ends when its prompt has run)
        self._check_token_ids(ids, params)
        if len(ids) > self.max_model_len:
            raise ContextLengthError(self.max_model_len, len(ids), None)
        request = Request(request_id=request_id, prompt_token_ids=ids, params=params, max_tokens=0,
                          eos_token_ids=self.eos_token_ids, prompt=text, arrival_time=arrival_time,
                          pooling=pooling, bidirectional=self.encoder is not None, cache_salt=cache_salt(prompt))
        request.timeline.add(time.monotonic(), "tokenized")
        return request

    def _check_token_ids(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.vocab_size
        for field, name, tokens in (("prompt", "prompt token ids", ids),
                                    ("stop_token_ids", "stop_token_ids", params.stop_token_ids),
                                    ("logit_bias", "logit_bias token ids", params.logit_bias or ()),
                                    ("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids or ())):
            if not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
                raise FieldError(field, f"{name} must be integers in [0, {vocab})")

    def _check_allowed_tokens(self, params: SamplingParams, banned_always: set[int]) -> None:
        """allowed_token_ids must leave a token that the sampler does not ban."""
        if params.allowed_token_ids is None:
            return
        allowed = set(params.allowed_token_ids)
        if allowed <= banned_always:
            raise ValueError("allowed_token_ids holds only tokens that bad_words bans")
        # under min_tokens the sampler also bans EOS (ignore_eos too, as vLLM) and the stop tokens
        if params.min_tokens and allowed <= banned_always | set(params.stop_token_ids) | set(self.eos_token_ids):
            raise ValueError("allowed_token_ids holds only stop tokens and tokens that bad_words bans, "
                             "which min_tokens forbids at first")


def encode_truncated(tokenizer, text: str, keep: int) -> list[int]:
    """`tokenizer.encode(text, truncation=True, max_length=keep)` without setting a fast tokenizer's
    truncation, which is state the Rust tokenizer shares between threads: a prompt encoded on
    another thread meanwhile would be cut to `keep` too. The text's own tokens are cut to leave
    room for the special tokens the tokenizer adds, as its truncation does (none cut when those
    alone are more than `keep`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer truncates per call
        return tokenizer.encode(text, truncation=True, max_length=keep)
    encoding = backend.encode(text, add_special_tokens=False)
    special = backend.num_special_tokens_to_add(False)
    if keep >= special:
        encoding.truncate(keep - special)
    return backend.post_process(encoding, None, True).ids
