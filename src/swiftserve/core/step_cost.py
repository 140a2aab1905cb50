"""Online model of what one engine step costs, fitted to the steps just measured.

    seconds = fixed + per_prompt_token * prompt_tokens + per_decode_row * decode_rows

Least squares over a sliding window of recent steps (pure Python: a 3x3 system, updated
incrementally, refitted every ``refit_every`` observations). The planner (core/slo.py) and
the deadline checks ask it what a step would cost; until it has seen enough varied steps
(``ready``), they fall back to today's fixed budget and check only deadlines already past.
"""

from __future__ import annotations

import math
from collections import deque

Features = tuple[float, float, float]


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][3] / m[i][i] for i in range(3)]


class StepCostModel:
    """Fitted step time from (prompt tokens, decode rows); see the module docstring."""

    def __init__(self, window: int = 256, refit_every: int = 8, min_samples: int = 16):
        self.window = window
        self.refit_every = refit_every
        self.min_samples = min_samples
        self._samples: deque[tuple[Features, float]] = deque()
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._since_fit = 0
        # (fixed s, per prompt token s, per decode row s); a prior until fitted
        self.coef: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self.ready = False

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """Record one step's measured wall time."""
        x: Features = (1.0, float(prompt_tokens), float(decode_rows))
        self._add(x, seconds, 1.0)
        self._samples.append((x, seconds))
        if len(self._samples) > self.window:
            old_x, old_y = self._samples.popleft()
            self._add(old_x, old_y, -1.0)
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self._samples) >= self.min_samples:
            self._refit()

    def _add(self, x: Features, y: float, sign: float) -> None:
        for i in range(3):
            self._xty[i] += sign * x[i] * y
            for j in range(3):
                self._xtx[i][j] += sign * x[i] * x[j]

    def _refit(self) -> None:
        self._since_fit = 0
        # A little ridge keeps the fit defined when every step so far looked alike.
        ridge = [[self._xtx[i][j] + (1e-9 if i == j else 0.0) for j in range(3)] for i in range(3)]
        solution = _solve3(ridge, self._xty)
        if solution is None:
            return
        fixed, per_token, per_row = solution
        # Costs are never negative; a negative slope means the window cannot tell them apart.
        self.coef = (max(fixed, 0.0), max(per_token, 0.0), max(per_row, 0.0))
        self.ready = per_token > 0.0

    def predict(self, prompt_tokens: int, decode_rows: int) -> float:
        fixed, per_token, per_row = self.coef
        return fixed + per_token * prompt_tokens + per_row * decode_rows

    def max_prompt_tokens(self, seconds: float, decode_rows: int) -> int:
        """The most prompt tokens a step with ``decode_rows`` can take within ``seconds``."""
        fixed, per_token, per_row = self.coef
        if per_token <= 0.0:
            return 0
        return max(0, int((seconds - fixed - per_row * decode_rows) / per_token))


MIN_LONG_CHUNK = 64  # the smallest chunk the cap below asks for (steps have a fixed cost too)


def long_context_chunk(context: int, full_chunk: int) -> int:
    """The largest prompt chunk after ``context`` computed tokens whose attention costs no
    more than a full chunk from scratch: c (context + c / 2) <= full_chunk^2 / 2, so
    c = sqrt(context^2 + full_chunk^2) - context. Without it a 2,048-token chunk at 10k
    tokens of context made every running request wait 1.5-2.6 s per token (issue 24)."""
    c = math.isqrt(context * context + full_chunk * full_chunk) - context
    return max(MIN_LONG_CHUNK, min(full_chunk, c))
