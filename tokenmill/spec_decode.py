"""Speculative decoding inside the continuous batch.

Each step, before scheduling, the Speculator asks its proposer for k draft tokens per
decoding sequence; the scheduler sends each sequence's last token plus its drafts into the
same ragged forward pass as everything else (the token budget counts them), and
`verify` keeps what the target model agrees with:

  greedy    the longest prefix of drafts equal to the target's argmax, plus the target's own
            next token (a correction, or a bonus token when every draft matched);
  sampling  standard speculative rejection sampling: draft x with target probability p(x)
            and draft probability q(x) is kept with probability min(1, p(x) / q(x)); at the
            first rejection a token is drawn from max(0, p - q), renormalised; if all are kept
            a bonus token is drawn from p. The output has exactly the target's distribution.

Rejected drafts roll back in Scheduler.update (counter and block table shrink).

Proposers (proposers.py): "ngram" (prompt lookup; q is a point mass) and "draft:PATH" (a
smaller model with its own paged KV cache, run for k steps on the decoding sequences).

When it pays (SpeculationPolicy): verification costs compute. The policy keeps a cost
model of a step, time = a + b * tokens, fitted online from the engine's own steps, and
the measured acceptance rate alpha. For k drafts a sequence gains 1 + alpha + ... + alpha^k
tokens on average. Each step it picks the k in 0..num_speculative_tokens that maximises
expected output tokens per second over the whole batch, so a small batch (where a step
costs about the same for 1 or 5 tokens a sequence: the weights are streamed either way)
speculates and a large, compute-bound batch does not.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.request import Request
from tokenmill.sampler import Sampler, SamplingMetadata, draw_by_sums

# ---- verification -----------------------------------------------------------------------------

def verify(logits: torch.Tensor, request: Request, sampler: Sampler,
           generator: torch.Generator) -> tuple[list[int], list[dict[int, float]] | None]:
    """Accepted drafts plus one target token, from the (1 + k, V) logits at the last token and
    each draft. Also their logprobs when the request asks for them."""
    drafts = request.draft_token_ids
    k = len(drafts)
    meta = SamplingMetadata.build([request] * (k + 1), {}, logits.shape[1], logits.device)  # rows share params
    if request.params.greedy:
        target = logits.argmax(dim=-1).tolist()
        m = 0
        while m < k and drafts[m] == target[m]:
            m += 1
        tokens = drafts[:m] + [target[m]]
    else:
        tokens = _rejection_sample(sampler.filter(logits, meta).softmax(dim=-1), drafts, request.draft_probs,
                                   generator)
    if request.params.logprobs is None:
        return tokens, None
    rows = len(tokens)
    raw = logits[:rows].log_softmax(dim=-1)
    num_logprobs = meta.num_logprobs[:rows]
    return tokens, sampler.collect(sampler.to_host(torch.tensor(tokens, device=logits.device), raw, num_logprobs),
                                   num_logprobs).logprobs


def _rejection_sample(probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                      generator: torch.Generator) -> list[int]:
    """probs: (k + 1, V) target distributions; draft_probs: (k, V) or None for point-mass drafts."""
    for i, token in enumerate(drafts):
        p = probs[i]
        q = draft_probs[i] if draft_probs is not None else None
        q_token = float(q[token]) if q is not None else 1.0
        accept = min(1.0, float(p[token]) / q_token) if q_token > 0 else 0.0
        if float(torch.rand((), generator=generator, device=p.device)) < accept:
            continue
        if q is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: any draw from p is exact
            residual = p
        return drafts[:i] + [_draw(residual, generator)]
    return drafts + [_draw(probs[len(drafts)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """An index drawn with probability weights[i] / sum(weights): torch.multinomial on a GPU,
    the sampler's draw_by_sums on the CPU, where it is several times faster over a whole
    vocabulary (BENCHMARKS.md)."""
    if weights.is_cuda:
        return int(torch.multinomial(weights, 1, generator=generator))
    u = torch.rand(1, 1, dtype=torch.float64, generator=generator)
    return int(draw_by_sums(weights.contiguous().unsqueeze(0), u))


# ---- when it pays -----------------------------------------------------------------------------

class SpeculationPolicy:
    """Chooses k per step from a fitted step-cost model and the measured acceptance rate."""

    def __init__(self, k_max: int, prior_acceptance: float = 0.5, prior_weight: float = 20.0,
                 forget: float = 0.98) -> None:
        self.k_max = k_max
        self.accepted, self.proposed = prior_acceptance * prior_weight, prior_weight
        self.forget = forget
        self._sums = np.zeros(5)  # weighted n, x, y, xx, xy of (tokens, seconds) per step
        self.last_k = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed

    def step_cost(self, tokens: float) -> float:
        """Seconds for a step of `tokens` tokens: the least-squares line through recent steps."""
        n, x, y, xx, xy = self._sums
        if n < 2:
            return 1.0 + tokens  # no data yet: compute-bound guess, so speculation must earn its place
        var = xx / n - (x / n) ** 2
        b = (xy / n - (x / n) * (y / n)) / var if var > 1e-9 else (y / x if x else 0.0)
        b = max(b, 0.0)
        a = max(y / n - b * x / n, 0.0)
        return a + b * tokens

    def observe_step(self, num_tokens: int, seconds: float, proposed: int, accepted: int) -> None:
        if num_tokens > 0:
            self._sums = self._sums * self.forget + np.array(
                [1.0, num_tokens, seconds, num_tokens**2, num_tokens * seconds])
        if proposed:
            self.accepted = self.accepted * self.forget + accepted
            self.proposed = self.proposed * self.forget + proposed

    def choose_k(self, num_decodes: int, num_candidates: int, other_tokens: int) -> int:
        """The k maximising expected tokens per second for this step's batch."""
        alpha = self.acceptance
        best_k, best_rate = 0, num_decodes / self.step_cost(num_decodes + other_tokens)
        for k in range(1, self.k_max + 1):
            expected = sum(alpha**i for i in range(1, k + 1))  # accepted drafts, on average
            tokens = num_decodes + num_candidates * expected
            rate = tokens / self.step_cost(num_decodes + other_tokens + num_candidates * k)
            if rate > best_rate * 1.02:  # insist on a margin over not speculating
                best_k, best_rate = k, rate
        self.last_k = best_k
        return best_k


