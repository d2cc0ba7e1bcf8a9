"""Embeddings from a step's final hidden states: the vector an embedding request's prompt pools
into (pooling_params.py), also when its prompt runs in several chunks.

    last   the hidden state of the prompt's last token, read in the step that runs it
    mean   each chunk's rows summed, the sum kept per request between steps, divided by the
           prompt's length in the step that ends it; a chunk from position 0 starts the sum over
           (a request preempted by recompute replays its prompt; one swapped out keeps its sum)

A mean-pooled request never starts past position 0 on its own: it takes nothing from the prefix
cache (Request.needs_every_position). The vectors are float32 and stay on the device until the
runner collects the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.request import Request


@dataclass
class PoolChunk:
    """An embedding request's chunk in one step's flat batch."""

    request: Request
    row_start: int       # its first row in the flat batch
    row_end: int         # one past its last row
    position: int        # the prompt position of its first row
    ends_prompt: bool    # it reaches the prompt's end: the vector is due this step


@dataclass
class Pooled:
    """One step's vectors, still on the device."""

    request_ids: list[str]
    vectors: torch.Tensor  # (len(request_ids), hidden) float32


class Pooler:
    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}  # mean pooling: (hidden,) float32 sum of the rows so far

    def pool(self, hidden: torch.Tensor, chunks: list[PoolChunk]) -> Pooled | None:
        """The vectors of the requests whose prompt ends in this step (None if none does); the
        mean-pooled ones that go on keep their sum. hidden: (T, hidden), the step's final states."""
        last = [c for c in chunks if c.request.pooling.pooling == "last" and c.ends_prompt]
        finished = list(last)
        parts = []
        if last:  # (n, hidden): one gather for all of them
            rows = torch.tensor([c.row_end - 1 for c in last], device=hidden.device)
            parts.append(hidden.index_select(0, rows).float())
        for c in chunks:
            if c.request.pooling.pooling != "mean":
                continue
            rid = c.request.request_id
            total = hidden[c.row_start:c.row_end].float().sum(dim=0)  # (hidden,)
            if c.position > 0:
                total += self.sums.pop(rid)
            if c.ends_prompt:
                finished.append(c)
                parts.append((total / c.request.num_prompt_tokens).unsqueeze(0))
            else:
                self.sums[rid] = total
        if not finished:
            return None
        vectors = torch.cat(parts) if len(parts) > 1 else parts[0]  # (n, hidden), `finished` order
        normalize = [c.request.pooling.normalize for c in finished]
        if all(normalize):
            vectors = F.normalize(vectors, dim=-1)
        elif any(normalize):
            rows = torch.tensor([i for i, n in enumerate(normalize) if n], device=vectors.device)
            vectors[rows] = F.normalize(vectors[rows], dim=-1)
        return Pooled([c.request.request_id for c in finished], vectors)

    def forget(self, request_ids: list[str]) -> None:
        """Drop the sums of requests that ended (aborted, failed) before their prompt did."""
        if self.sums:
            for request_id in request_ids:
                self.sums.pop(request_id, None)
