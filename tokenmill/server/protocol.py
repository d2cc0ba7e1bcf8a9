"""OpenAI-compatible request bodies (pydantic) and their translation to SamplingParams.

Pydantic checks types; SamplingParams checks ranges (and names the field); both end up as
HTTP 400 with an OpenAI-style error body. Unknown fields are ignored, as OpenAI's API does;
known ones that tokenmill does not implement (best_of, suffix, vLLM's use_beam_search, tools in
completions, a request's chat_template) get a 400 rather than an answer that silently ignores them.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator
from pydantic.fields import FieldInfo

from tokenmill.sampling_params import MAX_JSON_DEPTH, SamplingParams, check_schema_depth, is_unicode, too_deep

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_ERROR_CHARS = 2000  # of an error's message (error_body)

# A token id: a JSON integer, not a boolean (pydantic's lax int takes true as 1) nor a numeric string.
TokenId = Annotated[int, Strict()]


def body_problem(body) -> str | None:
    """What makes a request body unreadable, or None: objects and arrays nested past
    MAX_JSON_DEPTH, or text that is no unicode (is_unicode: a lone UTF-16 surrogate), named by its
    place. One loop, not recursion (bodies may nest as deep as JSON lets them), that passes over
    numbers and ASCII text at once (a prompt of 100,000 token ids takes a few milliseconds)."""
    stack: list = [(body, None, 1)]   # (value, where: None or (where its container is, key), its depth)
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            if not is_unicode(value):
                return f"{_place(where)} is not valid unicode text (a lone surrogate such as \\ud800)"
        elif isinstance(value, (dict, list)) and depth > MAX_JSON_DEPTH:
            return str(too_deep("the body"))
        elif isinstance(value, dict):
            stack += [(key, where, depth) for key in value if not key.isascii()]
            stack += [(item, (where, key), depth + 1) for key, item in value.items()
                      if isinstance(item, (str, dict, list))]
        elif isinstance(value, list):
            stack += [(item, (where, k), depth + 1) for k, item in enumerate(value)
                      if isinstance(item, (str, dict, list))]
    return None


def _place(where) -> str:
    """A body_problem place, (where its container is, key) down from None, as "a.0.b"."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(str(key).encode("utf-8", "backslashreplace").decode())
    return ".".join(reversed(keys)) or "the body"


def takes_null(annotation) -> bool:
    """Whether a field's type admits None (`X | None`, Optional[X], None itself)."""
    return annotation is None or annotation is type(None) or type(None) in get_args(annotation)


def null_is_default(field: FieldInfo) -> bool:
    """Whether null for this field means its default: an optional field whose type has no null."""
    return not field.is_required() and not takes_null(field.annotation)


def schema_with_nulls(schema: dict, model: type[BaseModel]) -> None:
    """A request's JSON schema as APIRequest reads it: null allowed where it means the default."""
    for name, prop in schema.get("properties", {}).items():
        field = model.model_fields.get(name)
        if field is not None and null_is_default(field):
            shown = {key: prop.pop(key) for key in ("title", "default", "description") if key in prop}
            schema["properties"][name] = {"anyOf": [dict(prop), {"type": "null"}], **shown}


