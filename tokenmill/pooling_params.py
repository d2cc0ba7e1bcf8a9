"""How an embedding request turns its prompt's hidden states into one vector, validated when built.

An embedding request runs its prompt like any other (chunked prefill, prefix cache, preemption)
and samples nothing: the runner pools the final hidden states (after the model's last norm)
of its prompt into one vector, which ends the request. As vLLM does for a generative model used
for embeddings, the default is the last token's state, L2-normalised; an encoder's default is
its checkpoint's (models/bert.py).
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_KINDS = ("last", "mean", "cls")


def check_truncation(value) -> None:
    """truncate_prompt_tokens (vLLM's): None, -1 (the model's context length) or a count >= 1."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value == 0 or value < -1):
        raise ValueError(f"truncate_prompt_tokens must be -1 (the model's context length) or an integer >= 1, "
                         f"got {value!r}")


@dataclass(frozen=True)
class PoolingParams:
    pooling: str = "last"     # "last": the last prompt token's hidden state; "mean": the mean over
                              # every prompt token; "cls": the first prompt token's (BERT's [CLS]).
                              # "mean" and "cls" compute the whole prompt: no prefix cache
    normalize: bool = True    # scale the vector to unit L2 norm
    truncate_prompt_tokens: int | None = None  # embed only the prompt's first k tokens (-1: a context's worth)

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_KINDS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_KINDS)}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        check_truncation(self.truncate_prompt_tokens)

    @property
    def needs_every_position(self) -> bool:
        """Whether the vector reads every prompt position's hidden state (not just the last one)."""
        return self.pooling in ("mean", "cls")
