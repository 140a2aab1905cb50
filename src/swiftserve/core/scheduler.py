"""Scheduler: spends a token budget per step over running, then waiting requests.

There are no prefill/decode phases: each request's ``num_computed_tokens`` catches up with
its ``num_tokens`` a chunk at a time (chunked prefill falls out of the budget), and prefill
and decode tokens share one forward pass. When blocks run out, the worst running request
(by policy key: priority with aging, then latest arrival) is preempted by recompute.

Deadlines (core/deadlines.py) are checked at the start of every step: a request whose
deadline has passed, or that the step-cost model says cannot finish in time, ends with
``deadline_exceeded`` and frees its blocks. With latency targets, core/slo.py plans each
step's token budget; without, the budget is ``max_num_batched_tokens``.

A step's tokens count as computed when they are scheduled; a token the step will sample is a
placeholder until ``update`` (core/step_io.py, with the step's output) brings it back. With
async scheduling (engine/core.py) the next step is scheduled before that: its row for the
placeholder carries ``PLACEHOLDER`` as the token id, which the runner fills in, and a request
whose tokens in flight already reach its limit sits the step out.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from swiftserve.core.block_manager import BlockManager, fits_in_kv_pool
from swiftserve.core.deadlines import DeadlineKeeper
from swiftserve.core.messages import SchedulerOutput
from swiftserve.core.ngram import NgramProposer, SpecDecodeStats
from swiftserve.core.outputs import latencies
from swiftserve.core.request import Request, RequestStatus
from swiftserve.core.request_queue import FCFSQueue, PriorityQueue, make_queue
from swiftserve.core.slo import BudgetPlanner, SLOTargets
from swiftserve.core.step_cost import StepCostModel, attention_pairs, long_context_chunk
from swiftserve.core.step_io import StepIO


class Scheduler(StepIO):
    """Decides, step by step, which tokens of which requests the model computes."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        aging_interval_s: float = 5.0,
        edf_slack_s: float = float("inf"),
        deadline_scheduling: bool = True,
        targets: SLOTargets | None = None,
        clock: Callable[[], float] = time.monotonic,
        proposer: NgramProposer | None = None,
        async_scheduling: bool = False,
        pipeline_depth: int = 1,
    ) -> None:
        self.clock = clock  # injectable: the SLO tests run the scheduler on a simulated clock
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.policy = policy
        self.waiting = make_queue(policy, aging_interval_s, edf_slack_s, deadline_scheduling)
        self.running: list[Request] = []
        self.cost = StepCostModel()
        self.targets = targets or SLOTargets()
        self.planner = (
            BudgetPlanner(self.targets, max_num_batched_tokens, self.cost) if self.targets.any else None
        )
        self.deadlines = DeadlineKeeper(self.cost, deadline_scheduling)
        self.computed_tokens = 0  # every token scheduled so far (the denominator of waste)
        self.num_steps = 0  # steps that ran a forward, and the rows they held (mean batch size)
        self.scheduled_rows = 0
        self._step_budget = max_num_batched_tokens
        self._last_observed: float | None = None  # when observe_step last ran (the planner's turns)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: set[str] = set()
        self._new_ids: set[str] = set()
        self.proposer = proposer
        self.lookahead = proposer.lookahead if proposer is not None else 0
        self._want_drafts = False
        self.spec = SpecDecodeStats()
        self._drafts: dict[str, list[int]] = {}  # this step's drafts per request
        self._decode_rows = 0  # rows of this step that decode (the long-context chunk cap)
        # Async scheduling: the next step is scheduled while this one runs (engine/core.py), so
        # tokens not back yet are placeholders; a preempted request's runner state is rebuilt.
        self.async_mode = async_scheduling
        # id(SchedulerOutput) -> its requests, with their preemption counts when scheduled
        self._batches: dict[int, list[tuple[Request, int]]] = {}
        # Pipeline parallel: up to pipeline_depth steps in flight (engine/core.py); a request
        # whose sampled token is not back yet sits steps out, and each step takes about
        # 1/depth of the requests, so the micro-batches keep every stage busy.
        self.pipeline_depth = pipeline_depth
        self._row_cap = 1 << 30  # requests per step (pipeline parallel only)

    # ---- admission and removal -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it could never fit in the KV pool."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.check_fits(request.request_id, request.num_prompt_tokens + request.max_tokens)
        self.requests[request.request_id] = request
        self.deadlines.track(request, +1)
        self._new_ids.add(request.request_id)
        self.waiting.add(request)

    def check_fits(self, request_id: str, num_tokens: int) -> None:
        """Raise ValueError if a request of num_tokens could never fit in the KV pool.

        Reads only constants, so the frontend may call it from another thread.
        """
        fits_in_kv_pool(request_id, num_tokens, self.max_model_len, self.bm.num_blocks, self.bm.block_size)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests (abort, stop string, error) wherever they are; frees their blocks."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            if status == RequestStatus.FINISHED_ABORTED:
                self.deadlines.note_aborted(request, self.clock())
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.set_status(status)
        request.finished_time = self.clock()
        finished = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if self.planner is not None and finished:
            ttft, tpot = latencies(request)
            # triage gave lost requests' TPOT up on purpose: the margin judges the others'
            self.planner.observe_finished(ttft, None if request.slo_lost else tpot)
        self.bm.free(request)
        del self.requests[request.request_id]
        self.deadlines.track(request, -1)
        self._new_ids.discard(request.request_id)
        self._finished_ids.add(request.request_id)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)

    # ---- scheduling ----------------------------------------------------------------------
    def _key(self, request: Request) -> tuple[float, float]:
        """Smaller runs first; the worst running request is the preemption victim."""
        if isinstance(self.waiting, PriorityQueue):
            return self.waiting.sort_key(request)
        return (request.arrival_time, 0.0)

    def _preempt(self, victim: Request, scheduled: dict[str, int]) -> int:
        """Free the victim's blocks and requeue it; returns the budget it gives back."""
        self.running.remove(victim)
        self.bm.free(victim)
        victim.num_computed_tokens = 0
        victim.num_placeholders = 0
        if self.async_mode:  # the runner may hold a token the scheduler will never see
            self._finished_ids.add(victim.request_id)
            self._new_ids.add(victim.request_id)
        victim.set_status(RequestStatus.PREEMPTED)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        return scheduled.pop(victim.request_id, 0)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then waiting ones."""
        now = self.clock()
        for request in self.deadlines.due(now, self.running, self.waiting):
            self.finish_requests([request.request_id], RequestStatus.FINISHED_DEADLINE)
        budget = self._step_budget = self._plan_budget(now)
        if self.pipeline_depth > 1:
            active = len(self.running) + len(self.waiting)
            self._row_cap = max(1, -(-active // self.pipeline_depth))
        scheduled: dict[str, int] = {}
        preempted: list[str] = []
        self.running.sort(key=self._key)
        index = 0
        self._drafts = {}
        decode_rows = self._decode_rows = sum(r.num_pending == 1 for r in self.running)
        pays = self.proposer is not None and self.proposer.pays(self.cost, decode_rows, self.num_steps)
        # a draft model's proposals are paid for when made: ask for them only when it pays,
        # and verify whatever came back
        self._want_drafts = pays and self.lookahead > 0
        speculate = pays or self.lookahead > 0
        decode_left = decode_rows  # decode rows not reached yet: a prompt chunk leaves them room
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            decode_left -= request.num_pending == 1
            if request.num_pending <= 0 or self._at_limit(request) or self._in_pipeline(request):
                index += 1  # its last token is in flight; it finishes when that is back
                continue
            if len(scheduled) >= self._row_cap:
                break
            if request.num_pending > 1 and budget <= decode_left:
                index += 1  # a decode-only step (the planner's): the rows come first
                continue
            num_new = self._chunk(request.num_computed_tokens, request.num_pending, budget - decode_left)
            drafts = self._propose(request, budget) if num_new == 1 and speculate else []
            if drafts and self._allocate(request, 1 + len(drafts)):
                self._drafts[request.request_id] = drafts  # verified with the last token
                scheduled[request.request_id] = 1 + len(drafts)
                budget -= 1 + len(drafts)
                index += 1
                continue
            while not self._allocate(request, num_new):
                victim = self._victim()
                assert victim is not None  # (``request`` itself is one)
                budget += self._preempt(victim, scheduled)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
                index += 1
        if not preempted:
            budget = self._admit_waiting(scheduled, budget, preempted)
        return self._build_output(scheduled, preempted)

    def _admit_waiting(self, scheduled: dict[str, int], budget: int, preempted: list[str]) -> int:
        now = self.clock()
        while len(self.waiting) and budget > 0 and len(scheduled) < self._row_cap:
            request = self.waiting.peek()
            if len(self.running) >= self.max_num_seqs:
                if not self._preempt_for(request, scheduled, preempted):
                    break
                budget = self._step_budget - sum(scheduled.values())
                continue
            computed = self.bm.get_computed_blocks(request)
            num_computed = len(computed) * self.bm.block_size
            num_new = request.num_tokens - num_computed
            if not self.chunked and num_new > budget:
                break
            num_new = self._chunk(num_computed, num_new, budget)
            if not self._allocate(request, num_new, computed):
                if not self._preempt_for(request, scheduled, preempted):
                    break
                budget = self._step_budget - sum(scheduled.values())
                continue
            self.waiting.pop()
            self.bm.prefix_queries += request.num_tokens
            self.bm.prefix_hits += num_computed
            request.num_computed_tokens = num_computed
            request.set_status(RequestStatus.RUNNING)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = num_computed
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
        return budget

    def _allocate(self, request: Request, num_new: int, computed: list[int] | None = None) -> bool:
        """Blocks for ``num_new`` tokens, plus the draft model's lookahead slots if they fit."""
        if self.lookahead and self.bm.allocate_slots(request, num_new + self.lookahead, computed):
            return True
        return self.bm.allocate_slots(request, num_new, computed)

    def _in_pipeline(self, request: Request) -> bool:
        """Pipeline parallel: a sampled token still in flight (the first stage needs it)."""
        return self.pipeline_depth > 1 and request.num_placeholders > 0

    def _victim(self) -> Request | None:
        """The worst running request that may be preempted: with pipeline stages, not one
        whose sampled token is in flight (the stages' sampling state must stay the
        scheduler's, so a preempted request resumes exactly as with one process)."""
        for request in reversed(self.running):
            if not self._in_pipeline(request):
                return request
        return None

    def discard(self, sched: SchedulerOutput) -> None:
        """Forget a step that will not run (an empty micro-batch the engine drops)."""
        self._batches.pop(id(sched), None)

    def _at_limit(self, request: Request) -> bool:
        """A placeholder in flight already reaches max_tokens or the context length."""
        extra = request.num_placeholders
        return extra > 0 and (
            request.num_output_tokens + extra >= request.max_tokens
            or request.num_tokens + extra >= self.max_model_len
        )

    def _chunk(self, context: int, wanted: int, budget: int) -> int:
        """A prompt chunk within the budget; while others decode, no bigger than a chunk whose
        attention over the context costs a full chunk from scratch (step_cost.py)."""
        if self._decode_rows and wanted > 1 and self.chunked:
            wanted = min(wanted, long_context_chunk(context, self.max_num_batched_tokens))
        return min(wanted, budget)

    def _plan_budget(self, now: float) -> int:
        """The token budget of this step: planned against the latency targets, if any."""
        if self.planner is None:
            return self.max_num_batched_tokens
        self._defer_lost(now)
        return self.planner.plan_requests(self.running, self.waiting, now)

    def _defer_lost(self, now: float) -> None:
        """Triage (FCFS): prompts that will miss the TTFT target whatever happens now wait
        behind those that can still make it (goodput counts only requests meeting both)."""
        if not isinstance(self.waiting, FCFSQueue) or self.planner is None or len(self.waiting) < 2:
            return
        rows = self._decode_rows
        queue = list(self.waiting)
        lost = [
            r
            for r in queue
            if r.num_output_tokens == 0
            and self.planner.ttft_lost(now - r.arrival_time, r.num_tokens - r.num_computed_tokens, rows)
        ]
        for request in lost:
            request.slo_lost = True
        if lost and len(lost) < len(queue) and queue[-len(lost) :] != lost:
            for request in lost:
                self.waiting.remove(request)
                self.waiting.add(request)

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        """The measured wall time of a step: feeds the step-cost model."""
        rows = sum(1 for item in sched.scheduled if len(item.token_ids) == 1)
        self.computed_tokens += sched.num_batched_tokens
        if sched.scheduled:
            self.num_steps += 1
            self.scheduled_rows += len(sched.scheduled)
            pairs = sum(
                attention_pairs(len(item.token_ids), item.start_pos)
                for item in sched.scheduled
                if len(item.token_ids) > 1
            )
            self.cost.observe(sched.num_batched_tokens - rows, rows, seconds, pairs)
            if self.planner is not None:
                # what the decoding requests wait between tokens is the whole loop's turn (step,
                # output processing, streaming), not the forward alone: pace on that
                now = self.clock()
                turn = now - self._last_observed if self._last_observed is not None else seconds
                self._last_observed = now
                turn = turn if seconds <= turn <= 4 * seconds + 0.05 else seconds  # not an idle gap
                decoded = (self.requests.get(i.request_id) for i in sched.scheduled if len(i.token_ids) == 1)
                self.planner.observe_step(
                    turn, rows, sched.num_batched_tokens - rows, (r for r in decoded if r is not None)
                )

    def _preempt_for(self, request: Request, scheduled: dict[str, int], preempted: list[str]) -> bool:
        """Priority policy: make room for ``request`` by preempting a worse running one."""
        victim = self._victim() if self.policy == "priority" else None
        if victim is None or self._key(victim) <= self._key(request):
            return False
        self._preempt(victim, scheduled)
        preempted.append(victim.request_id)
        return True

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Drafts to verify with a decoding request's last token (proposed only in steps that
        speculate). Every emitted token must fit the budget, max_tokens and the context: a
        step emits the accepted drafts plus one."""
        assert self.proposer is not None
        room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens)
        return self.proposer.propose(request, min(budget, room) - 1)

    # ---- introspection -------------------------------------------------------------------
    def slo_stats(self) -> dict[str, float]:
        """Deadline counters and the budget planner's state (for /metrics)."""
        stats: dict[str, float] = {
            "step_budget": float(self._step_budget),
            "computed_tokens": float(self.computed_tokens),
            "num_steps": float(self.num_steps),
            "scheduled_rows": float(self.scheduled_rows),
            **self.deadlines.stats(),
            **self.spec.stats(),
        }
        if self.planner is not None:
            stats.update(self.planner.stats())
        return stats

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(len(self.waiting))
