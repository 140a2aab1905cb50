"""Latency targets: the per-step token budget planner and its P99 feedback.

TPOT is a mean over a request's tokens, so what a request can afford is a matter of its
whole life, not of each step. A request past its first token, ``g`` tokens and ``e``
seconds in, with ``m`` tokens still to come at ``d`` seconds a decode step (the median of
recent decode-only turns), meets a TPOT target ``T`` as long as the stalls still ahead of it
add up to at most its **life slack** ``T (g + m) - e - m d``. A prefill chunk stalls every
decoding request by what it adds to the step, and admitting a request makes each of their
remaining steps dearer by a row, so a step gets the prompt tokens (whole prompts in queue
order, then an efficient part of a long one) that the smallest *spendable* slack pays for:
the request's recent bank (what its tokens came under the target, earned step by step and
capped at ``BANK_STEPS`` targets, so a long stream's gaps hold over any window, not only over
its life) plus its future slack over ``HORIZON_STEPS`` steps.

Triage (goodput counts only requests that meet every target): a request whose life slack is
negative can no longer meet the target; it still decodes, but protects no one. A prompt that
will miss TTFT whatever happens waits behind prompts that can still make it (the scheduler
moves it back, for at most ``LOST_WAIT_TARGETS`` targets). Chunks are efficient or nothing:
where only a part below the efficient chunk would fit (a step with any prompt token pays a
fixed jump), the step decodes alone and requests with little slack finish first. A prompt
that would miss TTFT if it waited ``lead`` more steps is rescued when that saves
``RESCUE_COST`` prompts per decoding request it breaks. No prompt waits for slack longer than
``_max_wait_s``.

Feedback on what was measured, over sliding windows of finished requests: a TPOT P99 above
target (requests triage gave up excluded) raises ``margin`` (the planner works to
``T (1 - margin)``); P99 with headroom lowers it, down to a negative margin (the model is
pessimistic); a TTFT P99 above target makes rescues start ``lead`` decode steps earlier.
After a tightening move the window restarts, so the next move judges only what followed it.
The budget is always within [decode rows, max_num_batched_tokens].
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from swiftserve.core.request import Request
from swiftserve.core.step_cost import StepCostModel, attention_pairs


@dataclass(frozen=True)
class SLOTargets:
    """P99 latency targets in seconds (None: no target)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"latency target {name} must be > 0, got {value!r}")

    @property
    def any(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


class LatencyWindow:
    """The last ``size`` values of a latency, with their P99."""

    def __init__(self, size: int = 128):
        self.values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self.values.append(value)

    def p99(self) -> float | None:
        if not self.values:
            return None
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass(frozen=True)
class Pending:
    """A request still in prefill, as the planner sees it: waited so far and its tokens left."""

    waited_s: float
    prompt_tokens_left: int
    context: int = 0  # tokens already computed (the next chunk attends to them too)
    new: bool = True  # not admitted yet (admitting it adds a decode row to later steps)
    outputs: int = 16  # tokens it is expected to produce: the steps that row is there for


@dataclass(frozen=True)
class Decoding:
    """A request past its first token, as the planner sees it."""

    intervals: int  # tokens since its first one
    elapsed_s: float  # seconds since its first token
    remaining: int  # tokens it is still expected to produce
    bank_s: float = 0.0  # its recent bank (``Request.slo_bank``)


def expected_remaining(request: Request) -> int:
    """Tokens a decoding request will still produce: exact when it ignores EOS, else what
    it has produced so far (at least 16), within its ``max_tokens``."""
    left = request.max_tokens - request.num_output_tokens
    if request.sampling_params.ignore_eos:
        return max(0, left)
    return max(0, min(left, max(16, request.num_output_tokens)))


class BudgetPlanner:
    """Plans each step's token budget against the targets (see the module docstring)."""

    MARGIN_RANGE = (-0.3, 0.5)
    LEAD_RANGE = (2.0, 16.0)
    BANK_STEPS = 16  # a request's past bank counts up to this many TPOT targets
    HORIZON_STEPS = 32  # and its future slack up to this many steps
    # a rescue must save this many prompts per decoding request it breaks: a broken request has
    # had its compute, a rescued prompt is not yet safe (its own TPOT still has to hold)
    RESCUE_COST = 2
    TTFT_HEADROOM = 0.15  # rescue prompts this share of the TTFT target early
    LOST_WAIT_TARGETS = 8.0  # a prompt past TTFT is deferred until it has waited this many targets
    MAX_WAIT_S = 30.0  # without a TTFT target: the longest a prompt waits for slack

    def __init__(
        self,
        targets: SLOTargets,
        max_budget: int,
        model: StepCostModel,
        *,
        min_chunk: int = 16,
        feedback_every: int = 8,
    ):
        self.targets = targets
        self.max_budget = max_budget
        self.model = model
        self.min_chunk = min_chunk
        self.feedback_every = feedback_every
        self.margin = 0.1
        self.lead = 2.0  # rescue a prompt this many decode steps before its TTFT target
        self.ttft = LatencyWindow()
        self.tpot = LatencyWindow()
        self._finished = 0
        self.last_budget = max_budget
        self.ttft_risk = False
        self.min_slack = float("inf")  # the smallest slack among protected requests (last plan)
        self.decode_s = 0.0  # median of the recent decode-only steps' turns (0: none yet)
        self._decode_turns: deque[tuple[float, int]] = deque(maxlen=15)  # (turn, decode rows)
        self.lost: list[int] = []  # indices (into plan's ``decoding``) that cannot meet TPOT

    # ---- slack ---------------------------------------------------------------------------
    def _decode_step(self, decode_rows: int) -> float:
        return self.decode_s or max(0.0, self.model.predict(0, decode_rows))

    def _slacks(self, decoding: Sequence[Decoding], target: float, step: float) -> list[tuple[float, float]]:
        """(life, spendable) per request: the stall it can take and still meet ``target``
        over its whole life, and what the planner lets one step spend of it (with the margin,
        the past bank capped, the future counted over a horizon). Its future decode steps
        cost ``step`` less a row for each request that will have finished by then (the
        batch shrinks as requests end: counting today's rows for all of them would mark a
        request lost while a burst passes through)."""
        per_row = self.model.coef[2]
        if self._decode_turns:  # measured decode turns less their rows: what a step costs anyway
            base = sorted(t - per_row * n for t, n in self._decode_turns)[len(self._decode_turns) // 2]
        else:
            base = step - per_row * len(decoding)
        base = max(0.0, base)
        ends = sorted(r.remaining for r in decoding)
        prefix = [0, *itertools.accumulate(ends)]

        def future(steps: int) -> float:  # the next ``steps`` decode steps, rows leaving as they end
            k = bisect.bisect_left(ends, steps)
            return steps * base + per_row * (prefix[k] + steps * (len(ends) - k))

        limit = target * (1.0 - self.margin)
        out = []
        for r in decoding:
            life = target * (r.intervals + r.remaining) - r.elapsed_s - future(r.remaining)
            bank = min(limit * r.intervals - r.elapsed_s, r.bank_s)  # ahead over its life and lately
            horizon = min(r.remaining, self.HORIZON_STEPS)
            out.append((life, bank + limit * horizon - future(horizon)))
        return out

    def plan(self, decoding: Sequence[Decoding], pending: Iterable[Pending]) -> int:
        """This step's token budget (decode rows included)."""
        tpot, rows = self.targets.tpot_s, len(decoding)
        self.ttft_risk, self.min_slack, self.lost = False, float("inf"), []
        if tpot is None or rows == 0:
            self.last_budget = self.max_budget  # nothing to protect
            return self.max_budget
        step = self._decode_step(rows)
        # per protected request: (life slack, spendable slack, tokens it still has to produce)
        slacks = self._slacks(decoding, tpot, step)
        self.lost = [i for i, (life, _) in enumerate(slacks) if life < 0.0]
        protected = [  # the lost can no longer meet the target: they protect no one
            (life, spend, r.remaining)
            for r, (life, spend) in zip(decoding, slacks, strict=True)
            if life >= 0.0
        ]
        if not protected:
            self.last_budget = self.max_budget
            return self.max_budget
        self.min_slack = max(0.0, min(spend for _, spend, _ in protected))
        if not self.model.ready:  # no cost model yet: stall only where every request can take a lot
            self.last_budget = self.max_budget if self.min_slack >= self.BANK_STEPS * step else rows
            return self.last_budget
        pending = list(pending)
        room = max(0, self.max_budget - rows)
        efficient = max(self.min_chunk, min(room, self.model.efficient_chunk()))
        # every bank full: waiting buys nothing more, so whatever fits goes (progress)
        cap = self.BANK_STEPS * tpot
        if all(r.bank_s >= 0.95 * cap for r, (life, _) in zip(decoding, slacks, strict=True) if life >= 0):
            efficient = self.min_chunk
        chunk = self._fit(rows, protected, pending, efficient)
        if chunk == 0:
            chunk = self._rescue(rows, protected, pending)
        if chunk == 0 and pending and pending[0].waited_s > self._max_wait_s():
            chunk = min(pending[0].prompt_tokens_left, efficient)  # no prompt waits forever
        self.last_budget = rows + min(room, chunk) if chunk > 0 else rows
        return self.last_budget

    def _max_wait_s(self) -> float:
        """How long a prompt may wait for slack before it advances anyway (efficient chunks
        while the decoding requests cannot spare any: their steps alone near the target)."""
        ttft = self.targets.ttft_s
        return self.LOST_WAIT_TARGETS * ttft if ttft is not None else self.MAX_WAIT_S

    def _admit(
        self, protected: list[tuple[float, float, int]], charges: list[float], outputs: int
    ) -> list[float]:
        """``charges`` (per protected request: what the requests admitted so far cost it) plus
        one more request that will produce ``outputs`` tokens: a row more in each step they
        share. Kept incrementally: a step can weigh many short prompts against a big batch."""
        per_row = self.model.coef[2]
        return [c + per_row * min(rem, outputs) for c, (_, _, rem) in zip(charges, protected, strict=True)]

    def _stall(self, tokens: int, rows: int, context: int) -> float:
        """What a chunk of ``tokens`` adds to a step with ``rows`` decode rows."""
        pairs = attention_pairs(tokens, context)
        return self.model.predict(tokens, rows, pairs) - self.model.predict(0, rows)

    def _fit(
        self, rows: int, protected: list[tuple[float, float, int]], pending: list[Pending], efficient: int
    ) -> int:
        """The prompt tokens this step can take without any protected request overspending:
        a chunk stalls each by what it adds to the step, and every new request admitted makes
        each of their next decode steps dearer by a row. Whole prompts in queue order, then a
        part of the next one if that part is an efficient chunk."""
        # Only the smallest spend per distinct remaining length can bind (a request's charge
        # depends on nothing else), and lengths past the longest new request's all charge
        # alike: one representative each keeps this linear in the queue, not queue x batch.
        longest = max((p.outputs for p in pending if p.new), default=0)
        least: dict[int, float] = {}
        for _, spend, rem in protected:
            key = min(rem, longest)
            least[key] = min(spend, least.get(key, spend))
        protected = [(0.0, spend, rem) for rem, spend in least.items()]
        taken, charges = 0, [0.0] * len(protected)
        context = pending[0].context if pending else 0
        room = max(0, self.max_budget - rows)
        for p in pending:
            with_p = self._admit(protected, charges, p.outputs) if p.new else charges
            allowed = min(spend - c for (_, spend, _), c in zip(protected, with_p, strict=True))
            total = taken + p.prompt_tokens_left
            if total <= room and self._stall(total, rows, context) <= allowed:
                taken, charges = total, with_p
                continue
            if allowed > 0 and (p.prompt_tokens_left > room or not p.new):
                # a part only of a prompt that needs several steps anyway: a part of one that
                # could go whole would spend slack and still leave its first token waiting
                fit = self.model.max_prompt_tokens(self.model.predict(0, rows) + allowed, rows, context)
                part = min(room, fit) - taken
                if part >= efficient:
                    taken += part
            break
        return taken

    def _rescue(self, rows: int, protected: list[tuple[float, float, int]], pending: list[Pending]) -> int:
        """A chunk for the prompts whose TTFT would be missed if they waited one more
        step, if it breaks no more decoding requests than it saves prompts; else 0. Prompts
        whose requests would decode slower than the target once admitted are not saved."""
        target, tpot = self.targets.ttft_s, self.targets.tpot_s
        if target is None or tpot is None:
            return 0
        room = max(1, self.max_budget - rows)
        wait = self.lead * self._decode_step(rows)
        saved, need, taken, backlog = 0, 0, 0, 0
        for i, p in enumerate(pending):  # in the order they will be served
            backlog += p.prompt_tokens_left
            first_token = p.waited_s + -(-backlog // room) * self.model.predict(min(backlog, room), rows)
            # still possible, not after waiting (with headroom: the client sees more than the steps)
            if first_token <= target and first_token + wait > target * (1.0 - self.TTFT_HEADROOM):
                saved, need, taken = saved + 1, backlog, i + 1
        new = [p.outputs for p in pending[:taken] if p.new]  # the requests a rescue admits
        if saved and self.model.predict(0, rows + len(new)) > tpot:
            saved = 0  # admitted, they would decode too slowly to meet the TPOT target
        self.ttft_risk = saved > 0
        if not saved:
            return 0

        def broken(tokens: int, charges: list[float]) -> int:
            stall = self._stall(tokens, rows, pending[0].context)
            return sum(1 for (life, _, _), c in zip(protected, charges, strict=True) if life < stall + c)

        charges = [0.0] * len(protected)
        for outputs in new:
            charges = self._admit(protected, charges, outputs)
        chunk = min(room, need)  # whole prompts: a part of the next would only spend slack
        lost = broken(chunk, charges)
        if lost * self.RESCUE_COST > saved:
            return 0
        for p in pending[taken:]:  # the step pays its jump anyway: take whole prompts that cost no one
            more = chunk + p.prompt_tokens_left
            added = self._admit(protected, charges, p.outputs) if p.new else charges
            if more > room or broken(more, added) > lost:
                break
            chunk, charges = more, added
        return chunk

    def ttft_lost(self, waited_s: float, prompt_tokens_left: int, decode_rows: int) -> bool:
        """Whether a waiting prompt will miss the TTFT target even if served from now on
        (and has not yet waited ``LOST_WAIT_TARGETS`` targets: triage defers, never starves)."""
        target = self.targets.ttft_s
        if target is None or waited_s > self.LOST_WAIT_TARGETS * target:
            return False
        if not self.model.ready:
            return waited_s > target
        room = max(1, self.max_budget - decode_rows)
        steps = -(-prompt_tokens_left // room)
        return waited_s + steps * self.model.predict(min(prompt_tokens_left, room), decode_rows) > target

    def observe_step(
        self, seconds: float, decode_rows: int, prompt_tokens: int = 0, decoded: Iterable[Request] = ()
    ) -> None:
        """A step ran (``seconds``: the loop's whole turn): decode-only steps feed the
        measured decode step the slack is computed with, and each request that decoded
        banks what its token came under the target, capped at ``BANK_STEPS`` targets: the
        bank a chunk may spend is recent, so a long stream's gaps stay near the target over
        any window, not only over its life (stalls are paid back before the next)."""
        tpot = self.targets.tpot_s
        if tpot is None or decode_rows == 0:
            return
        cap, limit = self.BANK_STEPS * tpot, tpot * (1.0 - self.margin)
        for r in decoded:
            r.slo_bank = min(cap, r.slo_bank + limit - seconds)
        if not prompt_tokens:
            # a median: one slow turn (a collection, a neighbour) must not make every long
            # stream look lost (its life slack is remaining tokens x this)
            self._decode_turns.append((seconds, decode_rows))
            self.decode_s = sorted(t for t, _ in self._decode_turns)[len(self._decode_turns) // 2]

    def plan_requests(self, running: Iterable[Request], waiting: Iterable[Request], now: float) -> int:
        """``plan`` from the requests themselves: every request past its first token that
        decodes this step, and every prompt still in prefill."""
        decoding, pending, decoders = [], [], []
        for r in running:
            if r.num_tokens - r.num_computed_tokens <= 1 and r.first_token_time is not None:
                decoders.append(r)
                decoding.append(
                    Decoding(
                        r.num_output_tokens - 1, now - r.first_token_time, expected_remaining(r), r.slo_bank
                    )
                )
            else:
                left = r.num_tokens - r.num_computed_tokens
                pending.append(
                    Pending(
                        now - r.arrival_time,
                        left,
                        r.num_computed_tokens,
                        new=False,
                        outputs=expected_remaining(r),
                    )
                )
        pending += [
            Pending(
                now - r.arrival_time,
                r.num_tokens - r.num_computed_tokens,
                r.num_computed_tokens,
                outputs=expected_remaining(r),
            )
            for r in waiting
        ]
        budget = self.plan(decoding, pending)
        for i in self.lost:
            decoders[i].slo_lost = True
        return budget

    # ---- feedback ------------------------------------------------------------------------
    def observe_finished(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """A request finished: its TTFT and TPOT feed the P99 windows."""
        if ttft_s is not None:
            self.ttft.add(ttft_s)
        if tpot_s is not None:
            self.tpot.add(tpot_s)
        self._finished += 1
        if self._finished % self.feedback_every == 0:
            self.adjust()

    def adjust(self) -> None:
        """Tighten on a P99 breach, relax with headroom."""
        lo, hi = self.MARGIN_RANGE
        tpot_p99, target = self.tpot.p99(), self.targets.tpot_s
        if tpot_p99 is not None and target is not None:
            if tpot_p99 > target:
                self.margin = min(hi, self.margin + 0.05)
                self.tpot.values.clear()  # judge the next move on what follows this one
            elif tpot_p99 < 0.85 * target:
                self.margin = max(lo, self.margin - 0.02)
        ttft_p99, ttft_target = self.ttft.p99(), self.targets.ttft_s
        if ttft_p99 is not None and ttft_target is not None:
            if ttft_p99 > ttft_target:
                self.lead = min(self.LEAD_RANGE[1], self.lead + 1.0)
                self.ttft.values.clear()
            elif ttft_p99 < 0.7 * ttft_target:
                self.lead = max(self.LEAD_RANGE[0], self.lead - 0.5)

    def stats(self) -> dict[str, float]:
        return {
            "step_budget": float(self.last_budget),
            "budget_margin": self.margin,
            "budget_lead_steps": self.lead,
            "budget_min_slack_s": self.min_slack if self.min_slack != float("inf") else -1.0,
        }
