"""The model runner: turns a SchedulerOutput into one flat batch, has the worker (worker.py) run
the model over it once, and samples the sequences that reached their end.

Step tensors are built in one go with numpy (no per-token Python loop):

    requests        A (3 new tokens from position 5)      B (decode at position 9)
    input_ids       [a5 a6 a7 | b9]                        (T = 4, no padding)
    positions       [5 6 7 | 9]
    slot            (block_table[seq][pos // bs], pos % bs): where each token's K/V goes
    logits_indices  [2, 3]   last token of each sequence that samples

A speculating sequence brings its drafts after its last token ([b9 d1 d2]) and has logits
read at all three rows; the verifier (spec_decode.py) keeps the drafts that the model
itself would have produced, plus one token of its own.

An embedding request (request.pooling) never samples: its rows go to the pooler (pooler.py),
which reports its vector in the step that runs the end of its prompt.

Sequences with short queries (decodes) are put first so the attention backend can run
them through its batched kernel; outputs are keyed by request id, so order is free. A step
of nothing but decodes (the usual one) gets the same tensors from a shortcut over short lists.

Under async scheduling a step is prepared while the one before still runs: a decode's input
token is then the one that step is sampling, copied from its output on the device into the
input row (a placeholder on the host side).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.config import EngineConfig, parse_size
from tokenmill.host_memory import to_device
from tokenmill.outputs import RunnerOutput, SchedulerOutput
from tokenmill.pooler import PoolChunk, Pooled, Pooler
from tokenmill.request import Request
from tokenmill.sampler import HostTokens, Sampler, SamplingMetadata
from tokenmill.spec_decode import verify
from tokenmill.worker import ModelWorker

DEFAULT_CPU_KV_MEMORY = 4 * 1024**3
PROMPT_LOGPROB_ROWS = 128  # prompt positions scored at once: 128 rows of logits (25 MB at vocab 49,152)


@dataclass
class StepInputs:
    input_ids: torch.Tensor          # (T,) int64
    positions: torch.Tensor          # (T,) int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor     # (R,) rows of the flat batch whose logits are needed
    sampling_requests: list[Request]  # requests that sample this step, in row order
    num_rows: list[int]              # logits rows of each: 1, or 1 + its drafts
    prompt_rows: list[tuple[Request, int, int, int]] = field(default_factory=list)  # prompt logprobs:
                                     # (request, first prompt token scored, its flat-batch row range)
    pool_chunks: list[PoolChunk] = field(default_factory=list)  # embedding requests' rows


@dataclass
class PendingStep:
    """A launched step: its work queued on the device, its sampled tokens not yet on the host."""

    result: RunnerOutput                   # filled by collect (and by launch for verified drafts)
    plain_requests: list[Request]          # sampled in one batch, in row order
    meta: SamplingMetadata | None
    host: HostTokens | None = None         # their sampled tokens, being copied to the host
    prompt_scores: list[tuple[str, int, list[HostTokens], int]] = field(default_factory=list)
                                           # (request id, first prompt token, its tables, top-n)
    pooled: Pooled | None = None           # embedding vectors of requests whose prompt ended


class ModelRunner:
    """Requests in, tokens out: prepares each step's tensors for the worker (worker.py), which runs
    the model over the KV pool; samples, verifies drafts and scores prompts from what it returns."""

    def __init__(self, worker: ModelWorker, seed: int) -> None:
        self.worker = worker
        self.device = worker.device
        self.block_size = worker.block_size
        kernels = getattr(worker.backend, "kernel", None) if self.device.type == "cpu" else None
        self.sampler = Sampler(seed, self.device, kernels=kernels)
        self.generators: dict[str, torch.Generator] = {}  # request id -> its seeded generator
        self.pooler = Pooler()
        # The last step's sampled tokens, still on the device, and each sampling request's row in them:
        # under async scheduling the next step is prepared before they reach the host.
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingStep | None:
        """Queue the step's work: on a GPU this returns while it runs, so the engine can do host
        work meanwhile; `collect` then waits for the tokens. Everything the host sends the
        device (step tensors, sampling parameters) goes before the forward pass, so that no
        copy waits behind it. A step that runs no request (its preemptions may still swap
        blocks out) returns None."""
        for request_id in sched.finished_request_ids:
            self.generators.pop(request_id, None)
        self.pooler.forget(sched.finished_request_ids)
        worker = self.worker
        worker.begin_step()
        t0 = time.perf_counter()
        worker.swap(sched.swap_out, sched.swap_in)
        if not sched.requests:
            return None
        inputs = self.prepare(sched.requests, sched.num_scheduled_tokens, sched.num_draft_tokens,
                              pooling=bool(sched.pooling))
        requests, num_rows = inputs.sampling_requests, inputs.num_rows
        plain = [i for i, n in enumerate(num_rows) if n == 1]  # sampled in one batch; the others verify drafts
        plain_requests = [requests[i] for i in plain]
        meta = self._sampling_metadata(plain_requests) if plain else None
        t1 = time.perf_counter()
        hidden = worker.forward(inputs.input_ids, inputs.positions, inputs.meta)
        logits = worker.compute_logits(hidden[inputs.logits_indices]) if requests else None
        t2 = time.perf_counter()
        pending = PendingStep(RunnerOutput(sampled_token_ids={}, time_prepare=t1 - t0, time_forward=t2 - t1),
                              plain_requests, meta)
        ends = np.cumsum(num_rows)
        if meta is not None:
            if len(plain) < logits.shape[0]:  # pick the plain rows (each sequence's last) out
                logits_plain = logits.index_select(0, to_device(torch.from_numpy(ends[plain] - 1), logits.device))
            else:
                logits_plain = logits
            tokens, raw_logprobs = self.sampler.sample(logits_plain, meta)
            pending.host = self.sampler.to_host(tokens, raw_logprobs, meta.num_logprobs)
            self._last_tokens = tokens
        self._last_rows = {r.request_id: i for i, r in enumerate(plain_requests)}
        for i, n in enumerate(num_rows):
            if n > 1:
                self._verify(logits[ends[i] - n:ends[i]], requests[i], pending.result)
        pending.prompt_scores = [self._score_prompt(hidden, *rows) for rows in inputs.prompt_rows]
        if inputs.pool_chunks:
            pending.pooled = self.pooler.pool(hidden, inputs.pool_chunks)
        pending.result.time_sample = time.perf_counter() - t2
        return pending

    def collect(self, pending: PendingStep) -> RunnerOutput:
        """Wait for the step's tokens (the host sync) and key them by request."""
        start, result = time.perf_counter(), pending.result
        if pending.meta is not None:
            out = self.sampler.collect(pending.host, pending.meta.num_logprobs)
            for r, token, logprobs in zip(pending.plain_requests, out.token_ids, out.logprobs):
                result.sampled_token_ids[r.request_id] = [token]
                if logprobs is not None:
                    result.logprobs[r.request_id] = [logprobs]
        for request_id, first, tables, n in pending.prompt_scores:
            scored = [self.sampler.collect(host, [n] * len(host.tokens)) for host in tables]
            result.prompt_logprobs[request_id] = (first, [e for s in scored for e in s.logprobs],
                                                  [r for s in scored for r in s.ranks])
        if pending.pooled is not None:
            result.pooled = dict(zip(pending.pooled.request_ids, pending.pooled.vectors.cpu().tolist()))
        result.time_sample += time.perf_counter() - start  # with the wait for the device
        return result

    def _score_prompt(self, hidden: torch.Tensor, request: Request, first: int, row_start: int,
                      row_end: int) -> tuple[str, int, list[HostTokens], int]:
        """Logprob tables of prompt tokens first, first + 1, ... from the hidden states of the
        rows before each, a slice of rows at a time (every row is a whole vocabulary of logits)."""
        n = request.params.prompt_logprobs
        targets = to_device(torch.tensor(request.prompt_token_ids[first:first + row_end - row_start]), self.device)
        tables = []
        for start in range(row_start, row_end, PROMPT_LOGPROB_ROWS):
            end = min(start + PROMPT_LOGPROB_ROWS, row_end)
            raw = self.worker.compute_logits(hidden[start:end]).log_softmax(dim=-1)
            tables.append(self.sampler.to_host(targets[start - row_start:end - row_start], raw, [n], ranks=True))
        return request.request_id, first, tables, n

    def _sampling_metadata(self, requests: list[Request]) -> SamplingMetadata:
        for r in requests:
            if r.params.seed is not None and r.request_id not in self.generators:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed_bits(r.params.seed, self.device))
                self.generators[r.request_id] = gen
        return SamplingMetadata.build(requests, self.generators, self.worker.vocab_size, self.device)

    def _verify(self, logits: torch.Tensor, request: Request, result: RunnerOutput) -> None:
        """A sequence with drafts: keep those the model agrees with, plus one token of its own."""
        tokens, logprobs = verify(logits, request, self.sampler,
                                  self.generators.get(request.request_id, self.sampler.generator))
        result.sampled_token_ids[request.request_id] = tokens
        if logprobs is not None:
            result.logprobs[request.request_id] = logprobs
        result.num_draft_tokens += logits.shape[0] - 1
        result.num_accepted_tokens += len(tokens) - 1

    def prepare(self, requests: list[Request], num_tokens: list[int],
                num_drafts: list[int] | None = None, pooling: bool = False) -> StepInputs:
        """Flatten the scheduled chunks into step tensors (see the module docstring). pooling:
        some of the requests are embedding requests."""
        short_max = self.worker.short_query_max
        if (not pooling and not any(num_drafts or ()) and all(n == 1 for n in num_tokens)
                and all(r.num_computed_tokens + 1 == r.num_tokens and not r.num_pending_tokens for r in requests)):
            return self._prepare_decodes(requests, short_max)
        return self._prepare_chunks(requests, num_tokens, num_drafts, short_max, pooling)

    def _prepare_chunks(self, requests: list[Request], num_tokens: list[int], num_drafts: list[int] | None,
                        short_max: int, pooling: bool = False) -> StepInputs:
        """prepare for any step: prompt chunks, decodes, drafts, pending tokens and embedding
        requests' chunks, with numpy."""
        order = sorted(range(len(requests)), key=lambda i: num_tokens[i] > short_max)  # stable
        requests = [requests[i] for i in order]
        counts = np.array([num_tokens[i] for i in order], dtype=np.int64)
        drafts = np.array([num_drafts[i] for i in order] if num_drafts else [0] * len(order), dtype=np.int64)
        starts = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
        seq_lens = starts + counts
        cu = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        total = int(cu[-1])

        token_ids: list[int] = []
        pending_rows: list[int] = []  # async scheduling: rows whose token the last step sampled
        pending_src: list[int] = []   # and its row among that step's tokens
        prompt_rows = []
        for r, start, n, d, row in zip(requests, starts.tolist(), counts.tolist(), drafts.tolist(), cu.tolist()):
            if r.params.prompt_logprobs is not None:  # rows whose next token is a prompt token not yet scored
                first, end = max(start, len(r.prompt_logprobs) - 1), min(start + n - d, r.num_prompt_tokens - 1)
                if first < end:
                    prompt_rows.append((r, first + 1, row + first - start, row + end - start))
            token_ids.extend(r.token_ids[start:start + n - d])
            if r.num_pending_tokens and start + n - d > r.num_tokens:
                pending_rows.append(len(token_ids))
                pending_src.append(self._last_rows[r.request_id])
                token_ids.append(0)  # a placeholder, replaced on the device
            token_ids.extend(r.draft_token_ids[:d])
        seq_of_token = np.repeat(np.arange(len(requests)), counts)
        positions = np.arange(total, dtype=np.int64) - (cu[:-1] - starts)[seq_of_token]

        bs = self.block_size
        tables = _block_tables(requests)
        slot_block = tables[seq_of_token, positions // bs].astype(np.int64)

        samples = seq_lens - drafts == np.array([r.num_tokens + r.num_pending_tokens for r in requests])
        pool_chunks = []
        if pooling:  # embedding requests pool their rows instead of sampling
            for i, r in enumerate(requests):
                if r.pooling is not None:
                    pool_chunks.append(PoolChunk(r, int(cu[i]), int(cu[i + 1]), int(starts[i]), bool(samples[i])))
                    samples[i] = False
        sampling_requests = [r for r, s in zip(requests, samples) if s]
        num_rows = (1 + drafts[samples]).tolist()
        # the last 1 + d rows of each sampling sequence
        row_ends = np.repeat(cu[1:][samples], num_rows)
        logits_rows = row_ends - (np.repeat(np.cumsum(num_rows), num_rows) - np.arange(sum(num_rows)))
        num_short = int(np.count_nonzero(counts <= short_max))
        dev = self.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return to_device(torch.from_numpy(a), dev)
        meta = AttentionMetadata(
            slot_block=to_dev(slot_block), slot_offset=to_dev(positions % bs),
            query_start_loc=to_dev(cu.astype(np.int32)), seq_lens=to_dev(seq_lens.astype(np.int32)),
            block_tables=to_dev(tables),
            query_start_loc_host=cu.tolist(), seq_lens_host=seq_lens.tolist(), block_size=bs,
            num_short=num_short, num_short_tokens=int(cu[num_short]))
        input_ids = to_device(torch.tensor(token_ids, dtype=torch.int64), dev)
        if pending_rows:
            input_ids[to_dev(np.array(pending_rows))] = self._last_tokens[to_dev(np.array(pending_src))]
        return StepInputs(
            input_ids=input_ids, positions=to_dev(positions), meta=meta,
            logits_indices=to_dev(logits_rows), sampling_requests=sampling_requests, num_rows=num_rows,
            prompt_rows=prompt_rows, pool_chunks=pool_chunks)

    def _prepare_decodes(self, requests: list[Request], short_max: int) -> StepInputs:
        """prepare for a step of plain decodes (each request's last token, no drafts, none
        pending): the same tensors from short lists, without the general path's thirty-odd numpy
        calls (called alone: 26 against 94 us at batch 1, 92 against 186 at batch 64)."""
        bs, n = self.block_size, len(requests)
        positions = [r.num_computed_tokens for r in requests]
        tables = _block_tables(requests)
        cu, seq_lens = list(range(n + 1)), [p + 1 for p in positions]
        num_short = n if short_max >= 1 else 0

        def to_dev(values, dtype=np.int64) -> torch.Tensor:  # (np.array + from_numpy: a third of torch.tensor's time)
            return to_device(torch.from_numpy(np.array(values, dtype=dtype)), self.device)
        meta = AttentionMetadata(
            slot_block=to_dev([r.block_ids[p // bs] for r, p in zip(requests, positions)]),
            slot_offset=to_dev([p % bs for p in positions]), query_start_loc=to_dev(cu, np.int32),
            seq_lens=to_dev(seq_lens, np.int32), block_tables=to_dev(tables, np.int32), query_start_loc_host=cu,
            seq_lens_host=seq_lens, block_size=bs, num_short=num_short, num_short_tokens=num_short)
        return StepInputs(input_ids=to_dev([r.token_ids[p] for r, p in zip(requests, positions)]),
                          positions=to_dev(positions), meta=meta, logits_indices=to_dev(cu[:-1]),
                          sampling_requests=list(requests), num_rows=[1] * n)


def kv_pool_blocks(config: EngineConfig, device: torch.device, bytes_per_token: int, max_len: int) -> int:
    """Blocks in the KV pool: config.num_kv_blocks, or as many as the memory for it holds
    (kv_cache_memory; 85% of the GPU's free memory; on the CPU enough for every sequence at full
    length, up to 4 GiB, since pages never touched cost nothing). bytes_per_token: K and V of one
    token in every layer, the draft model's included."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    bytes_per_block = config.block_size * bytes_per_token
    if config.kv_cache_memory is not None:
        budget = parse_size(config.kv_cache_memory, "kv_cache_memory")
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * 0.85)
    else:
        budget = min(DEFAULT_CPU_KV_MEMORY, config.max_num_seqs * max_len * bytes_per_token)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        held_by = (f"kv_cache_memory={config.kv_cache_memory!r}" if config.kv_cache_memory is not None
                   else f"the KV pool's default budget ({budget} bytes)")
        raise ValueError(f"a KV block of block_size={config.block_size} tokens takes {bytes_per_block} bytes, "
                         f"more than {held_by} holds: lower block_size or raise kv_cache_memory")
    return num_blocks


def pool_too_big(config: EngineConfig, device: torch.device, num_blocks: int, num_host_blocks: int,
                 bytes_per_block: int, exc: Exception) -> str:
    """The pools asked for, in blocks and bytes, and the options that sized them: "Cannot allocate
    memory" alone named neither."""
    reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    pools = (f"the pool of {num_blocks} blocks x {bytes_per_block} bytes "
             f"({num_blocks * bytes_per_block / 1024**3:.2f} GiB) on {device}")
    flags = "--num-kv-blocks" if config.num_kv_blocks is not None else "--kv-cache-memory"
    if num_host_blocks:
        pools += (f" and the swap pool of {num_host_blocks} blocks "
                  f"({num_host_blocks * bytes_per_block / 1024**3:.2f} GiB) in host memory")
        flags += " or --swap-space"
    return f"cannot allocate the KV cache ({reason}): {pools}; lower {flags}"


def seed_bits(seed: int, device: torch.device) -> int:
    """A request's seed for its generator. The CPU one (mt19937) keeps only the low 32 bits, so
    seeds 1 and 2^32 + 1 drew the same numbers: there a seed outside [0, 2^32) is mixed down to
    32 bits (splitmix64's finalizer) rather than cut."""
    if device.type != "cpu" or 0 <= seed < 1 << 32:
        return seed
    mask = (1 << 64) - 1
    z = seed & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def _block_tables(requests: list[Request]) -> np.ndarray:
    """(B, max blocks) int32: each request's block ids, padded with 0."""
    tables = np.zeros((len(requests), max(len(r.block_ids) for r in requests)), dtype=np.int32)
    for i, r in enumerate(requests):
        tables[i, :len(r.block_ids)] = r.block_ids
    return tables
