"""Batched sampling with per-row parameters, and no Python loop over rows on the common path.

Order of operations on the (S, V) logits of the rows that sample this step:
  1. raw logprobs (log_softmax of the model's logits), when any row asked for logprobs
  2. repetition / presence / frequency penalties, logit_bias, then allowed_token_ids, only for rows
     that set them
  3. EOS and stop tokens masked for rows still under min_tokens, and the token that would complete
     a bad word (a row these leave without any of its allowed_token_ids keeps those)
  3b. structured outputs: tokens the request's grammar does not allow next masked (a row that the
     steps before left no token the grammar allows keeps the grammar's alone)
  4. greedy rows: argmax
  5. other rows: temperature, top-k, top-p, min-p, then one draw from the probabilities
     (Sampler.draw; on the CPU, with the kernels loaded, all of it in csrc/sampler_cpu.cpp).
     A row with a seed draws its randomness from its own generator, so a seeded request
     produces the same tokens alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.host_memory import to_device
from tokenmill.request import Request
from tokenmill.structured import allowed_tokens


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters as tensors on the logits' device, built once per step."""

    all_greedy: bool
    greedy: torch.Tensor                  # (S,) bool
    temperature: torch.Tensor             # (S,) float, 1.0 on greedy rows
    top_k: torch.Tensor | None            # (S,) int64, vocab size where off; None when no row uses it
    top_p: torch.Tensor | None            # (S,) float, 1.0 where off
    min_p: torch.Tensor | None            # (S,) float, 0.0 where off
    generators: dict[int, torch.Generator]  # row -> the request's own generator (seeded rows)
    penalty_rows: list[int] = field(default_factory=list)
    penalty_prompt_ids: list[list[int]] = field(default_factory=list)
    penalty_output_ids: list[list[int]] = field(default_factory=list)
    repetition: torch.Tensor | None = None  # (R,) for the penalty rows
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, token ids): stops under
                                                                        # min_tokens, bad words
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # logit_bias: rows, token ids, values
    allowed: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, the only token ids it may take)
    grammar_rows: list[int] = field(default_factory=list)  # rows with structured outputs
    grammar_banned: torch.Tensor | None = None  # (G, V) bool: what each one's grammar forbids next
    num_logprobs: list[int | None] = field(default_factory=list)       # per row, None: not asked

    @classmethod
    def build(cls, requests: list[Request], generators: dict[str, torch.Generator], vocab_size: int,
              device: torch.device) -> "SamplingMetadata":
        params = [r.params for r in requests]
        greedy = [p.temperature == 0.0 for p in params]

        def tensor(values, dtype):
            return to_device(torch.tensor(values, dtype=dtype), device)
        meta = cls(
            all_greedy=all(greedy),
            greedy=tensor(greedy, torch.bool),
            temperature=tensor([p.temperature or 1.0 for p in params], torch.float32),
            top_k=(tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], torch.int64)
                   if any(p.top_k > 0 for p in params) else None),
            top_p=tensor([p.top_p for p in params], torch.float32) if any(p.top_p < 1 for p in params) else None,
            min_p=tensor([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None,
            generators={i: generators[r.request_id] for i, r in enumerate(requests)
                        if r.request_id in generators},
            num_logprobs=[p.logprobs for p in params],
        )
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if rows:
            meta.penalty_rows = rows
            meta.penalty_prompt_ids = [requests[i].prompt_token_ids for i in rows]
            meta.penalty_output_ids = [requests[i].output_token_ids for i in rows]
            meta.repetition = tensor([params[i].repetition_penalty for i in rows], torch.float32)
            meta.presence = tensor([params[i].presence_penalty for i in rows], torch.float32)
            meta.frequency = tensor([params[i].frequency_penalty for i in rows], torch.float32)
        biased = [(i, t, v) for i, p in enumerate(params) if p.logit_bias for t, v in p.logit_bias.items()]
        if biased:
            rows, ids, values = zip(*biased)
            meta.bias = (tensor(rows, torch.int64), tensor(ids, torch.int64), tensor(values, torch.float32))
        meta.allowed = [(i, tensor(p.allowed_token_ids, torch.int64)) for i, p in enumerate(params)
                        if p.allowed_token_ids is not None]
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            meta.grammar_rows = constrained
            allowed = allowed_tokens([requests[i].grammar for i in constrained], vocab_size)
            meta.grammar_banned = to_device(torch.from_numpy(~allowed), device)
        for i, r in enumerate(requests):
            under_min = r.num_output_tokens + r.num_pending_tokens < r.params.min_tokens
            if not under_min and not r.bad_words_token_ids:  # (the usual row: nothing to ban)
                continue
            banned = set(r.params.stop_token_ids) | r.eos_token_ids if under_min else set()
            if r.bad_words_token_ids:
                banned |= bad_word_ends(r.bad_words_token_ids, r.output_token_ids)
            if banned:
                meta.banned.append((i, sorted(banned)))
        return meta


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences of each bad word, as it would start the text and as it would follow a
    space (the second only where the space joins the word's first token, so that it is another
    sequence of as many tokens, as vLLM does)."""
    sequences = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        if spaced and len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return [s for s in sequences if s]


def bad_word_ends(sequences: list[list[int]], output: list[int]) -> set[int]:
    """Tokens that would complete a bad word next: a one-token word always, a longer one's last
    token where the output ends in the tokens before it."""
    banned = set()
    for seq in sequences:
        if len(seq) == 1 or (len(output) >= len(seq) - 1 and output[len(output) - len(seq) + 1:] == seq[:-1]):
            banned.add(seq[-1])
    return banned


@dataclass
class SamplerOutput:
    token_ids: list[int]                              # one per row
    logprobs: list[dict[int, float] | None]           # per row: sampled token and top-n, or None
    ranks: list[int] | None = None                    # per row, when asked: its token's rank (1: the best)


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(R, V) float counts of each token id per row."""
    counts = torch.zeros(len(rows), vocab_size, device=device)
    row_idx = torch.tensor([i for i, ids in enumerate(rows) for _ in ids], dtype=torch.int64, device=device)
    tok_idx = torch.tensor([t for ids in rows for t in ids], dtype=torch.int64, device=device)
    counts.index_put_((row_idx, tok_idx), torch.ones_like(tok_idx, dtype=counts.dtype), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """In place. Repetition: over prompt + output (divide positive logits, multiply negative ones);
    presence / frequency: over output, OpenAI style."""
    rows = torch.tensor(meta.penalty_rows, device=logits.device)
    sub = logits[rows]
    vocab = logits.shape[1]
    output_counts = _token_counts(meta.penalty_output_ids, vocab, logits.device)
    prompt_seen = _token_counts(meta.penalty_prompt_ids, vocab, logits.device) > 0
    seen = prompt_seen | (output_counts > 0)
    rep = meta.repetition.unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= meta.frequency.unsqueeze(1) * output_counts + meta.presence.unsqueeze(1) * (output_counts > 0)
    logits[rows] = sub


def sort_best(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Each row's logits with -inf outside its top_k best tokens and outside the smallest set of
    best tokens whose probability (after top-k) reaches top_p (top_p 1: every token); the best
    token always stays. By sorting every whole row: fast on a GPU, slow on the CPU over a whole
    vocabulary, where the kernels' sample_rows cuts by values instead."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        remove |= torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs    # mass of strictly better tokens
        remove |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    return logits.scatter(1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))


def filter_logits(logits: torch.Tensor, meta: SamplingMetadata, kernels=None) -> torch.Tensor:
    """Temperature-scaled logits with top-k, top-p and min-p applied (-inf outside the kept set).
    With the CPU kernels, top-k and top-p keep what sample_rows keeps (every token at or above
    each row's floor, ties included) without sorting; else every whole row is sorted (sort_best)."""
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.top_k is not None or meta.top_p is not None:
        if kernels is not None and logits.device.type == "cpu":
            S = logits.shape[0]
            floors = torch.empty(S)
            kernels.sample_rows(logits, torch.ones(S), meta.top_k, meta.top_p, None,
                                torch.zeros(S, dtype=torch.float64), floors)  # the draw itself unused
            logits.masked_fill_(logits < floors.unsqueeze(1), float("-inf"))
        else:
            logits = sort_best(logits, meta.top_k, meta.top_p)
    if meta.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


_DRAW_BLOCK = 1024  # tokens per block of draw_by_sums' first level


def draw_by_sums(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of probs (S, V), the first token whose running sum of probabilities exceeds
    u (S, 1, in [0, 1)) times the row's sum: token i with probability probs[i] / sum.

    In two levels: the sums of blocks of 1,024 tokens, added up in float64, pick a block; that
    block's running sum in float64 picks the token. A float32 running sum over the whole row would
    absorb every probability below its rounding step (the default model has 49,152 tokens, most
    of them far below 1e-7), and a float64 one over the whole row was slower (64 rows: 20 ms,
    against 0.6 here; the fresh pages of its 25 MB alone took 5). A block's own sum is float32's
    pairwise sum, off by well under 1e-6 of the block's mass: all the error the draw adds. Where
    it is larger than the block's float64 running sum, u times the row's sum can run past the
    block's last token; the caps put the draw on the last token of nonzero probability (of the
    last block of nonzero mass) then, never on zeros after it."""
    S, V = probs.shape
    full = V // _DRAW_BLOCK * _DRAW_BLOCK
    sums = [probs[:, :full].view(S, -1, _DRAW_BLOCK).sum(-1).double()] if full else []
    if full < V:
        sums.append(probs[:, full:].sum(-1, keepdim=True).double())
    ends = torch.cat(sums, dim=1).cumsum(-1)                       # (S, blocks) running block sums
    x = u * ends[:, -1:]
    block = torch.minimum(torch.searchsorted(ends, x, right=True),
                          torch.searchsorted(ends, ends[:, -1:].contiguous()))  # last block with mass
    before = torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * _DRAW_BLOCK + torch.arange(_DRAW_BLOCK)             # (S, 1024) the block's tokens
    run = probs.gather(1, cols.clamp(max=V - 1)).masked_fill(cols >= V, 0).cumsum(-1, dtype=torch.float64)
    j = torch.minimum(torch.searchsorted(run, x - before, right=True),
                      torch.searchsorted(run, run[:, -1:].contiguous()))   # last nonzero token of the block
    return (block * _DRAW_BLOCK + j).clamp_(max=V - 1).squeeze(1)     # (NaN rows: some token)


@dataclass
class HostTokens:
    """A step's sampled tokens (and logprob tables) on their way to the host. On a GPU the copies
    are queued right behind the sampling, with an event, so that waiting for them does not also
    wait for work queued after it: under async scheduling, the whole next step."""

    tokens: torch.Tensor                   # (S,)
    chosen: torch.Tensor | None = None     # (S,) logprob of each sampled token
    top_vals: torch.Tensor | None = None   # (S, n) the n best logprobs of each row
    top_ids: torch.Tensor | None = None
    ranks: torch.Tensor | None = None      # (S,) when asked: each token's rank in its row, ties counted
    ready: torch.cuda.Event | None = None

    def tables(self) -> list[torch.Tensor | None]:
        return [self.tokens, self.chosen, self.top_vals, self.top_ids, self.ranks]


class Sampler:
    def __init__(self, seed: int, device: torch.device, kernels=None) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # the CPU kernels (cpu_kernels.py), for their argmax_rows (torch's answers in a fifth of
        # the time at 64 rows of logits) and sample_rows (each sampled row in a few passes)
        self.kernels = kernels

    def _in_kernels(self, x: torch.Tensor) -> bool:
        return (self.kernels is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
                and x.stride(1) == 1)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.argmax_rows(x) if self._in_kernels(x) else x.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: (S, V) float32, one row per sequence that samples this step."""
        return self.collect(self.to_host(*self.sample(logits, meta), meta.num_logprobs), meta.num_logprobs)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled tokens (S,), and the raw logprobs where a row asked for them, left on the
        logits' device. Nothing here waits for the device, except the index lists that penalties
        copy to it (async scheduling waits for the last step's tokens while such a request runs)."""
        want_logprobs = any(n is not None for n in meta.num_logprobs)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        model_logits = logits
        if meta.penalty_rows or meta.banned or meta.bias is not None or meta.allowed or meta.grammar_rows:
            logits = logits.clone()
        if meta.penalty_rows:
            apply_penalties(logits, meta)
        if meta.bias is not None:
            rows, ids, values = meta.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        kept = {}
        for row, ids in meta.allowed:
            kept[row] = logits[row, ids]
            logits[row] = float("-inf")
            logits[row, ids] = kept[row]
        if meta.banned:
            rows = torch.tensor([row for row, ids in meta.banned for _ in ids])
            cols = torch.tensor([t for _, ids in meta.banned for t in ids])
            logits[to_device(rows, logits.device), to_device(cols, logits.device)] = float("-inf")
            for row, ids in meta.allowed:  # bans that leave no allowed token (a longer bad word, say)
                if torch.isneginf(logits[row]).all():  # give way: an allowed token, never another
                    logits[row, ids] = kept[row]
        if meta.grammar_rows:
            masked_before = {row for row, _ in meta.allowed} | {row for row, _ in meta.banned}
            for j, row in enumerate(meta.grammar_rows):
                logits[row].masked_fill_(meta.grammar_banned[j], float("-inf"))
                if row in masked_before and torch.isneginf(logits[row]).all():  # none the grammar allows is left
                    logits[row] = model_logits[row].masked_fill(meta.grammar_banned[j], float("-inf"))

        if meta.all_greedy:
            return self.argmax(logits), raw_logprobs
        if self._in_kernels(logits):  # temperature 0 there: the greedy rows' argmax
            return self.kernels.sample_rows(logits, meta.temperature.masked_fill(meta.greedy, 0.0), meta.top_k,
                                            meta.top_p, meta.min_p, self.uniforms(logits.shape[0], meta)), raw_logprobs
        sampled = self.draw(self.filter(logits, meta).softmax(dim=-1), meta)
        return torch.where(meta.greedy, self.argmax(logits), sampled), raw_logprobs

    def filter(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """filter_logits, with the CPU kernels when they are loaded (for the distributions that
        speculative decoding compares)."""
        return filter_logits(logits, meta, self.kernels if self._in_kernels(logits) else None)

    def uniforms(self, n: int, meta: SamplingMetadata) -> torch.Tensor:
        """One uniform number in [0, 1) per row (float64, CPU): every row draws from the sampler's
        generator first (so what an unseeded row draws does not depend on which rows have seeds),
        then a row with a seed draws again from its own."""
        u = torch.rand(n, dtype=torch.float64, generator=self.generator)
        for row, gen in meta.generators.items():
            u[row] = torch.rand(1, dtype=torch.float64, generator=gen)
        return u

    def draw(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """One token per row of probs (S, V), each with its probability (on the CPU to within
        about 1e-7: draw_by_sums), by the same rule for every row: the sampler's generator first,
        then a seeded row's own (as in uniforms).

        On a GPU: the exponential race, argmax(probs / Exp(1) noise), V random numbers a row,
        generated in parallel there. On the CPU torch makes Exp(1) numbers one at a time, which over a
        whole vocabulary costs a large share of a decode step; there a row takes one uniform
        number instead (draw_by_sums; the CPU kernels' sample_rows, when loaded, do all of a row's
        sampling in one call)."""
        if probs.is_cuda:
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for row, gen in meta.generators.items():
                noise[row].exponential_(generator=gen)
            return self.argmax(probs / noise)
        return draw_by_sums(probs, self.uniforms(probs.shape[0], meta).unsqueeze(1))

    @staticmethod
    def to_host(tokens: torch.Tensor, raw_logprobs: torch.Tensor | None,
                num_logprobs: list[int | None], ranks: bool = False) -> HostTokens:
        """Queue the copies of what collect() reads: the tokens, and the logprob tables (the
        given token's and the top-n of each row that asks, n from num_logprobs) computed on the
        device; with `ranks`, each given token's rank too (vLLM's: the tokens at least as likely).
        The tokens may be sampled ones, or the prompt's own (prompt logprobs)."""
        out = HostTokens(tokens)
        if raw_logprobs is not None:
            top_n = max(n for n in num_logprobs if n is not None)
            out.chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            out.top_vals, out.top_ids = raw_logprobs.topk(max(top_n, 1), dim=-1)
            if ranks:
                out.ranks = (raw_logprobs >= out.chosen.unsqueeze(1)).sum(dim=1)
        if tokens.is_cuda:
            out.tokens, out.chosen, out.top_vals, out.top_ids, out.ranks = (
                t.to("cpu", non_blocking=True) if t is not None else None for t in out.tables())
            out.ready = torch.cuda.Event()
            out.ready.record()
        return out

    @staticmethod
    def collect(host: HostTokens, num_logprobs: list[int | None]) -> SamplerOutput:
        """Wait for the copies (the step's one host sync) and list the tokens and logprobs."""
        if host.ready is not None:
            host.ready.synchronize()
        token_list = host.tokens.tolist()
        if host.chosen is None:
            return SamplerOutput(token_list, [None] * len(token_list))
        return SamplerOutput(token_list, Sampler.logprobs(host.chosen.tolist(), host.top_vals.tolist(),
                                                          host.top_ids.tolist(), token_list, num_logprobs),
                             host.ranks.tolist() if host.ranks is not None else None)

    @staticmethod
    def logprobs(chosen: list[float], top_vals: list[list[float]], top_ids: list[list[int]],
                 token_list: list[int], num_logprobs: list[int | None]) -> list[dict[int, float] | None]:
        """Per row: {its token: logprob} followed by the row's top-n alternatives."""
        out: list[dict[int, float] | None] = []
        for row, n in enumerate(num_logprobs):
            if n is None:
                out.append(None)
                continue
            entry = {token_list[row]: chosen[row]}
            entry.update({t: v for t, v in zip(top_ids[row][:n], top_vals[row][:n]) if t not in entry})
            out.append(entry)
        return out