class APIRequest(BaseModel):
    """A request body: unknown fields ignored, as OpenAI's API does; nested at most MAX_JSON_DEPTH
    deep; its text valid unicode; null for an optional field whose type has no null (n, stream,
    echo...) meaning its default, as OpenAI's clients send it and vLLM takes it (the schema says so
    too)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=schema_with_nulls)

    @model_validator(mode="before")
    @classmethod
    def _readable(cls, data):
        problem = body_problem(data)
        if problem is not None:
            raise ValueError(problem)
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or not null_is_default(fields[key])}


class StreamOptions(APIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, each chunk carries its choice's usage so far


class SamplingFields(APIRequest):
    """The sampling fields both endpoints share (OpenAI's, plus vLLM's common extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[TokenId] | None = None
    truncate_prompt_tokens: int | None = None
    priority: Annotated[int, Strict()] = 0  # (true is no priority)
    deadline: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # seconds from arrival, for edf
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys: token ids as strings
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    bad_words: list[str] | None = None
    kv_transfer_params: dict | None = None  # disaggregated prefill/decode (vLLM's): passed to the KV connector
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and top-n (not streamed)
    # vLLM's, for clients that train on the tokens (RL): the prompt's and output's token ids beside
    # the text, and logprobs' tokens as "token_id:ID" (a piece of a character has no text of its own)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    cache_salt: str | None = None  # vLLM's: cached prompt blocks are shared only between requests of one salt
    request_id: str | None = None  # vLLM's: the answer's id (after its 'cmpl-'); an X-Request-Id header wins
    # known but not implemented: a request that sets them gets a 400 (see unsupported)
    best_of: int | None = None
    suffix: str | None = None
    use_beam_search: bool = False  # vLLM's

    def unsupported(self) -> str | None:
        """The first field set to something tokenmill does not implement, or None."""
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.use_beam_search:
            return "use_beam_search"
        return "suffix" if self.suffix else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int | None,
                        prompt_logprobs: int | None = None):
        """SamplingParams from the request; ValueError (naming the field) for out-of-range values."""
        field = self.unsupported()
        if field is not None:
            raise ValueError(f"{field} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.prompt_logprobs is not None:  # (scored with the larger top-n when echo scores the prompt too)
            if self.stream:
                raise ValueError("prompt_logprobs is not available with stream=true")
            if self.prompt_logprobs < 0:  # checked here: the max below would hide it from SamplingParams
                raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
            prompt_logprobs = max(self.prompt_logprobs, prompt_logprobs or 0)
        values = {
            "n": self.n, "max_tokens": max_tokens if max_tokens is not None else default_max_tokens,
            "min_tokens": self.min_tokens, "seed": self.seed, "stop": self.stop if self.stop is not None else [],
            "stop_token_ids": self.stop_token_ids or [], "ignore_eos": self.ignore_eos, "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs, "logit_bias": self._logit_bias(),
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "allowed_token_ids": self.allowed_token_ids, "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "structured_outputs": self._structured_outputs(), "bad_words": self.bad_words,
            "kv_transfer_params": self.kv_transfer_params,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return SamplingParams(**values)

    def _structured_outputs(self) -> dict | None:
        """The one structured-output constraint the request sets, as StructuredOutputsParams fields."""
        given = {}
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type", "text")
            if kind == "json_object":
                given["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise ValueError("response_format needs json_schema.schema, a JSON schema object")
                if not isinstance(spec.get("name"), str) or not spec["name"]:
                    raise ValueError("response_format.json_schema needs a name, as OpenAI's API does")
                check_schema_depth(spec["schema"], "response_format.json_schema.schema")
                given["response_format"] = {"json": spec["schema"]}
            elif kind != "text":
                raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        if isinstance(self.guided_json, dict):
            check_schema_depth(self.guided_json, "guided_json")
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{kind}") is not None:
                given[f"guided_{kind}"] = {kind: getattr(self, f"guided_{kind}")}
        if len(given) > 1:
            raise ValueError(f"structured_outputs takes one constraint, got {', '.join(given)}")
        return next(iter(given.values()), None)

    def constraint_field(self) -> str:
        """The field the request's structured-output constraint came in (response_format,
        structured_outputs or a guided_* one): the `param` of an error about it."""
        fmt = self.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            return "response_format"
        named = [name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                   "guided_grammar") if getattr(self, name) is not None]
        return named[0] if named else "structured_outputs"

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): value for token, value in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)!r}") from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = None
    echo: bool = False
    max_tokens: int | None = 16
    add_special_tokens: bool = True  # vLLM's: false for a text that holds its BOS already (a rendered chat)
    tools: list | None = None  # a chat feature: a 400 here

    def unsupported(self) -> str | None:
        return super().unsupported() or ("tools" if self.tools else None)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in v):
            raise ValueError("prompt must not contain empty prompts")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v


class ChatRendering(APIRequest):
    """The fields that shape how messages render through the chat template: chat's, and also
    /tokenize's, so that its count of messages is chat's prompt."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message left open: the model writes on
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None  # the template's own variables (Qwen3's enable_thinking)
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # to the chat template (gpt-oss's reads it)

    def template_kwargs(self) -> dict | None:
        """The template's variables: chat_template_kwargs, and reasoning_effort for a template that
        reads it (gpt-oss's "Reasoning: low")."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


class ChatCompletionRequest(SamplingFields, ChatRendering):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None  # known, refused: a template is code, and the server runs the model's
    echo: bool = False  # vLLM's (the last message's text before the answer): known, not implemented
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" makes one call
    functions: list | None = None  # OpenAI's deprecated form of tools: known, refused (tools serve it)
    function_call: str | dict | None = None  # (and of tool_choice)

    def unsupported(self) -> str | None:
        return (super().unsupported() or ("chat_template" if self.chat_template is not None else None)
                or ("echo" if self.echo else None) or ("functions" if self.functions else None)
                or ("function_call" if self.function_call not in (None, "none") else None))


class TokenizeRequest(ChatRendering):
    """POST /tokenize: a prompt, or messages rendered as the chat endpoint renders them (vLLM's fields)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # a prompt's (a chat template writes its own)
    messages: list[ChatMessage] | None = None
    return_token_strs: bool = False  # the tokens' own strings too (the vocabulary's, as "Ġword")


class DetokenizeRequest(APIRequest):
    model: str | None = None
    tokens: list[TokenId]


class EmbeddingRequest(APIRequest):
    """POST /v1/embeddings: OpenAI's fields, vLLM's `normalize`, and tokenmill's `pooling`."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: Literal["last", "mean", "cls"] | None = None  # the last token's hidden state, the mean of the
                                   # prompt's, or the first token's; None: the model's default (last for a
                                   # generative model, an encoder checkpoint's own)
    normalize: bool | None = None  # L2-normalise the vector; None: the model's default
    truncate_prompt_tokens: int | None = None  # vLLM's: embed an input's first k tokens (-1: a context's worth)
    request_id: str | None = None  # vLLM's: the answer's id (after its 'embd-'); an X-Request-Id header wins

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v):
        if len(v) == 0:
            raise ValueError("input must not be empty")
        if isinstance(v, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in v):
            raise ValueError("input must not contain empty inputs")
        return v

    def inputs(self) -> list[str | list[int]]:
        """One entry per vector: a string or a list of token ids."""
        v = self.input
        return [v] if isinstance(v, str) or all(isinstance(x, int) for x in v) else list(v)


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "server_error"]


def error_body(message: str, type_: ErrorType = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object. A message past MAX_ERROR_CHARS is cut: one that quotes a bad value
    back (a 3 MB role) would otherwise be as big as the request."""
    if len(message) > MAX_ERROR_CHARS:
        message = f"{message[:MAX_ERROR_CHARS]}... ({len(message) - MAX_ERROR_CHARS:,} more characters)"
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
