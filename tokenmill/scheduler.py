"""Iteration-level scheduling (Orca) over a paged KV pool, with chunked prefill.

Every step rebuilds the batch from counters, with no prefill or decode phase:
each request is granted `min(num_tokens - num_computed_tokens, budget)` tokens.

  1. Running requests that are decoding get their one token each, first.
  2. Running requests still inside their prompt get the next chunk of it.
     (Both in the policy's running order: under priority, the priorities go in order, each
     one's decodes before its prompt chunks.)
  3. Waiting requests are admitted in the policy's order while the budget, `max_num_seqs` and
     the KV pool (less a watermark) allow; each gets a chunk of its prompt.

A policy that preempts at admission (priority) lets a waiting request that finds no room
(`max_num_seqs` reached, or the pool short) first preempt the running requests the policy
offers, in its order, as many as it takes and only if that makes room; the victims wait
behind it. This happens before step 1, while no running request holds blocks for this step
yet, so nothing has to be unscheduled. The policies live in `policies.py`.

A step that carries decodes gives long prompts (more tokens than `long_prefill_token_threshold`,
by default one step's budget; prompt and output for a request replayed after preemption) only
max(`long_prefill_min_chunk`, decodes / 2) tokens, all of them together, counting the decodes
the policy says a prompt is held back for. A step's cost grows with its tokens, so that keeps
the step every decoding user waits on close to its cost without the prompt, and one huge
prompt cannot stretch it (Sarathi-style stall-free batching). A step without decodes gives
it the whole budget.

When a running request needs a block and the pool is empty, the running request the
policy picks (among those not yet scheduled in this step) is preempted. By recompute
(the default): its blocks are freed, its counter is reset and it waits again, at the
front of the queue (under priority, of its own priority's); its prompt and output are
replayed later, and prefix caching usually hands most of them back. By swap: its blocks
are copied to a host pool and back when it is readmitted, counter kept. A request never
fails for lack of memory: the engine only accepts requests whose full length fits the
pool alone.

`update()` advances the counters with what the runner computed, appends sampled
tokens, and finishes requests on EOS, stop tokens, max_tokens or max_model_len.
Finished requests leave in the same step; their blocks are free for the next one, unless a KV
connector holds them for a peer to read (disaggregated prefill, kv_connector.py): then they stay
allocated, in `held`, until the connector names the request in released(), which schedule()
and release_held() ask. A request whose prompt K/V a connector brings in waits apart, in
`loading` with its blocks and a seat, while the load runs, and joins the running batch when it
ends (scheduler_connector.py).
An embedding request (`request.pooling`) is scheduled as any prompt and samples nothing: it
ends ("stop") at the update of the step that ran the end of its prompt, with the pooled vector
the runner reports.
An encoder's request (`request.bidirectional`) is granted its whole prompt in one step or waits:
its tokens attend to each other both ways, so no part of it can run before the rest.

Async scheduling (the engine's, on a GPU) schedules step N+1 while step N runs: `advance()`
counts N's tokens as computed at launch, and a token N samples is pending until N's
`update()`. A request that ends by length with its pending token is not scheduled again, and
while one holds blocks that its update will free, a request short of a block waits a step
instead of preempting anyone. One that ends by EOS or a stop has one step of wasted work,
dropped. A request preempted with a token in flight gets it at that step's update, before the
next schedule() could readmit it (no step that preempts admits).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_connector import KVConnector
from tokenmill.outputs import RequestProgress, RunnerOutput, SchedulerOutput, SchedulerSnapshot, SchedulerStats
from tokenmill.policies import make_policy
from tokenmill.request import Request, RequestStatus
from tokenmill.scheduler_connector import ConnectorSteps


@dataclass
class _StepPlan:
    """The step `schedule()` is building: what it has granted so far and what is left."""

    budget: int                                                        # tokens left in the step
    scheduled: dict[Request, int] = field(default_factory=dict)        # tokens per request, batch order
    drafts: dict[Request, int] = field(default_factory=dict)           # draft tokens among them
    preempted: list[Request] = field(default_factory=list)             # in the order they were preempted
    admission_victims: set[Request] = field(default_factory=set)       # not readmitted in this step
    short: bool = False              # a running request found the pool empty: admit nobody this step
    decodes: list[Request] = field(default_factory=list)  # running decodes granted so far
    long_tokens: int = 0             # tokens granted so far to long prompts held back beside decodes
    swap_in: list[tuple[int, int]] = field(default_factory=list)       # (host block, device block) copies

    def grant(self, request: Request, num_new: int, num_draft: int, held: bool) -> None:
        self.scheduled[request] = num_new
        self.drafts[request] = num_draft
        self.budget -= num_new
        self.long_tokens += num_new if held else 0


class Scheduler(ConnectorSteps):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic, connector: KVConnector | None = None) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector               # K/V from elsewhere (kv_connector.py); none by default
        self.clock = clock
        self.policy = make_policy(config.policy, config.starvation_seconds)
        self.waiting: list[Request] = []
        self.running: list[Request] = []         # admission order
        self.requests: dict[str, Request] = {}   # every unfinished request
        self.held: dict[str, Request] = {}       # finished, blocks kept for a KV connector's peer
        self.loading: dict[str, tuple[Request, int]] = {}  # waiting on a KV connector's load: (request, tokens)
        self._finished_ids: list[str] = []       # ended since the last schedule()
        self.num_steps = 0                       # steps scheduled (timelines name a chunk's step)
        self.num_preemptions = 0
        self.prompt_tokens_queried = 0  # prefix cache: prompt tokens of first admissions (_count_admission)
        self.prompt_tokens_hit = 0      # of which served from the cache
        self.num_swapped_out = 0                 # of which by swapping
        self.num_external_tokens = 0             # prompt tokens whose K/V the connector brought in
        self.num_missed_deadlines = 0            # cumulative: requests that finished after their deadline
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
        elif self.loading.pop(request_id, None) is not None:
            self.connector.cancel_load(request_id)  # before its blocks go back to the pool
        request.status = status
        now = self.clock()
        request.timeline.add(now, "finished", finish_reason=request.finish_reason)
        result = self.connector.on_finish(request, request.block_ids) if self.connector is not None else None
        request.kv_transfer_params = result.kv_transfer_params if result is not None else None
        if result is not None and result.hold_blocks:
            self.held[request_id] = request  # freed when the connector releases it (release_held)
        else:
            self._free(request)  # (a failed step has already made the whole pool forget its hashes)
        if request.deadline is not None and now > request.deadline:
            self.num_missed_deadlines += 1
        self._finished_ids.append(request_id)
        return request

    def prompt_tokens_waiting(self) -> int:
        """Prompt tokens still to compute: the waiting requests' and the running ones' mid-prompt."""
        return (sum(r.num_remaining_prefill for r in self.waiting)
                + sum(r.num_remaining_prefill for r in self.running if r.num_remaining_prefill > 1)
                + sum(r.num_remaining_prefill for r, _ in self.loading.values()))

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
                self._free(request)

    def needs_past_tokens(self) -> bool:
        """Whether a request's next step reads its last tokens on the host (penalties, grammars, bad
        words): then a step cannot be scheduled before the last one is collected."""
        return any(r.params.has_penalties or r.grammar is not None or r.bad_words_token_ids
                   for r in self.requests.values())

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting) + len(self.loading),
            kv_blocks_used=pool.num_used_blocks, kv_blocks_free=pool.num_free_blocks,
            kv_blocks_cached=pool.num_evictable_blocks, kv_blocks_total=pool.num_blocks,
            kv_slots_used=self.kv.slots_filled(self.running), prefix_tokens_queried=self.prompt_tokens_queried,
            prefix_tokens_hit=self.prompt_tokens_hit, num_evictions=pool.num_evictions,
            num_preemptions=self.num_preemptions, num_external_tokens=self.num_external_tokens,
            num_held_requests=len(self.held), kv_blocks_held=sum(len(r.block_ids) for r in self.held.values()),
            num_missed_deadlines=self.num_missed_deadlines)

    def snapshot(self, max_waiting: int = 256) -> SchedulerSnapshot:
        """The pool's block states and the requests' progress, copied: call it between steps, on
        the thread that steps (the dashboard does, only while someone watches). Lists the first
        `max_waiting` waiting requests in the order the policy would admit them now: a flood of
        thousands must not make each copy slow."""
        first = itertools.islice(self.policy.waiting_order(self.waiting, self.clock()), max_waiting)
        return SchedulerSnapshot(
            step=self.num_steps, block_size=self.kv.block_size, block_states=self.kv.pool.block_states(),
            running=[RequestProgress.of(r) for r in self.running],
            waiting=[RequestProgress.of(r) for r in first], num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions)

    # ---- schedule ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next step: room made at admission (if the policy preempts there), then
        running requests, then waiting ones, as the module's docstring describes."""
        self.release_held()
        self.collect_loads()
        static = self.config.static_batching
        plan = _StepPlan(budget=self.config.max_num_batched_tokens if not static else 1 << 62)
        self._swap_out = []
        admit = not static or not self.running
        if admit and self.policy.preempts_at_admission:
            plan.preempted += self._make_room_at_admission(plan.budget)
            plan.admission_victims = set(plan.preempted)  # (async: a token of theirs may be in flight)
        self._schedule_running(plan)
        if admit and not plan.short:  # a step where a running request had to preempt is short of memory
            self._admit_waiting(plan)
        return self._output(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Steps 1 and 2: running requests in the policy's order, each its next token or chunk,
        preempting the policy's victim when the pool is empty."""
        for request in self.policy.running_order(self.running):
            if plan.budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._ends_in_flight(request):
                continue  # async scheduling: it ends with the token in flight, by length
            num_new, held = self._chunk(request, request.num_remaining_prefill, plan)
            if num_new == 0:
                continue  # a long prompt whose share of this step went to an earlier one
            if request.draft_token_ids and request.num_remaining_prefill == 1:
                # Speculation: the last sampled token plus the drafts to verify, within the budget.
                request.draft_token_ids = request.draft_token_ids[:plan.budget - 1]
                num_new = 1 + len(request.draft_token_ids)
            self.kv.release_outside_window(request)  # windowed models: blocks no later query sees
            num_new = self._allocate_running(request, num_new, plan)
            if num_new == 0:
                continue
            plan.grant(request, num_new, len(request.draft_token_ids), held)
            if request.num_remaining_prefill == 1:
                plan.decodes.append(request)

    def _allocate_running(self, request: Request, num_new: int, plan: _StepPlan) -> int:
        """Blocks for `num_new` tokens of a running request; returns how many tokens got them.

        While the pool is short: its drafts go first (1 token left), then the policy's victim
        among those not yet scheduled (or the request itself, then 0). 0 without preempting
        anyone while a request ends with its token in flight: its blocks come back at that
        step's update, so the request waits a step instead."""
        while not self.kv.allocate(request, num_new):
            if request.draft_token_ids:  # drafts are a bet: dropped before anyone is preempted for them
                request.draft_token_ids, request.draft_probs = [], None
                num_new = 1
                continue
            if any(self._ends_in_flight(r) for r in self.running):
                return 0
            victim = self._pick_victim(exclude=plan.scheduled) or request
            self._preempt(victim, "pool_full")
            plan.preempted.append(victim)
            plan.short = True
            if victim is request:
                return 0
        return num_new

    def _admit_waiting(self, plan: _StepPlan) -> None:
        """Step 3: waiting requests in the policy's order while the budget, `max_num_seqs` and
        the pool allow (not those preempted at admission in this step)."""
        queue = self.policy.waiting_order((r for r in self.waiting if r not in plan.admission_victims), self.clock())
        while plan.budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            request = next(queue, None)
            if request is None:
                break
            started = self._start_load(request)
            if started is None:
                break  # its K/V does not fit yet
            if started:
                continue
            resuming, swapped = request.status == RequestStatus.PREEMPTED, len(request.swapped_block_ids)
            num_new, held = self._allocate_waiting(request, plan)
            if num_new == 0:
                break
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if not resuming:
                self._count_admission(request)
                request.timeline.add(self.clock(), "admitted", cached=request.num_cached_tokens)
            elif swapped:
                request.timeline.add(self.clock(), "resumed", swapped_blocks=swapped)
            else:  # its own discarded work back from the cache, if still there: not a prefix hit
                request.timeline.add(self.clock(), "resumed", cached=request.num_computed_tokens)
            plan.grant(request, num_new, 0, held)

    def _allocate_waiting(self, request: Request, plan: _StepPlan) -> tuple[int, bool]:
        """Blocks for the first chunk of a waiting request, keeping the watermark free unless
        the batch is empty: a swapped-out request's blocks are copied back (counter kept), any
        other starts after its prefix-cache hit. Returns (tokens, held back), (0, False) if the
        chunk is empty or does not fit."""
        reserve = self._watermark_blocks if self.running else 0
        if request.swapped_block_ids:
            num_new, held = self._chunk(request, request.num_remaining_prefill, plan)
            if num_new == 0 or not self.kv.can_swap_in(request, num_new, reserve=reserve):
                return 0, False
            plan.swap_in.extend(self.kv.swap_in(request, num_new))
            return num_new, held
        hit = self.kv.find_prefix(request)
        num_new, held = self._chunk(request, request.num_tokens - hit.num_tokens, plan)
        if num_new == 0 or not self.kv.can_allocate(request, num_new, hit, reserve=reserve):
            return 0, False
        self.kv.allocate(request, num_new, hit)
        self._count_hit(request, hit.num_tokens)
        return num_new, held

    def _count_admission(self, request: Request) -> None:
        """A request's first admission in the prefix cache's counters (vLLM's queries and hits). A
        resumed one finding its own blocks again, or one admitted again after a failed KV load,
        is not counted twice; one that never looks in the cache (needs_every_position) not at all."""
        if self.kv.enable_prefix_caching and request.num_preemptions == 0 and not request.needs_every_position:
            self.prompt_tokens_queried += request.num_tokens
            self.prompt_tokens_hit += request.num_cached_tokens

    def _count_hit(self, request: Request, num_tokens: int) -> None:
        request.num_computed_tokens += num_tokens
        if request.status == RequestStatus.WAITING:  # a preempted request's own work is no prefix hit
            request.num_cached_tokens = num_tokens

    def _output(self, plan: _StepPlan) -> SchedulerOutput:
        """The step as the runner sees it; hands over the requests finished since the last one."""
        finished, self._finished_ids = self._finished_ids, []
        scheduled, drafts = plan.scheduled, plan.drafts
        self.num_steps += 1
        now = None
        for request, num_new in scheduled.items():
            if request.num_remaining_prefill > 1:  # a prompt chunk (or a recomputed stretch)
                now = self.clock() if now is None else now
                request.timeline.add(now, "chunk", step=self.num_steps, tokens=num_new)
        return SchedulerOutput(
            requests=list(scheduled), num_scheduled_tokens=list(scheduled.values()),
            num_draft_tokens=list(drafts.values()),
            num_decode_tokens=sum(1 + drafts[r] for r in scheduled if r.num_output_tokens + r.num_pending_tokens > 0
                                  and r.num_remaining_prefill == 1),
            preempted_request_ids=[r.request_id for r in plan.preempted], finished_request_ids=finished,
            swap_out=self._swap_out, swap_in=plan.swap_in,
            pooling=[r for r in scheduled if r.pooling is not None])

    def _chunk(self, request: Request, remaining: int, plan: _StepPlan) -> tuple[int, bool]:
        """Tokens to compute for a request with `remaining` to go, within the budget, and whether
        it is held back: a long request (by its whole length, so its last chunks stay small too)
        in a step with decodes it is held back for (the policy says which) gets what is left of
        the step's one allowance for long prompts. An encoder's request gets all it has to go or nothing."""
        if request.bidirectional:
            return (remaining, False) if remaining <= plan.budget else (0, False)
        threshold = self.config.long_prefill_token_threshold
        if plan.decodes and threshold and remaining > 1 and request.num_tokens > threshold:
            num_decodes = self.policy.decodes_ahead_of(request, plan.decodes)
            if num_decodes:
                allowance = max(self.config.long_prefill_min_chunk, num_decodes // 2) - plan.long_tokens
                return min(remaining, allowance, plan.budget), True
        return min(remaining, plan.budget), False

    def _next_waiting(self) -> Request:
        """The waiting request the policy admits next."""
        return self.policy.next_waiting(self.waiting, self.clock())

    def _make_room_at_admission(self, budget: int) -> list[Request]:
        """Preempt the running requests the policy lets the next waiting one preempt, in the
        policy's order, until it has a seat under `max_num_seqs` and blocks for its first chunk
        (estimated with the step's budget less one token per request left running); none at
        all if even every such request would not make room. Returns the victims."""
        if not self.waiting or any(self._ends_in_flight(r) for r in self.running):
            return []  # (async scheduling: blocks come back at the in-flight step's update)
        request = self._next_waiting()
        candidates = self.policy.admission_victims(request, self.running)
        if not candidates:
            return []
        hit = None if request.swapped_block_ids else self.kv.find_prefix(request)
        external = 0 if hit is None else self._external_tokens(request, hit.num_tokens)
        remaining = request.num_remaining_prefill if hit is None else request.num_tokens - hit.num_tokens - external
        keep = set(hit.block_ids) if hit is not None else set()
        freed = 0  # blocks the first n victims hold alone (those of the hit would be revived anyway)
        for n in range(len(candidates) + 1):
            if n:
                freed += self.kv.blocks_held_alone(candidates[n - 1], keep)
            left = len(self.running) - n
            tokens = min(remaining, max(1, budget - left))
            reserve = self._watermark_blocks if left else 0
            short = self.kv.admission_shortfall(request, external + tokens, hit) + reserve
            if left < self.config.max_num_seqs and short <= freed:
                for victim in candidates[:n]:
                    self._preempt(victim, "admission")
                return candidates[:n]
        return []

    def _pick_victim(self, exclude: dict[Request, int]) -> Request | None:
        """The running request the policy preempts, among those not yet scheduled in this step
        (their blocks may already be registered for this step's tokens). Never called while a
        request ends with its token in flight: schedule() waits for its blocks instead."""
        return self.policy.pick_victim([r for r in self.running if r not in exclude])

    def _free(self, request: Request) -> None:
        """Return a request's blocks; it computes its tokens again from the start if it runs again."""
        self.kv.free(request)
        request.num_computed_tokens = 0

    def _preempt(self, request: Request, reason: str) -> None:
        """Out of the batch, back to the waiting queue: its blocks swapped out or freed. reason:
        "pool_full" (a running request needed blocks) or "admission" (a more urgent one did)."""
        self.running.remove(request)
        request.draft_token_ids, request.draft_probs = [], None
        tokens = request.num_computed_tokens
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(request):
            self._swap_out.extend(self.kv.swap_out(request))
            self.num_swapped_out += 1
            request.timeline.add(self.clock(), "preempted", reason=reason, mode="swap", tokens=tokens)
        else:  # recompute (or swap with a full host pool)
            self._free(request)
            request.timeline.add(self.clock(), "preempted", reason=reason, mode="recompute", tokens=tokens)
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
        holds a pending token until `update(..., advanced=True)` appends it (an embedding request
        samples none: its update ends it). No speculation here."""
        for request, num_new in zip(sched.requests, sched.num_scheduled_tokens):
            request.num_computed_tokens += num_new
            if (request.num_computed_tokens == request.num_tokens + request.num_pending_tokens
                    and request.pooling is None):
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
                if num_draft:
                    request.timeline.add(now, "spec", proposed=num_draft, accepted=num_draft - rejected)
            if scores := result.prompt_logprobs.get(request.request_id):
                first, entries, ranks = scores  # a recomputed prompt (after preemption) is scored once
                if first <= len(request.prompt_logprobs):
                    request.prompt_logprob_ranks.extend(ranks[len(request.prompt_logprobs) - first:])
                    request.prompt_logprobs.extend(entries[len(request.prompt_logprobs) - first:])
            if result.pooled and request.request_id in result.pooled:  # an embedding's prompt has run
                request.embedding = result.pooled[request.request_id]
                self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                changed.append(request)
                continue
            if not new_tokens:
                continue  # a prompt chunk that did not reach the end
            # Sampled tokens are appended (each checked for a stop); the last one's K/V is computed next step.
            appended = 0
            for token in new_tokens:
                request.append_token(token, now)
                appended += 1
                status = request.stop_status(token, self.config.max_model_len)
                if status is not None:
                    self.finish_request(request.request_id, status)
                    break
            if logprobs := result.logprobs.get(request.request_id):
                request.output_logprobs.extend(logprobs[:appended])
                request.cumulative_logprob += sum(entry[token] for token, entry in zip(new_tokens, logprobs[:appended]))
            changed.append(request)
        return changed
