"""Where a KV connector plugs into the scheduler: disaggregated prefill and decode.

A prefill instance (`kv_role` "prefill") runs a request's prompt and, when the request ends,
keeps the prompt's K/V where a decode instance can read it; the request's output carries
`kv_transfer_params` saying so. A decode instance (`kv_role` "decode") given those params
brings the K/V into the request's blocks at admission and computes only the last prompt token.
The field names are vLLM's, so a proxy written for vLLM pairs tokenmill instances:

    to the prefill instance   {"do_remote_decode": true}                      (with max_tokens 1)
    its answer carries        {"do_remote_prefill": true, "remote_engine_id": ..., "remote_block_ids": [...],
                               "remote_host": ..., "remote_port": ...}
    to the decode instance    that answer's kv_transfer_params

The scheduler calls a connector at these points, all on its own thread (and the engine's close()
calls its close()):

    admission   num_matched_tokens(request, local)  prompt tokens past the local prefix hit whose
                                                    K/V the connector can bring in
                start_load(request, blocks, local, n)  the blocks now hold room for them: begin
                                                    writing the K/V of the n tokens after the first
                                                    `local`; False if it could not (the scheduler
                                                    then computes them here: nothing is lost, only
                                                    time). While a load runs, the request waits
                                                    apart, holding its blocks, and other requests
                                                    run: a transfer never stalls a step.
    each step   finished_loads()                    loads that ended since the last call: request
                                                    id -> whether its blocks now hold the K/V (if
                                                    not, the request computes those tokens here)
                released()                          ids of requests whose held blocks may be freed
                                                    now (the peer read them, or it took too long)
    finish      cancel_load(request_id)             a request that ends while its load runs: when
                                                    this returns nothing more is written into its
                                                    blocks, which are then freed
                on_finish(request, blocks)          the request ends; returns a FinishResult: the
                                                    kv_transfer_params for its output, and whether
                                                    its blocks are held for a peer to read (else
                                                    they are freed right after)

The blocks a load writes are offered to the prefix cache only once it has succeeded, as the
request computes its next chunk.

Held blocks stay out of the pool, owned by the scheduler as before (SchedulerStats counts them),
until the connector names their request in released(); the scheduler asks once per schedule()
(only while it holds some) and while the engine idles. A connector never touches the pool's
bookkeeping itself.

    blocks      [local hit ][external n ][computed by this instance ...]
    counter     num_computed_tokens moves past the hit and the external tokens at admission
"""

from __future__ import annotations

import logging
from typing import Protocol

from tokenmill.config import ModelConfig
from tokenmill.outputs import FinishResult
from tokenmill.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class KVConnector(Protocol):
    def num_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Prompt tokens after the first `num_local_tokens` (the local prefix hit, whole blocks)
        that the connector can supply; 0 for none. The scheduler computes at least the last
        prompt token itself, whatever this says."""
        ...

    def start_load(self, request: Request, block_ids: list[int], num_local_tokens: int,
                   num_external_tokens: int) -> bool:
        """Begin writing the K/V of the request's tokens [num_local_tokens, + num_external_tokens)
        into its blocks (`block_ids`, which cover them); False, with nothing started, if it cannot.
        A started load is named by the next finished_loads() once it ends, however it ends."""
        ...

    def finished_loads(self) -> dict[str, bool]:
        """Loads that ended since the last call: request id -> True if its blocks hold the K/V."""
        ...

    def cancel_load(self, request_id: str) -> None:
        """Stop a started load (its request ended): nothing is written to its blocks after this
        returns, and finished_loads() does not name it."""
        ...

    def on_finish(self, request: Request, block_ids: list[int]) -> FinishResult:
        """The request ended (any reason): the params its output reports, and whether its blocks
        are held (not freed when this returns) until released() names it."""
        ...

    def released(self) -> list[str]:
        """Ids of held requests whose blocks may be freed now; each is named once."""
        ...

    def close(self) -> None:
        """Let go of what the connector holds outside the pool (agents, listeners); idempotent."""
        ...


def hands_over(request: Request) -> bool:
    """Whether a request that ended asked for its prompt's K/V to be handed to a decode instance
    (do_remote_decode) and ended with it computed (not aborted, not failed)."""
    params = request.params.kv_transfer_params
    return (isinstance(params, dict) and params.get("do_remote_decode") is True
            and request.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED))


def prompt_blocks_computed(request: Request, block_size: int) -> int:
    """The prompt's full blocks whose every token is computed (all of them once a token was sampled)."""
    return min(request.num_computed_tokens, request.num_prompt_tokens) // block_size


def external_block_span(num_local_tokens: int, num_external_tokens: int, block_size: int) -> tuple[int, int]:
    """[first, last) of the request's blocks that a load writes: after the local hit (whole blocks),
    through the block holding the last external token."""
    return num_local_tokens // block_size, -(-(num_local_tokens + num_external_tokens) // block_size)


class GuardedConnector:
    """A connector whose failures stay its own: an exception in any call (a client's malformed
    kv_transfer_params, a full disk, a bug) is logged and answered as "nothing to bring in",
    "not started", "nothing to hand over" or "nothing released" (finished_loads: None, which the
    scheduler answers by computing every load in flight itself), so it never ends the engine loop.
    Other attributes (the connectors' counters) are the inner connector's."""

    def __init__(self, inner: KVConnector) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def num_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        return self._call(0, self.inner.num_matched_tokens, request, num_local_tokens)

    def start_load(self, request: Request, block_ids: list[int], num_local_tokens: int,
                   num_external_tokens: int) -> bool:
        return self._call(False, self.inner.start_load, request, block_ids, num_local_tokens, num_external_tokens)

    def finished_loads(self) -> dict[str, bool] | None:
        """None if the connector raised: then no load it had started can be trusted to end."""
        return self._call(None, self.inner.finished_loads)

    def cancel_load(self, request_id: str) -> None:
        self._call(None, self.inner.cancel_load, request_id)

    def on_finish(self, request: Request, block_ids: list[int]) -> FinishResult:
        return self._call(FinishResult(), self.inner.on_finish, request, block_ids)

    def released(self) -> list[str]:
        return self._call([], self.inner.released)

    def close(self) -> None:
        self._call(None, self.inner.close)

    def _call(self, default, method, *args):
        try:
            return method(*args)
        except Exception:
            logger.exception("KV connector %s failed; going on without it for this call", method.__name__)
            return default


def pool_fingerprint(model_name: str, model_config: ModelConfig, block_size: int, kv_dtype: str) -> str:
    """What two instances' blocks must share to be exchanged: the model and the pool's layout."""
    c = model_config
    return (f"{model_name}-L{c.num_layers}-kv{c.num_kv_heads}x{c.head_dim}-v{c.vocab_size}"
            f"-b{block_size}-{kv_dtype}")
