"""Latency targets: the per-step token budget planner and its P99 feedback.

With a TPOT target T, a step that carries D decode rows should take at most about T: every
decode row gets one token per step. The step-cost model (core/step_cost.py) turns that into
the largest prefill chunk k with ``fixed + per_token*k + per_row*D <= T*(1 - margin)``.

TPOT is an average over a request's tokens, so a request that has run faster than T has
banked time: ``bank = T*(tokens so far - 1) - (time since its first token)``. When TTFT is
the one at risk (a burst waiting whose predicted first tokens would miss the TTFT target),
the step may also spend ``spend`` of the smallest bank among the decode rows: bigger prefill
chunks exactly when they help, paid for with time the running requests do not need.

Where the chunk that fits under the target is too small to pay its way (a step with any
prompt token pays a fixed jump; a chunk deep in a long prompt re-reads the whole context),
the planner paces instead: steps with decode rows earn credit, the time they ran under the
target (measured, capped at ``CREDIT_STEPS`` targets); decode-only steps build it up, and a
chunk runs when the credit pays for an efficient one. TPOT is a mean: it holds over a window
of steps, not in every gap, and the prompt advances in efficient chunks.

Feedback on what was measured, over sliding windows of finished requests: a TPOT P99 above
target raises ``margin`` (smaller chunks); P99 with headroom lowers it, down to a negative
margin (the model is pessimistic); a TTFT P99 above target raises ``spend``. After a
tightening move the window restarts, so the next move judges only what followed it. The budget is
always within [decode rows + min_chunk, max_num_batched_tokens].
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from swiftserve.core.request import Request
from swiftserve.core.step_cost import StepCostModel


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


class BudgetPlanner:
    """Plans each step's token budget against the targets (see the module docstring)."""

    MARGIN_RANGE = (-0.3, 0.5)
    SPEND_RANGE = (0.25, 1.0)
    CREDIT_STEPS = 16  # credit is capped at this many TPOT targets: the longest stall a chunk adds

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
        self.spend = 0.5
        self.ttft = LatencyWindow()
        self.tpot = LatencyWindow()
        self._finished = 0
        self.last_budget = max_budget
        self.ttft_risk = False
        self.credit = 0.0  # seconds the recent decode steps ran under the limit (_paced_chunk)
        self.credit_cap = self.CREDIT_STEPS * (targets.tpot_s or 0.0)
        self.decode_s = 0.0  # moving average of measured decode-only steps (0: none yet)

    def plan(self, decode_rows: int, min_bank_s: float, pending: Iterable[Pending]) -> int:
        """This step's token budget (decode rows included)."""
        tpot = self.targets.tpot_s
        if tpot is None or decode_rows == 0:
            self.last_budget = self.max_budget  # nothing to protect
            return self.max_budget
        limit = tpot * (1.0 - self.margin)
        if not self.model.ready:  # nothing fitted (yet, or after a refit failed): measured debt only
            owing = self.credit < 0 and self.decode_s < limit
            self.last_budget = decode_rows if owing else self.max_budget
            return self.last_budget
        pending = list(pending)
        self.ttft_risk = self._ttft_at_risk(decode_rows, limit, pending)
        if self.ttft_risk:
            limit += self.spend * max(0.0, min_bank_s)
        # the next chunk is the first pending prompt's: deep in a long prompt it costs more
        context = pending[0].context if pending else 0
        chunk = self.model.max_prompt_tokens(limit, decode_rows, context)
        # below the floor a chunk would overrun the target as surely as a small one pays the jump
        efficient = max(self.min_chunk, min(self.max_budget, self.model.efficient_chunk()))
        if self.ttft_risk:  # a prompt is late: where steps with prompt tokens pay a jump, few big chunks
            chunk = max(chunk, efficient)
        elif chunk < efficient or self.credit < 0:
            # Every chunk that fits would mostly pay the jump or re-read a long context (and
            # stretch the decode steps it was meant to protect), or steps ran longer than
            # predicted: pace instead, decode alone while credit builds up (debts first),
            # then one chunk the credit pays for.
            chunk = self._paced_chunk(decode_rows, limit, min_bank_s, context, efficient)
            if chunk == 0:
                self.last_budget = decode_rows
                return self.last_budget
        room = max(0, self.max_budget - decode_rows)
        self.last_budget = decode_rows + min(room, max(self.min_chunk, chunk))
        return self.last_budget

    def _paced_chunk(
        self, decode_rows: int, limit: float, min_bank_s: float, context: int, efficient: int
    ) -> int:
        """The chunk this step's credit pays for, or 0 (decode alone and build credit).

        Credit is what the steps with decode rows have run under ``limit`` lately (measured,
        capped, see ``observe_step``), and no more than any running request has banked, so
        each request's TPOT holds over a window of ``CREDIT_STEPS`` target times while the
        prompt advances in chunks big enough to be efficient. Progress is guaranteed: with
        full credit, or where decode steps alone miss the target, whatever fits is taken.
        """
        allowance = max(0.0, min(self.credit, min_bank_s))
        chunk = self.model.max_prompt_tokens(limit + allowance, decode_rows, context)
        if self.credit >= self.credit_cap or self.decode_s >= limit:
            return chunk  # full credit, or decode alone misses the target: no waiting helps
        return chunk if chunk >= efficient and self.credit >= 0 else 0

    def observe_step(self, seconds: float, decode_rows: int, prompt_tokens: int = 0) -> None:
        """A step ran: steps with decode rows earn (or spend) ``limit - seconds`` of credit.
        Debt is kept (down to a few caps): a chunk that ran longer than predicted is paid
        back by decode-only steps, so the mean holds even where the cost model is wrong."""
        tpot = self.targets.tpot_s
        if tpot is None or decode_rows == 0:
            return
        if prompt_tokens == 0:  # measured, not fitted: the fit bends to the big steps
            self.decode_s += 0.2 * (seconds - self.decode_s) if self.decode_s else seconds
        earned = self.credit + tpot * (1.0 - self.margin) - seconds
        self.credit = max(-4 * self.credit_cap, min(self.credit_cap, earned))

    def plan_requests(self, running: Iterable[Request], waiting: Iterable[Request], now: float) -> int:
        """``plan`` from the requests themselves: the decode rows and the smallest TPOT time
        any of them has banked (ahead of target), and every prompt still in prefill."""
        tpot = self.targets.tpot_s or 0.0
        decode_rows, min_bank, pending = 0, float("inf"), []
        for r in running:
            if r.num_tokens - r.num_computed_tokens <= 1 and r.first_token_time is not None:
                decode_rows += 1
                min_bank = min(min_bank, tpot * (r.num_output_tokens - 1) - (now - r.first_token_time))
            else:
                left = r.num_tokens - r.num_computed_tokens
                pending.append(Pending(now - r.arrival_time, left, r.num_computed_tokens))
        pending += [
            Pending(now - r.arrival_time, r.num_tokens - r.num_computed_tokens, r.num_computed_tokens)
            for r in waiting
        ]
        return self.plan(decode_rows, 0.0 if min_bank == float("inf") else min_bank, pending)

    def _ttft_at_risk(self, decode_rows: int, limit: float, pending: Iterable[Pending]) -> bool:
        """Would some waiting prompt get its first token after the TTFT target at this pace?"""
        target = self.targets.ttft_s
        if target is None:
            return False
        chunk = max(self.min_chunk, self.model.max_prompt_tokens(limit, decode_rows))
        step = self.model.predict(chunk, decode_rows)
        backlog = 0
        for p in pending:  # in the order they will be served
            backlog += p.prompt_tokens_left
            if p.waited_s + -(-backlog // chunk) * step > target:
                return True
        return False

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
                self.spend = max(self.SPEND_RANGE[0], self.spend - 0.1)
                self.tpot.values.clear()  # judge the next move on what follows this one
            elif tpot_p99 < 0.85 * target:
                self.margin = max(lo, self.margin - 0.02)
        ttft_p99, ttft_target = self.ttft.p99(), self.targets.ttft_s
        if ttft_p99 is not None and ttft_target is not None:
            if ttft_p99 > ttft_target and (tpot_p99 is None or target is None or tpot_p99 <= target):
                self.spend = min(self.SPEND_RANGE[1], self.spend + 0.1)
                self.ttft.values.clear()
            elif ttft_p99 < 0.7 * ttft_target:
                self.spend = max(self.SPEND_RANGE[0], self.spend - 0.05)

    def stats(self) -> dict[str, float]:
        return {
            "step_budget": float(self.last_budget),
            "budget_margin": self.margin,
            "budget_spend": self.spend,
            "budget_credit_s": self.credit,
        }