class Speculator:
    """The engine's hook: propose before scheduling, learn after each step."""

    def __init__(self, proposer, policy: SpeculationPolicy, adaptive: bool = True) -> None:
        self.proposer = proposer
        self.policy = policy
        self.adaptive = adaptive
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_steps_speculated = 0

    @staticmethod
    def eligible(r: Request) -> bool:
        """Decoding, no penalties (they would depend on the drafts), no logit_bias, allowed tokens
        or structured outputs (verification reads the model's own logits), past min_tokens, and not a seeded
        sampled request: verifying drafts takes other numbers from its generator than a plain
        step does, and whether it speculates depends on the batch, so its text would too."""
        p = r.params
        return (r.num_remaining_prefill == 1 and r.num_output_tokens > 0 and not p.has_penalties
                and not p.edits_logits
                and r.num_output_tokens >= p.min_tokens and p.num_speculative_tokens != 0
                and (p.seed is None or p.greedy))

    def propose(self, running: list[Request], waiting_tokens: int, budget: int, max_model_len: int) -> None:
        decoding = [r for r in running if r.num_remaining_prefill == 1]
        candidates = [r for r in decoding if self.eligible(r)]
        if not candidates:
            return
        other = min(waiting_tokens, max(budget - len(decoding), 0))
        k = (self.policy.choose_k(len(decoding), len(candidates), other) if self.adaptive
             else self.policy.k_max)
        if k == 0:
            return
        # Every decode first gets its own token within the budget: drafts share what is left, so none
        # of them crowds a decode out of the step (it would wait behind the others' drafts).
        share = max(0, budget - len(decoding)) // len(candidates)
        ks = [max(0, min(k if r.params.num_speculative_tokens is None else r.params.num_speculative_tokens,
                         share, r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens - 1))
              for r in candidates]
        self.proposer.propose(candidates, ks)
        self.num_steps_speculated += 1

    def release(self, request_ids: list[str]) -> None:
        """Drop the draft state of these requests (a failed step's, and those that ended before it)."""
        for request_id in request_ids:
            self.proposer.release(request_id)

    def observe(self, stats, finished_ids: list[str], changed: list[Request]) -> None:
        """After a step: learn its cost and acceptance, trim draft caches, drop finished sequences.

        The cost model was fitted and tested on the CPU. On CUDA, steps with drafts run eagerly
        while plain decode steps replay graphs, and async_output hides part of a plain step's
        host time: one linear fit mixes those regimes, so the choice of k there is untuned."""
        self.policy.observe_step(stats.num_tokens, stats.time_forward + stats.time_sample,
                                 stats.num_draft_tokens, stats.num_accepted_tokens)
        self.num_proposed += stats.num_draft_tokens
        self.num_accepted += stats.num_accepted_tokens
        for r in changed:
            if r.is_finished:
                self.proposer.release(r.request_id)
            else:
                self.proposer.sync(r)
        for request_id in finished_ids:  # aborted or stopped outside the token checks
            self.proposer.release(request_id)
