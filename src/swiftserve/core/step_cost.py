"""Online model of what one engine step costs, fitted to the steps just measured.

    seconds = fixed + per_prompt_token * prompt_tokens + per_decode_row * decode_rows
              + jump * (prompt_tokens > 0)

``jump``: what a step costs more as soon as it carries any prompt token (on AMX CPUs such a
step leaves the one-call C++ stack and the attention takes another path: 17 -> 56 ms measured
for a handful of prompt tokens). It is fitted only when the window holds enough steps of both
kinds; otherwise it stays 0 and the model is the three-term one.

Least squares over a sliding window of recent steps (pure Python: a 3x3 system, updated
incrementally, refitted every ``refit_every`` observations). The planner (core/slo.py) and
the deadline checks ask it what a step would cost; until it has seen enough varied steps
(``ready``), they fall back to today's fixed budget and check only deadlines already past.
"""

from __future__ import annotations

import math
from collections import deque

Features = tuple[float, float, float, float]  # 1, prompt tokens, decode rows, any prompt?
MIN_KIND = 8  # steps of each kind (with and without prompt tokens) before ``jump`` is fitted


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


class StepCostModel:
    """Fitted step time from (prompt tokens, decode rows); see the module docstring."""

    def __init__(self, window: int = 256, refit_every: int = 8, min_samples: int = 16):
        self.window = window
        self.refit_every = refit_every
        self.min_samples = min_samples
        self._samples: deque[tuple[Features, float]] = deque()
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4
        self._with_prompt = 0  # steps in the window that carried prompt tokens
        self._since_fit = 0
        # (fixed s, per prompt token s, per decode row s); a prior until fitted
        self.coef: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self.jump = 0.0  # s more for a step that carries any prompt token
        self.ready = False

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """Record one step's measured wall time."""
        x: Features = (1.0, float(prompt_tokens), float(decode_rows), 1.0 if prompt_tokens else 0.0)
        self._add(x, seconds, 1.0)
        self._samples.append((x, seconds))
        if len(self._samples) > self.window:
            old_x, old_y = self._samples.popleft()
            self._add(old_x, old_y, -1.0)
        self._since_fit += 1
        if self._since_fit >= self.refit_every and len(self._samples) >= self.min_samples:
            self._refit()

    def _add(self, x: Features, y: float, sign: float) -> None:
        self._with_prompt += int(sign) * int(x[3])
        for i in range(4):
            self._xty[i] += sign * x[i] * y
            for j in range(4):
                self._xtx[i][j] += sign * x[i] * x[j]

    def _refit(self) -> None:
        self._since_fit = 0
        # ``jump`` only when both kinds of step are there to tell it from ``fixed``
        n = 4 if min(self._with_prompt, len(self._samples) - self._with_prompt) >= MIN_KIND else 3
        # A little ridge keeps the fit defined when every step so far looked alike.
        ridge = [[self._xtx[i][j] + (1e-9 if i == j else 0.0) for j in range(n)] for i in range(n)]
        solution = _solve(ridge, self._xty[:n])
        if solution is None:
            return
        fixed, per_token, per_row = solution[:3]
        self.jump = max(solution[3], 0.0) if n == 4 else 0.0
        # Costs are never negative; a negative slope means the window cannot tell them apart.
        self.coef = (max(fixed, 0.0), max(per_token, 0.0), max(per_row, 0.0))
        self.ready = per_token > 0.0

    def predict(self, prompt_tokens: int, decode_rows: int) -> float:
        fixed, per_token, per_row = self.coef
        jump = self.jump if prompt_tokens > 0 else 0.0
        return fixed + jump + per_token * prompt_tokens + per_row * decode_rows

    def max_prompt_tokens(self, seconds: float, decode_rows: int) -> int:
        """The most prompt tokens a step with ``decode_rows`` can take within ``seconds``."""
        fixed, per_token, per_row = self.coef
        if per_token <= 0.0:
            return 0
        return max(0, int((seconds - fixed - self.jump - per_row * decode_rows) / per_token))

    def efficient_chunk(self, share: float = 0.25) -> int:
        """The smallest chunk whose prompt work is at least 1/share times the jump it pays
        (0 when there is no jump): below it, many small chunks cost far more than few big ones."""
        per_token = self.coef[1]
        if self.jump <= 0.0 or per_token <= 0.0:
            return 0
        return int(self.jump / share / per_token)


MIN_LONG_CHUNK = 64  # the smallest chunk the cap below asks for (steps have a fixed cost too)


def long_context_chunk(context: int, full_chunk: int) -> int:
    """The largest prompt chunk after ``context`` computed tokens whose attention costs no
    more than a full chunk from scratch: c (context + c / 2) <= full_chunk^2 / 2, so
    c = sqrt(context^2 + full_chunk^2) - context. Without it a 2,048-token chunk at 10k
    tokens of context made every running request wait 1.5-2.6 s per token (issue 24)."""
    c = math.isqrt(context * context + full_chunk * full_chunk) - context
    return max(MIN_LONG_CHUNK, min(full_chunk, c))
