"""Deadlines in the core: end a request as soon as it cannot finish in time.

A request with a deadline (the API's ``timeout``, ``LLM.generate(timeout=)``) ends with
``deadline_exceeded`` when the deadline has passed, or, once the step-cost model is fitted,
when even a lower-bound estimate of its finish misses it: its prompt tokens still to
compute plus those of everything queued ahead of it, at the fitted cost per prompt token,
then the output tokens it must produce whatever it samples (``min_remaining_outputs``) at
the cost of the fastest recent decode step with no more rows (the fitted cost is an average:
used as a bound it failed requests that would have made it). Failing it at once answers the
client early and spends no compute on a result that would be thrown away; ``wasted_tokens``
counts the tokens computed for requests that still ended this way.
"""

from __future__ import annotations

from collections.abc import Iterable

from swiftserve.core.request import Request
from swiftserve.core.step_cost import StepCostModel


class DeadlineKeeper:
    """Finds the requests to end for their deadline (the scheduler ends them)."""

    def __init__(self, cost: StepCostModel, enabled: bool = True):
        self.cost = cost
        self.enabled = enabled  # False: deadlines are only accounted (the A/B baseline)
        self._failed: list[Request] = []
        self.num_expired = 0  # deadline already passed
        self.num_infeasible = 0  # failed early: could not make it
        self.wasted_tokens = 0  # tokens computed for requests that ended this way
        self.live = 0  # live requests with a deadline: with none, a step pays nothing here

    def track(self, request: Request, delta: int) -> None:
        """The scheduler reports each request with a deadline as it enters (+1) and ends (-1)."""
        if request.deadline is not None:
            self.live += delta

    def due(self, now: float, running: list[Request], waiting: Iterable[Request]) -> list[Request]:
        """Requests to end now, in the order found (running first, then waiting)."""
        if not self.enabled or self.live == 0:
            return []
        ready = self.cost.ready
        per_token = self.cost.coef[1]
        rows = sum(1 for r in running if r.num_tokens - r.num_computed_tokens <= 1)
        # once per step, not per request: each scans the cost model's window
        step_now, step_later = self.cost.fastest_decode(rows), self.cost.fastest_decode(rows + 1)
        out: list[Request] = []
        backlog = 0
        for r in running:
            left = max(0, r.num_prompt_tokens - r.num_computed_tokens)
            backlog += left
            if r.deadline is not None:
                finish = now + left * per_token + r.min_remaining_outputs() * step_now
                self._check(r, now, finish if ready else now, out)
        for r in waiting:  # in the order they will be admitted
            backlog += r.num_tokens - r.num_computed_tokens
            if r.deadline is not None:
                decode = r.min_remaining_outputs() * step_later
                self._check(r, now, now + backlog * per_token + decode if ready else now, out)
        self._failed.extend(out)
        return out

    def _check(self, request: Request, now: float, finish: float, out: list[Request]) -> None:
        assert request.deadline is not None
        if now >= request.deadline:
            self.num_expired += 1
            request.stop_reason = "the request's deadline passed before it finished"
        elif finish > request.deadline:
            self.num_infeasible += 1
            late_ms = (finish - request.deadline) * 1000
            request.stop_reason = f"cannot finish before its deadline (estimated {late_ms:.0f} ms late)"
        else:
            return
        self.wasted_tokens += request.num_computed_tokens
        out.append(request)

    def note_aborted(self, request: Request, now: float) -> None:
        """An abort from outside (the frontend's own timer): past the deadline, its compute
        was wasted too. Counted in both modes, so A/B runs compare like with like."""
        if request.deadline is not None and now >= request.deadline:
            self.wasted_tokens += request.num_computed_tokens

    def take_failed(self) -> list[Request]:
        """The requests ended since the last call (their outputs go to the frontend)."""
        failed, self._failed = self._failed, []
        return failed

    def stats(self) -> dict[str, int]:
        return {
            "deadline_expired": self.num_expired,
            "deadline_infeasible": self.num_infeasible,
            "deadline_wasted_tokens": self.wasted_tokens,
        }
