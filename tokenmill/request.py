"""A request's state as the scheduler sees it: tokens, progress counter, blocks, timestamps.

Plain Python, no torch: the scheduler and the block pool are tested with exact
expectations and no model.

What happened to it, and when, is its timeline (timeline.py), written by the scheduler.

Progress is one counter, not a phase. `num_computed_tokens` catches up with
`num_tokens` (prompt + generated so far); a step grants it some of the gap.
A prompt is "prefilling" while the gap is large, "decoding" when the gap is the
one token sampled last step; after a recompute preemption the counter drops to
zero and the same rule replays prompt and output. Under async scheduling a token the step in
flight is sampling counts as pending (`num_pending_tokens`) until it reaches the host.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.timeline import Timeline

if TYPE_CHECKING:
    from tokenmill.structured import Grammar


class RequestStatus(enum.IntEnum):
    """Ordered lifecycle: everything above PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3   # EOS, a stop token or a stop string
    FINISHED_LENGTH = 4    # max_tokens or max_model_len
    FINISHED_ABORTED = 5   # the client went away or asked to cancel
    FINISHED_ERROR = 6     # an exception in the step that ran it

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


# The one map from a finished status to the OpenAI `finish_reason`.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                         # resolved: min(params.max_tokens, max_model_len - prompt)
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    priority: int = 0                       # lower is served first under the "priority" policy
    deadline: float | None = None           # monotonic seconds, for the "edf" policy
    arrival_time: float = field(default_factory=time.monotonic)
    grammar: Grammar | None = None          # structured outputs: follows the output (structured.py)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized
    pooling: PoolingParams | None = None    # an embedding request: pools its prompt, samples nothing
    bidirectional: bool = False             # an encoder's request: its prompt attends both ways, so it
                                            # runs whole in one step from position 0 (no cache, no chunks)
    cache_salt: str | None = None           # vLLM's: shares cached blocks only with requests of this salt

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)  # prompt + output, the sequence the model sees
    num_computed_tokens: int = 0            # tokens whose K/V sit in this request's blocks
    num_pending_tokens: int = 0             # async scheduling: sampled by launched steps, not yet on
                                            # the host; the next step reads its input from the device
    num_cached_tokens: int = 0              # prompt tokens served by the prefix cache at admission
    num_external_tokens: int = 0            # prompt tokens whose K/V a KV connector brought in (kv_connector.py)
    kv_transfer_params: dict | None = None  # the connector's word for the client when the request ended
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of this request's full blocks
    num_registered_blocks: int = 0          # leading block_ids already offered to the prefix cache
    num_released_blocks: int = 0            # leading block_ids given back as outside every layer's window
                                            # (each now KVCacheManager.null_block, never read)
    swapped_block_ids: list[int] = field(default_factory=list)  # host blocks while swapped out
    draft_token_ids: list[int] = field(default_factory=list)    # speculative proposal for this step
    draft_probs: object | None = None       # (k, vocab) tensor: the draft model's distributions, if any
    num_preemptions: int = 0
    stop_reason: int | str | None = None    # the stop token id or stop string that ended it
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0         # of the output tokens, when logprobs are asked for
    prompt_logprobs: list[dict[int, float] | None] = field(init=False)  # entry j: prompt token j given
                                            # those before it (None for the first); filled chunk by chunk
    prompt_logprob_ranks: list[int | None] = field(init=False)  # and its rank there (1: the most likely)
    timeline: Timeline = field(init=False)  # events and token times on the monotonic clock (timeline.py)
    embedding: list[float] | None = None    # an embedding request's pooled vector, once its prompt ran

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None else []
        self.prompt_logprob_ranks = [None] if self.params.prompt_logprobs is not None else []
        self.timeline = Timeline()
        self.timeline.add(self.arrival_time, "arrival", prompt_tokens=len(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_remaining_prefill(self) -> int:
        """Tokens still to compute before this request can sample (1 when decoding)."""
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_every_position(self) -> bool:
        """Whether it reads the model's output at every prompt position (prompt logprobs, mean or
        cls pooling) or runs in an encoder: then none of its prompt may come from a cache."""
        return self.bidirectional or self.params.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.needs_every_position)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def drop_output_tokens(self, n: int) -> None:
        """Take back the last n output tokens (and their logprobs): accepted drafts past the token
        that completed a stop string, as if they had come one per step."""
        dropped, self.token_ids = self.token_ids[-n:], self.token_ids[:-n]
        k = len(self.output_logprobs) - self.num_output_tokens  # entries past the kept tokens
        if k > 0:
            entries, self.output_logprobs = self.output_logprobs[-k:], self.output_logprobs[:-k]
            self.cumulative_logprob -= sum(e[t] for t, e in zip(dropped[len(dropped) - k:], entries))

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """How `token`, just appended, ends this request, if it does (the scheduler then finishes
        it). Length first, as in vLLM: a stop token that is also the last one allowed ends the
        request by length (and stays in its text). A completed grammar ends it even under
        min_tokens: no token may follow. A failed one ends it with an error, whatever else held."""
        params = self.params
        if self.grammar is not None and self.grammar.failed:
            return RequestStatus.FINISHED_ERROR
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if self.grammar is not None and self.grammar.is_terminated:  # nothing may follow
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens > params.min_tokens:  # EOS and stop tokens only after min_tokens
            if token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        return None

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if not self.timeline.token_times:
            self.timeline.add(now, "first_token")
        self.timeline.token_times.append(now)
