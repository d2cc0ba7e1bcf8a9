"""Per-request sampling and stopping parameters, validated when built.

Every invalid value raises ValueError with a message that names the field, so
the server can turn it into an HTTP 400 without guessing which input was bad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tokenmill.pooling_params import check_truncation

MAX_N = 128            # completions per prompt: each is a request of its own
_GREEDY_BELOW = 1e-5   # temperatures below this sample greedily
_FLOAT32_TINY, _FLOAT32_MAX = 1.1754944e-38, 3.4028235e38  # the sampler's float32 positive range
MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]; past it sampling is near uniform
# JSON schemas (structured outputs, tool parameters) nest objects and arrays at most this deep:
# OpenAI's structured outputs take 10 levels of nested schemas, about 20 of JSON
MAX_SCHEMA_DEPTH = 64
# llguidance parses a choice as one grammar row of its strings and one more item, and refuses rows of
# more than 2,000 items (its max_items_in_row), after compiling them: 60,000 choices took 15 s.
MAX_CHOICES = 1999
# A request's JSON (its body, a tool call's arguments) nests at most this deep. Python's own decoder
# stops near 1,000 levels on 3.11 and near 8,000 on 3.12 and 3.13, so without a limit of our own the
# same body was a 400 on one version and served on another.
MAX_JSON_DEPTH = 512


def is_unicode(text: str) -> bool:
    """Whether a str is unicode text: no lone UTF-16 surrogate, which JSON's "\\ud800" parses into
    and Python makes of a shell's bytes that were no UTF-8. Tokenizers refuse such text, and a
    response quoting it cannot be encoded. ASCII, the usual case, is checked at once."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def nesting_depth(value, limit: int) -> int:
    """How deep objects (dicts) and arrays (lists) nest in `value` (a scalar: 0), counted up to
    limit + 1 at most. A loop, not recursion: a body may nest as deep as JSON lets it."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= limit:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]
    return deepest


def too_deep(where: str, limit: int = MAX_JSON_DEPTH) -> ValueError:
    """The error for JSON at `where` nested past `limit` levels."""
    return ValueError(f"{where} nests objects and arrays deeper than {limit} levels")


def check_depth(value, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """too_deep(where, limit) raised for `value` nested past `limit`."""
    if nesting_depth(value, limit) > limit:
        raise too_deep(where, limit)


def check_schema_depth(schema, where: str) -> None:
    """ValueError naming `where` for a JSON schema nested past MAX_SCHEMA_DEPTH: compiling one
    (and closing its objects, structured.py) recurses once per level."""
    check_depth(schema, where, MAX_SCHEMA_DEPTH)


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's StructuredOutputsParams; exactly one field set).
    The engine turns it into a grammar (structured.py); only its shape is checked here."""

    json: dict | str | None = None      # a JSON schema (a dict, or the schema as JSON text)
    regex: str | None = None            # the whole output matches it
    choice: list[str] | None = None     # the output is one of these strings
    grammar: str | None = None          # a Lark grammar (or llama.cpp's GBNF, with "::=")
    json_object: bool | None = None     # any JSON object (OpenAI's response_format json_object)
    # vLLM's option of this name: True (tokenmill's default, as clients mean a schema and as vLLM's
    # default backend reads it) gives an object schema no properties beyond those it declares unless
    # it allows them itself; False follows JSON Schema's default, which admits any other key
    disable_additional_properties: bool = True

    def __post_init__(self) -> None:
        kinds = {"json": ((dict, str), "a JSON schema"), "regex": (str, "a string"),
                 "choice": (list, "a list of non-empty strings"), "grammar": (str, "a string"),
                 "json_object": (bool, "a boolean")}
        given = [name for name in kinds if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(kinds)}, got "
                             f"{', '.join(given) or 'none'}")
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError(f"structured_outputs.disable_additional_properties must be a boolean, "
                             f"got {self.disable_additional_properties!r}")
        name = given[0]
        value = getattr(self, name)
        types, what = kinds[name]
        if (not isinstance(value, types) or (isinstance(value, (str, list)) and not value)
                or (name == "choice" and not all(isinstance(c, str) and c for c in value))):
            raise ValueError(f"structured_outputs.{name} must be {what}, got {value!r}")
        if name == "json":
            check_schema_depth(value, "structured_outputs.json")
        if name == "choice" and len(value) > MAX_CHOICES:  # (refused at once, not after seconds of compiling)
            raise ValueError(f"structured_outputs.choice takes at most {MAX_CHOICES:,} strings, got {len(value):,}")

    @classmethod
    def from_dict(cls, fields: dict) -> "StructuredOutputsParams":
        unknown = sorted(set(fields) - {"json", "regex", "choice", "grammar", "json_object",
                                        "disable_additional_properties"})
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields: {', '.join(unknown)}")
        return cls(**fields)


