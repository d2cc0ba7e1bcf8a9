"""Iteration-level scheduling (Orca) over a paged KV pool, with chunked prefill.

Every step rebuilds the batch from counters, with no prefill or decode phase:
each request is granted `min(num_tokens - num_computed_tokens, budget)` tokens.

  1. Running requests that are decoding get their one token each, first.
  2. Running requests still inside their prompt get the next chunk of it.
     (Both in admission order under fcfs, else in the policy's order. Under priority, the
     priorities go in order, each one's decodes before its prompt chunks: a more urgent prompt
     takes the budget before less urgent decodes, and is held back only for decoders at least
     as urgent as it, below.)
  3. Waiting requests are admitted in policy order while the budget, `max_num_seqs` and the
     KV pool (less a watermark) allow; each gets a chunk of its prompt.

Under the priority policy a waiting request that finds no room (`max_num_seqs` reached, or the
pool short) first preempts running requests of lower priority, lowest first, as many as it takes
and only if that makes room; the victims wait behind it. This happens before step 1, while no
running request holds blocks for this step yet, so nothing has to be unscheduled.

A step that carries decodes gives long prompts (more tokens than `long_prefill_token_threshold`,
by default one step's budget; prompt and output for a request replayed after preemption) only
max(`long_prefill_min_chunk`, decodes / 2) tokens, all of them together: a step's
cost grows with its tokens, so that keeps the step every decoding user waits on to about 1.5x
its projections' cost without the prompt (the chunk's attention over a long context adds to
that: 1.6-1.9x in all, measured in BENCHMARKS.md), and one huge prompt cannot stretch it
(Sarathi-style stall-free batching). A step without decodes gives it the whole budget.

When a running request needs a block and the pool is empty, the running request the
policy values least (among those not yet scheduled in this step) is preempted. By
recompute (the default): its blocks are freed, its counter is reset and it waits again
at the front; its prompt and output are replayed later, and prefix caching usually hands
most of them back. By swap: its blocks are copied to a host pool and back when it is
readmitted, counter kept. A request never fails for lack of memory: the engine only
accepts requests whose full length fits the pool alone.

`update()` advances the counters with what the runner computed, appends sampled
tokens, and finishes requests on EOS, stop tokens, max_tokens or max_model_len.
Finished requests leave in the same step; their blocks are free for the next one.

Async scheduling (the engine's, on a GPU) schedules step N+1 while step N runs: `advance()`
counts N's tokens as computed at launch, and a token N samples is pending until N's
`update()`. A request that ends by length with its pending token is not scheduled again, and
while one holds blocks that its update will free, a request short of a block waits a step
instead of preempting anyone. One that ends by EOS or a stop has one step of wasted work,
dropped. A request preempted with a token in flight gets it at that step's update, before the
next schedule() could readmit it (no step that preempts admits).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.outputs import RunnerOutput, SchedulerOutput, SchedulerStats
from tokenmill.request import Request, RequestStatus

# A request's rank under each policy: smaller is served first and preempted last.
PolicyKey = Callable[[Request], tuple]
POLICY_KEYS: dict[str, PolicyKey] = {
    "fcfs": lambda r: (r.arrival_time,),
    "priority": lambda r: (r.priority, r.arrival_time),
    "srpf": lambda r: (r.num_remaining_prefill, r.arrival_time),
    "edf": lambda r: (r.deadline if r.deadline is not None else float("inf"), r.arrival_time),
}


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.policy_key = POLICY_KEYS[config.policy]
        self.waiting: list[Request] = []
        self.running: list[Request] = []         # admission order
        self.requests: dict[str, Request] = {}   # every unfinished request
        self._finished_ids: list[str] = []       # ended since the last schedule()
        self.num_preemptions = 0
        self.num_swapped_out = 0                 # of which by swapping
        self.missed_deadlines: list[str] = []    # edf: requests that finished after their deadline
        self._watermark_blocks = int(config.kv_watermark * kv.pool.num_blocks)
        self._swap_out: list[tuple[int, int]] = []  # this step's swap-out copies

    # ---- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request wherever it is (waiting, mid-prefill, running, preempted) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)  # (a failed step has already made the whole pool forget its hashes)
        request.status = status
        request.times.finished = self.clock()
        if request.deadline is not None and request.times.finished > request.deadline:
            self.missed_deadlines.append(request_id)
        self._finished_ids.append(request_id)
        return request

    def prompt_tokens_waiting(self) -> int:
        """Prompt tokens still to compute: the waiting requests' and the running ones' mid-prompt."""
        return (sum(r.num_remaining_prefill for r in self.waiting)
                + sum(r.num_remaining_prefill for r in self.running if r.num_remaining_prefill > 1))

    def end_on_stop_string(self, request: Request, num_dropped: int, stop: str) -> None:
        """End a request on a stop string found in its text (the output processor finds them),
        taking back its last `num_dropped` output tokens: accepted drafts past the one that
        completed the string. A stop string outranks a length limit the same token reached."""
        if num_dropped:
            request.drop_output_tokens(num_dropped)
        if not request.is_finished:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = stop

    def distrust_step(self, sched: SchedulerOutput) -> None:
        """After a step that failed: forget every cached prefix (the step may have left blocks half
        written; a request a late stop string ended meanwhile is not among the step's), and
        recompute the requests it swapped out (their host copies may never have been written)."""
        self.kv.forget_cached(self.running)
        for request_id in sched.preempted_request_ids:
            request = self.requests.get(request_id)
            if request is not None and request.swapped_block_ids:
                self.kv.free(request)

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_blocks_used=pool.num_used_blocks,
            kv_blocks_free=pool.num_free_blocks, kv_blocks_total=pool.num_blocks,
            kv_slots_used=self.kv.slots_filled(self.running), prefix_tokens_queried=self.kv.prompt_tokens_queried,
            prefix_tokens_hit=self.kv.prompt_tokens_hit, num_evictions=pool.num_evictions,
            num_preemptions=self.num_preemptions)

    # ---- schedule ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        static = self.config.static_batching
        budget = self.config.max_num_batched_tokens if not static else 1 << 62
        scheduled: dict[Request, int] = {}
        drafts: dict[Request, int] = {}
        preempted: list[Request] = []
        self._swap_out, swap_in = [], []
        admit_new = not static or not self.running
        if admit_new and self.config.policy == "priority":
            preempted += self._make_room_by_priority(budget)
        victims = set(preempted)  # not readmitted in this step (async: a token of theirs may be in flight)
        short = False  # a running request found the pool empty: admit nobody this step
        decoders: list[int] = []  # priorities of this step's decodes so far (they set long prompts' allowance)
        long_tokens = 0  # tokens granted so far to long prompts held back beside them

        def decodes_ahead_of(request: Request) -> int:
            """The decodes a waiting long prompt is held back for: under priority, those at least
            as urgent (running requests come in priority order: all of them so far)."""
            if self.config.policy != "priority":
                return len(decoders)
            return sum(1 for p in decoders if p <= request.priority)

        # 1 + 2: running requests, decodes before prompt chunks (by priority first under priority).
        for request in self._running_order():
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._ends_in_flight(request):
                continue  # async scheduling: it ends with the token in flight, by length
            num_new, held = self._chunk(request, request.num_remaining_prefill, budget, len(decoders), long_tokens)
            if num_new == 0:
                continue  # a long prompt whose share of this step went to an earlier one
            if request.draft_token_ids and request.num_remaining_prefill == 1:
                # Speculation: the last sampled token plus the drafts to verify, within the budget.
                request.draft_token_ids = request.draft_token_ids[:budget - 1]
                num_new = 1 + len(request.draft_token_ids)
            while not self.kv.allocate(request, num_new):
                if request.draft_token_ids:  # drafts are a bet: dropped before anyone is preempted for them
                    request.draft_token_ids, request.draft_probs = [], None
                    num_new = 1
                    continue
                if any(self._ends_in_flight(r) for r in self.running):
                    break  # async scheduling: blocks come back at the in-flight step's update; wait a step
                victim = self._pick_victim(exclude=scheduled) or request
                self._preempt(victim)
                preempted.append(victim)
                short = True
                if victim is request:
                    break
            else:
                scheduled[request] = num_new
                drafts[request] = len(request.draft_token_ids)
                budget -= num_new
                if request.num_remaining_prefill == 1:
                    decoders.append(request.priority)
                long_tokens += num_new if held else 0

        # 3: admit waiting requests (none in a step where a running one had to preempt: memory is short).
        while (admit_new and not short and len(self.waiting) > len(victims) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self._next_waiting(exclude=victims)
            reserve = self._watermark_blocks if self.running else 0
            if request.swapped_block_ids:  # swapped out: copy its blocks back, counter kept
                num_new, held = self._chunk(request, request.num_remaining_prefill, budget, decodes_ahead_of(request),
                                            long_tokens)
                if num_new == 0 or not self.kv.can_swap_in(request, num_new, reserve=reserve):
                    break
                swap_in.extend(self.kv.swap_in(request, num_new))
            else:
                hit = self.kv.find_prefix(request)
                num_new, held = self._chunk(request, request.num_tokens - hit.num_tokens, budget,
                                            decodes_ahead_of(request), long_tokens)
                if num_new == 0 or not self.kv.can_allocate(request, num_new, hit, reserve=reserve):
                    break
                self.kv.allocate(request, num_new, hit)
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = self.clock()
            scheduled[request] = num_new
            drafts[request] = 0
            budget -= num_new
            long_tokens += num_new if held else 0

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            requests=list(scheduled), num_scheduled_tokens=list(scheduled.values()),
            num_draft_tokens=list(drafts.values()),
            num_decode_tokens=sum(1 + drafts[r] for r in scheduled if r.num_output_tokens + r.num_pending_tokens > 0
                                  and r.num_remaining_prefill == 1),
            preempted_request_ids=[r.request_id for r in preempted], finished_request_ids=finished,
            swap_out=self._swap_out, swap_in=swap_in)

    def _chunk(self, request: Request, remaining: int, budget: int, num_decodes: int,
               long_tokens: int) -> tuple[int, bool]:
        """Tokens to compute for a request with `remaining` to go, within the budget, and whether
        it is held back: a long request (by its whole length, so its last chunks stay small too)
        in a step with decodes gets what is left of the step's one allowance for long prompts."""
        threshold = self.config.long_prefill_token_threshold
        if num_decodes and threshold and remaining > 1 and request.num_tokens > threshold:
            allowance = max(self.config.long_prefill_min_chunk, num_decodes // 2) - long_tokens
            return min(remaining, allowance, budget), True
        return min(remaining, budget), False

    def _next_waiting(self, exclude: set[Request] = frozenset()) -> Request:
        """The waiting request the policy serves next; preempted ones first (under the priority
        policy, first among their priority: a request that preempted one for its priority must
        not see it come back ahead of it), then any request that has waited
        `starvation_seconds` (oldest first), then the policy's order."""
        now = self.clock()
        starve = self.config.starvation_seconds
        by_priority = self.config.policy == "priority"

        def rank(r: Request) -> tuple:
            preempted = r.status == RequestStatus.PREEMPTED
            if preempted and not by_priority:
                return (0, r.arrival_time)
            if now - r.arrival_time >= starve:
                return (1, r.arrival_time)
            if by_priority:
                return (2, r.priority, not preempted, r.arrival_time)
            return (2, *self.policy_key(r))
        return min((r for r in self.waiting if r not in exclude), key=rank)

    def _make_room_by_priority(self, budget: int) -> list[Request]:
        """Preempt running requests of lower priority than the next waiting one until it has a
        seat under `max_num_seqs` and blocks for its first chunk (estimated with the step's
        budget less one token per request left running); none at all if even every such request
        would not make room. Lowest priority first, ties latest admitted (as `_pick_victim`)."""
        if not self.waiting or any(self._ends_in_flight(r) for r in self.running):
            return []  # (async scheduling: blocks come back at the in-flight step's update)
        request = self._next_waiting()
        lower = [(i, r) for i, r in enumerate(self.running) if r.priority > request.priority]
        if not lower:
            return []
        lower = [r for _, r in sorted(lower, key=lambda ir: (ir[1].priority, ir[0]), reverse=True)]
        hit = None if request.swapped_block_ids else self.kv.find_prefix(request)
        remaining = request.num_remaining_prefill if hit is None else request.num_tokens - hit.num_tokens
        refs = self.kv.pool.ref_counts
        keep = set(hit.block_ids) if hit is not None else set()
        freed = 0  # blocks the first n victims hold alone (those of the hit would be revived anyway)
        for n in range(len(lower) + 1):
            if n:
                freed += sum(1 for b in lower[n - 1].block_ids if refs[b] == 1 and b not in keep)
            left = len(self.running) - n
            tokens = min(remaining, max(1, budget - left))
            reserve = self._watermark_blocks if left else 0
            if left < self.config.max_num_seqs and self.kv.admission_shortfall(request, tokens, hit) + reserve <= freed:
                for victim in lower[:n]:
                    self._preempt(victim)
                return lower[:n]
        return []

    def _running_order(self) -> list[Request]:
        """Decodes before prompt chunks; within each, admission order under fcfs, else the
        policy's (under priority, by priority first: see the module's docstring). Those first in
        line take the last free blocks, and a victim is picked only among those not yet
        scheduled: in admission order, a low-priority request admitted earlier took the last
        block and the high-priority one behind it had to preempt itself."""
        if self.config.policy == "fcfs":
            return sorted(self.running, key=lambda r: r.num_remaining_prefill > 1)  # stable: admission order
        if self.config.policy == "priority":
            return sorted(self.running, key=lambda r: (r.priority, r.num_remaining_prefill > 1, r.arrival_time))
        return sorted(self.running, key=lambda r: (r.num_remaining_prefill > 1, *self.policy_key(r)))

    def _pick_victim(self, exclude: dict[Request, int]) -> Request | None:
        """The running request to preempt, among those not yet scheduled in this step (their
        blocks may already be registered for this step's tokens): under fcfs the latest
        admitted, otherwise the one the policy ranks last (ties: latest admitted). Never called
        while a request ends with its token in flight: schedule() waits for its blocks instead."""
        candidates = [(i, r) for i, r in enumerate(self.running) if r not in exclude]
        if not candidates:
            return None
        if self.config.policy == "fcfs":
            return candidates[-1][1]
        return max(candidates, key=lambda ir: (*self.policy_key(ir[1]), ir[0]))[1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.draft_token_ids, request.draft_probs = [], None
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(request):
            self._swap_out.extend(self.kv.swap_out(request))
            self.num_swapped_out += 1
        else:  # recompute (or swap with a full host pool)
            self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)

    def _ends_in_flight(self, request: Request) -> bool:
        """Async scheduling: its pending token is its last, by length (it finishes at that step's update)."""
        if not request.num_pending_tokens:
            return False
        return (request.num_output_tokens + request.num_pending_tokens >= request.max_tokens
                or request.num_tokens + request.num_pending_tokens >= self.config.max_model_len)

    # ---- update -----------------------------------------------------------------------

    def advance(self, sched: SchedulerOutput) -> None:
        """Async scheduling: count a launched step's tokens as computed before its sampled tokens
        reach the host, so that the next step can be scheduled meanwhile; a sequence that samples
        holds a pending token until `update(..., advanced=True)` appends it. No speculation here."""
        for request, num_new in zip(sched.requests, sched.num_scheduled_tokens):
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens + request.num_pending_tokens:
                request.num_pending_tokens += 1

    def update(self, sched: SchedulerOutput, result: RunnerOutput, advanced: bool = False) -> list[Request]:
        """Advance counters (unless `advance` did), append sampled tokens, finish what must stop.

        Returns the requests that got new tokens or finished in this step. After `advance`, a
        request preempted since the step was launched still gets its token.
        """
        now = self.clock()
        changed = []
        for request, num_new, num_draft in zip(sched.requests, sched.num_scheduled_tokens, sched.num_draft_tokens):
            if request.is_finished:
                continue  # ended while the step ran
            new_tokens = result.sampled_token_ids.get(request.request_id, [])
            if advanced:
                request.num_pending_tokens -= len(new_tokens)
            else:
                # Speculation: len(new_tokens) - 1 drafts were accepted. The K/V written for the rejected
                # ones lies past the counter (overwritten later) and blocks only they needed are freed.
                rejected = num_draft - max(len(new_tokens) - 1, 0)
                request.num_computed_tokens += num_new - rejected
                request.draft_token_ids, request.draft_probs = [], None
                if rejected:
                    self.kv.trim(request)
            if scores := result.prompt_logprobs.get(request.request_id):
                first, entries = scores  # a recomputed prompt (after preemption) is scored once
                if first <= len(request.prompt_logprobs):
                    request.prompt_logprobs.extend(entries[len(request.prompt_logprobs) - first:])
            if not new_tokens:
                continue  # a prompt chunk that did not reach the end
            # Sampled tokens are appended (each checked for a stop); the last one's K/V is computed next step.
            appended = 0
            for token in new_tokens:
                request.append_token(token, now)
                appended += 1
                status = self._stop_status(request, token)
                if status is not None:
                    self.finish_request(request.request_id, status)
                    break
            if logprobs := result.logprobs.get(request.request_id):
                request.output_logprobs.extend(logprobs[:appended])
                request.cumulative_logprob += sum(entry[token] for token, entry in zip(new_tokens, logprobs[:appended]))
            changed.append(request)
        return changed

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        """Length first, as in vLLM: a stop token that is also the last one allowed ends the request
        by length (and stays in its text). A completed grammar ends it even under min_tokens:
        no token may follow. A failed one ends it with an error, whatever else held."""
        params = request.params
        if request.grammar is not None and request.grammar.failed:
            return RequestStatus.FINISHED_ERROR
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.grammar is not None and request.grammar.is_terminated:  # nothing may follow
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens > params.min_tokens:  # EOS and stop tokens only after min_tokens
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        return None
