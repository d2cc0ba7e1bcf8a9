"""Where a KV connector plugs into the scheduler: K/V computed elsewhere (another instance's
prefill, a remote cache) brought into a request's blocks, and a finished request's blocks offered
to another instance.

The scheduler calls a connector at three points, all on its own thread:

    admission   num_matched_tokens(request, local)   prompt tokens past the local prefix hit
                                                     whose K/V the connector can bring in
                after_allocate(request, blocks, n)   the blocks now hold room for them: the first
                                                     n tokens past the local hit are the
                                                     connector's to write before they are read
    finish      on_finish(request, blocks)           the request ends; its blocks are freed
                                                     right after the call

    blocks      [local hit ][external n ][computed by this instance ...]
    counter     num_computed_tokens moves past the hit and the external tokens at admission

No connector ships yet (the scheduler's default is none); the seam is what disaggregated
prefill/decode plugs into.
"""

from __future__ import annotations

from typing import Protocol

from tokenmill.request import Request


class KVConnector(Protocol):
    def num_matched_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Prompt tokens after the first `num_local_tokens` (the local prefix hit) that the
        connector can supply; 0 for none. The scheduler computes at least the last prompt token
        itself, whatever this says."""
        ...

    def after_allocate(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request was admitted with `block_ids`; the connector writes the K/V of its
        `num_external_tokens` tokens after the local hit."""
        ...

    def on_finish(self, request: Request, block_ids: list[int]) -> None:
        """The request ended (any reason); its blocks are freed after this returns."""
        ...