@dataclass
class SamplingParams:
    n: int = 1                          # completions per prompt (fanned out as separate requests)
    max_tokens: int | None = 16         # None: up to the model's context length
    min_tokens: int = 0                 # EOS and stop tokens are masked until this many are out
    temperature: float = 1.0            # 0 (or below 1e-5, as in vLLM) means greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0     # > 1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0       # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None             # a per-request generator: same seed, same text in any batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None         # top-n logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (0: only the prompt's own);
                                        # such a request computes its whole prompt (no prefix cache)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    num_speculative_tokens: int | None = None  # this request's cap on drafts per step (0: never)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
                                        # (OpenAI's range, -100..100: +-100 forces or bans a token)
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's, e.g. for labels)
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last k tokens (vLLM's; -1: the context's worth)
    structured_outputs: StructuredOutputsParams | dict | None = None  # JSON schema, regex, choice or
                                        # grammar the output must follow (such a request does not speculate)
    bad_words: list[str] | None = None  # words never generated (vLLM's): each word's last token is
                                        # banned wherever the output ends in the tokens before it
    output_kind: str = "cumulative"     # "final": the engine reports the request only once it ended
                                        # (vLLM's FINAL_ONLY; LLM.generate's), no output built per step
    kv_transfer_params: dict | None = None  # disaggregated prefill/decode (kv_connector.py): vLLM's
                                        # do_remote_decode / do_remote_prefill and the remote_* fields

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check_int("n", minimum=1)
        if self.max_tokens is not None:
            self._check_int("max_tokens", minimum=1)
        self._check_int("min_tokens", minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        self._check_float("temperature", 0.0, MAX_TEMPERATURE, note=" (OpenAI's range)")
        if self.temperature < _GREEDY_BELOW:  # logits / T would overflow float32 to inf, and NaN
            self.temperature = 0.0
        self._check_float("top_p", 0.0, 1.0, low_open=True)
        self._check_int("top_k", minimum=0)
        self._check_float("min_p", 0.0, 1.0)
        self._check_float("repetition_penalty", 0.0, None, low_open=True)
        # The sampler holds these in float32, where a top_p of 1e-300 is 0 (its kernel refused the
        # whole step) and a penalty of 1e-46 divides by 0: the nearest float32 keeps the meaning.
        self.top_p = max(self.top_p, _FLOAT32_TINY)
        self.repetition_penalty = min(max(self.repetition_penalty, _FLOAT32_TINY), _FLOAT32_MAX)
        self._check_float("presence_penalty", -2.0, 2.0)
        self._check_float("frequency_penalty", -2.0, 2.0)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 63):  # a torch.Generator's seed
            raise ValueError(f"seed must fit in 64 bits, in [-2^63, 2^63), got {self.seed}")
        if self.output_kind not in ("cumulative", "final"):
            raise ValueError(f"output_kind must be 'cumulative' or 'final', got {self.output_kind!r}")
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.num_speculative_tokens is not None:
            self._check_int("num_speculative_tokens", minimum=0)
        check_truncation(self.truncate_prompt_tokens)
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {bias!r}")
            for token, value in bias.items():  # the first bad entry, named
                if not _is_token_id(token):
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if not (isinstance(value, (int, float)) and not isinstance(value, bool) and -100 <= value <= 100):
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for "
                                     f"token {token}")
            self.logit_bias = {t: float(v) for t, v in bias.items()} or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(map(_is_token_id, ids)):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            self.allowed_token_ids = sorted(set(ids))
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {self.kv_transfer_params!r}")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None and not (isinstance(self.bad_words, (list, tuple)) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {self.structured_outputs!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                self._check_int(name, minimum=0)
                if getattr(self, name) > 20:
                    raise ValueError(f"{name} must be <= 20, got {getattr(self, name)}")

    def _check_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")

    def _check_float(self, name: str, low: float, high: float | None, low_open: bool = False, note: str = "") -> None:
        value = getattr(self, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if value < low or (low_open and value == low) or (high is not None and value > high):
            interval = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
            raise ValueError(f"{name} must be in {interval}{note}, got {value}")
        setattr(self, name, float(value))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def edits_logits(self) -> bool:
        """logit_bias, allowed_token_ids, structured outputs or bad_words change the model's logits
        before sampling (so speculative decoding, which verifies against the logits, leaves it alone)."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None
                or self.structured_outputs is not None or bool(self.bad_words))

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    def for_sample(self, j: int) -> "SamplingParams":
        """The j-th of n samples as a request of its own: n = 1, and seed + j (wrapped within 64
        bits: a seed of 2^63 - 1 with n = 2 is valid) when seeded."""
        seed = None if self.seed is None else (self.seed + j + (1 << 63)) % (1 << 64) - (1 << 63)
        return self.clone(n=1, seed=seed)
