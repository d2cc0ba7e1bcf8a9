"""Embeddings from a step's final hidden states: the vector an embedding request's prompt pools
into (pooling_params.py), also when its prompt runs in several chunks.

    last   the hidden state of the prompt's last token, read in the step that runs it
    mean   each chunk's rows summed, the sum kept per request between steps, divided by the
           prompt's length in the step that ends it; a chunk from position 0 starts the sum over
           (a request preempted by recompute replays its prompt; one swapped out keeps its sum)
    cls    the hidden state of the prompt's first token, kept from the chunk that ran position 0
           until the step that ends the prompt (an encoder's prompt is one chunk)

A mean- or cls-pooled request never starts past position 0 on its own: it takes nothing from the
prefix cache (Request.needs_every_position). The vectors are float32 and stay on the device until the
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
        # what a request whose prompt goes on keeps between steps, (hidden,) float32: mean pooling,
        # the sum of its rows so far; cls pooling, its first row
        self.kept: dict[str, torch.Tensor] = {}

    def pool(self, hidden: torch.Tensor, chunks: list[PoolChunk]) -> Pooled | None:
        """The vectors of the requests whose prompt ends in this step (None if none does); the
        mean- and cls-pooled ones that go on keep their state. hidden: (T, hidden), the step's final states."""
        last = [c for c in chunks if c.request.pooling.pooling == "last" and c.ends_prompt]
        finished = list(last)
        parts = []
        if last:  # (n, hidden): one gather for all of them
            rows = torch.tensor([c.row_end - 1 for c in last], device=hidden.device)
            parts.append(hidden.index_select(0, rows).float())
        for c in chunks:
            kind, rid = c.request.pooling.pooling, c.request.request_id
            if kind == "mean":
                state = hidden[c.row_start:c.row_end].float().sum(dim=0)  # (hidden,)
                if c.position > 0:
                    state += self.kept.pop(rid)
            elif kind == "cls":
                # (hidden,), a copy: the step's states may be a buffer the next step reuses
                state = hidden[c.row_start].float().clone() if c.position == 0 else self.kept.pop(rid)
            else:
                continue
            if c.ends_prompt:
                finished.append(c)
                parts.append((state / c.request.num_prompt_tokens if kind == "mean" else state).unsqueeze(0))
            else:
                self.kept[rid] = state
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
        """Drop what requests that ended (aborted, failed) before their prompt did kept."""
        if self.kept:
            for request_id in request_ids:
                self.kept.pop(request_id, None)
