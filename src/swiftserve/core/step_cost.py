"""Online model of what one engine step costs, fitted to the steps just measured.

    seconds = fixed + per_prompt_token * prompt_tokens + per_decode_row * decode_rows
              + jump * (prompt_tokens > 0) + per_pair * attention_pairs

``attention_pairs``: the (query, key) pairs of a step's prompt chunks, sum of c (x + (c + 1) / 2)
for a chunk of c tokens after x computed ones: what makes a chunk deep in a long prompt cost
many times one at its start (issue 24). It is fitted like ``jump``: only once the window holds
steps whose pairs vary independently of their tokens (otherwise it stays 0).

``jump``: what a step costs more as soon as it carries any prompt token (on AMX CPUs such a
step leaves the one-call C++ stack and the attention takes another path: 17 -> 56 ms measured
for a handful of prompt tokens). It is fitted only when the window holds enough steps of both
kinds; otherwise it stays 0 and the model is the three-term one.

Least squares over sliding windows of recent steps (pure Python: up to 5x5, updated
incrementally, refitted every ``refit_every`` observations): one window of steps with prompt
tokens and one without, so a long run of decode-only steps (a stream decoding while a long
prompt waits for slack) does not flush what the chunks cost. The planner (core/slo.py) and
the deadline checks ask it what a step would cost; until it has seen enough varied steps
(``ready``), they fall back to today's fixed budget and check only deadlines already past.
"""

from __future__ import annotations

import math
from collections import deque

Features = tuple[float, float, float, float, float]  # 1, prompt tokens, decode rows, any prompt?, kpairs
MIN_KIND = 8  # steps of each kind (with and without prompt tokens) before ``jump`` is fitted
PAIR_UNIT = 1024.0  # pairs are fitted per 1,024 (keeps the normal equations well scaled)
MIN_DEEP = 8  # steps with prompt work after long context before ``per_pair`` is fitted


def attention_pairs(chunk: int, context: int) -> float:
    """(query, key) pairs of a causal prompt chunk of ``chunk`` tokens after ``context``."""
    return chunk * (context + (chunk + 1) / 2)


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
        # (steps without prompt tokens, steps with): each its own window
        self._samples: tuple[deque[tuple[Features, float]], ...] = (deque(), deque())
        self._xtx = [[0.0] * 5 for _ in range(5)]
        self._xty = [0.0] * 5
        self._with_prompt = 0  # steps in the window that carried prompt tokens
        self._deep = 0  # steps whose chunks had more attention pairs than a fresh chunk
        self._since_fit = 0
        # (fixed s, per prompt token s, per decode row s); a prior until fitted
        self.coef: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self.jump = 0.0  # s more for a step that carries any prompt token
        self.per_pair = 0.0  # s per attention pair of prompt chunks (see the module docstring)
        self.ready = False

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float, pairs: float = 0.0) -> None:
        """Record one step's measured wall time (``pairs``: its chunks' attention pairs)."""
        x: Features = (
            1.0,
            float(prompt_tokens),
            float(decode_rows),
            1.0 if prompt_tokens else 0.0,
            pairs / PAIR_UNIT,
        )
        self._add(x, seconds, 1.0)
        window = self._samples[1 if prompt_tokens else 0]
        window.append((x, seconds))
        if len(window) > self.window:
            old_x, old_y = window.popleft()
            self._add(old_x, old_y, -1.0)
        self._since_fit += 1
        if self._since_fit >= self.refit_every and self.num_samples >= self.min_samples:
            self._refit()

    @property
    def num_samples(self) -> int:
        return len(self._samples[0]) + len(self._samples[1])

    def _add(self, x: Features, y: float, sign: float) -> None:
        self._with_prompt += int(sign) * int(x[3])
        # deep: more pairs than the same tokens as one fresh chunk would have
        self._deep += int(sign) * int(x[4] * PAIR_UNIT > x[1] * (x[1] + 1) / 2 + 256 * x[1])
        for i in range(5):
            self._xty[i] += sign * x[i] * y
            for j in range(5):
                self._xtx[i][j] += sign * x[i] * x[j]

    def _refit(self) -> None:
        self._since_fit = 0
        # ``jump`` only when both kinds of step are there to tell it from ``fixed``
        cols = [0, 1, 2]
        if min(self._with_prompt, self.num_samples - self._with_prompt) >= MIN_KIND:
            cols.append(3)
        if self._deep >= MIN_DEEP:
            cols.append(4)
        # A little ridge keeps the fit defined when every step so far looked alike.
        ridge = [[self._xtx[i][j] + (1e-9 if i == j else 0.0) for j in cols] for i in cols]
        solution = _solve(ridge, [self._xty[i] for i in cols])
        if solution is None:
            return
        fitted = dict(zip(cols, solution, strict=True))
        fixed, per_token, per_row = solution[:3]
        self.jump = max(fitted.get(3, 0.0), 0.0)
        self.per_pair = max(fitted.get(4, 0.0), 0.0) / PAIR_UNIT
        # Costs are never negative; a negative slope means the window cannot tell them apart.
        self.coef = (max(fixed, 0.0), max(per_token, 0.0), max(per_row, 0.0))
        self.ready = per_token > 0.0

    def predict(self, prompt_tokens: int, decode_rows: int, pairs: float = 0.0) -> float:
        """Predicted seconds of a step (``pairs``: its chunks' attention pairs)."""
        fixed, per_token, per_row = self.coef
        jump = self.jump if prompt_tokens > 0 else 0.0
        return fixed + jump + per_token * prompt_tokens + per_row * decode_rows + self.per_pair * pairs

    def fastest_decode(self, decode_rows: int) -> float:
        """A lower bound on a decode-only step of ``decode_rows`` rows: the fastest such step
        in the window with no more rows (``predict`` when there is none). ``predict`` is an
        average, and a deadline check that treats it as a bound failed requests that then
        would have made it (issue 18: 3 of 9 at a 2 s timeout)."""
        seen = [y for x, y in self._samples[0] if x[2] <= decode_rows]
        return min(seen) if seen else self.predict(0, decode_rows)

    def max_prompt_tokens(self, seconds: float, decode_rows: int, context: int = 0) -> int:
        """The most prompt tokens a step with ``decode_rows`` can take within ``seconds``, as
        one chunk after ``context`` computed tokens: the root of
        per_token c + per_pair c (context + c / 2) = seconds left."""
        fixed, per_token, per_row = self.coef
        if per_token <= 0.0:
            return 0
        left = seconds - fixed - self.jump - per_row * decode_rows
        if left <= 0.0:
            return 0
        b = self.per_pair
        linear = per_token + b * (context + 0.5)
        if b <= 0.0:
            return int(left / linear)
        return int((math.sqrt(linear * linear + 2.0 * b * left) - linear) / b)

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
