"""The adaptive batching window: a model-based choice corrected by measured P99.

Control law (all times in ms):

1. Arrival rate ``lam`` (items/ms): EWMA of inter-arrival gaps, ``gap <- 0.8 gap + 0.2 new``,
   ``lam = 1 / gap``.
2. Batch cost ``c(n) = a + b n``: least squares over the last 64 measured batches
   (fixed overhead ``a``, per-item cost ``b``); until two distinct sizes are seen, the
   mean observed cost is used for every n.
3. Model window. Waiting ``w`` fills a batch of ``n(w) = min(max_batch, 1 + lam w)``
   items; an item's latency is at most about ``w + c(n(w))``. Without a target the window
   is the time to fill a full batch, ``(max_batch - 1) / lam``. With ``target_p99_ms = T``
   the window is 0 until an arrival rate and a batch cost have been measured, then the
   largest ``w`` on a grid of 32 points in ``[0, max_wait]`` with
   ``w + c(n(w)) (1 + 2 r) <= 0.8 T``. ``r`` is the RMS *relative* residual of the cost
   fit, so a model whose batches vary in cost gets a tail margin in proportion to the
   batch it would run (a noisy 15 ms batch needs a few ms, not the spread of the 100 ms
   ones), while a steady one gets none. The last 20% of the target is left to queueing
   and to the feedback below (which acts at 0.9 T); 0 when nothing fits.
4. Feedback. Every 16 completed items, P99 over the latencies of the last 2 s (at most
   256) is compared with ``T``: above ``0.9 T`` the scale ``s`` is multiplied by 0.7 (the
   10% margin absorbs the noise of a P99 estimated from a few hundred samples) and the
   latency sample is cleared, so that the next step judges only the new window; below
   ``0.7 T`` it is multiplied by 1.15 (capped at 1.5); otherwise unchanged. ``s`` is floored
   at 0.05. The window is time-based so that a burst's breach stops weighing on the window
   once the burst is over. A breach only shrinks the window when at least half of the last
   32 batches fired because their window closed: when batches fire because they are full
   or because the function was busy, the latency is queueing, and a smaller window would
   only make batches smaller and the queue longer.
5. Output ``window = clamp(s * w_model, 0, max_wait_ms)``: ``max_wait_ms`` is a hard cap.
"""

from __future__ import annotations

from collections import deque

BREACH_FRACTION = 0.9  # P99 above this fraction of the target shrinks the window
BUDGET_FRACTION = 0.8  # the model window plans each batch to finish by this fraction


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


class AdaptiveWindow:
    """Chooses how long the oldest queued item may wait before its batch fires."""

    def __init__(self, max_batch_size: int, max_wait_ms: float, target_p99_ms: float | None):
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.target_p99_ms = target_p99_ms
        self.scale = 1.0
        self._gap_ms: float | None = None
        self._last_arrival: float | None = None
        self._costs: deque[tuple[int, float]] = deque(maxlen=64)
        self._latencies: deque[tuple[float, float]] = deque(maxlen=256)  # (time, latency)
        self.feedback_window_ms = 2000.0
        self._since_feedback = 0
        self._fired_by_window: deque[bool] = deque(maxlen=32)
        self._fit = (0.0, 0.0)  # (a, b) of c(n) = a + b n
        self._spread = 0.0

    # ---- observations --------------------------------------------------------------------
    def observe_arrival(self, now_ms: float) -> None:
        if self._last_arrival is not None:
            gap = max(now_ms - self._last_arrival, 1e-3)
            self._gap_ms = gap if self._gap_ms is None else 0.8 * self._gap_ms + 0.2 * gap
        self._last_arrival = now_ms

    def observe_batch(self, size: int, cost_ms: float) -> None:
        self._costs.append((size, cost_ms))
        self._refit()

    def _refit(self) -> None:
        """Least-squares ``c(n) = a + b n`` and its relative spread, once per batch (the
        window is asked for on every arrival; refitting there cost ~1 ms each)."""
        sizes = [s for s, _ in self._costs]
        costs = [c for _, c in self._costs]
        mean_s, mean_c = sum(sizes) / len(sizes), sum(costs) / len(costs)
        var = sum((s - mean_s) ** 2 for s in sizes)
        slope = 0.0 if var == 0 else max(sum((s - mean_s) * (c - mean_c) for s, c in self._costs) / var, 0.0)
        self._fit = (max(mean_c - slope * mean_s, 0.0), slope)
        total = 0.0
        for n, c in self._costs:
            fit = self.cost_ms(n)
            total += ((c - fit) / fit) ** 2 if fit > 0 else 0.0
        self._spread = (total / len(self._costs)) ** 0.5 if len(self._costs) >= 2 else 0.0

    def observe_fire(self, by_window: bool) -> None:
        """Whether the batch just fired because its window closed (not full, not backlog)."""
        self._fired_by_window.append(by_window)

    def observe_latency(self, latency_ms: float, now_ms: float | None = None) -> None:
        now = now_ms if now_ms is not None else self._clock()
        self._latencies.append((now, latency_ms))
        while self._latencies and self._latencies[0][0] < now - self.feedback_window_ms:
            self._latencies.popleft()
        self._since_feedback += 1
        if self.target_p99_ms is not None and self._since_feedback >= 16:
            self._since_feedback = 0
            p99 = percentile([lat for _, lat in self._latencies], 99)
            window_bound = sum(self._fired_by_window) >= len(self._fired_by_window) / 2
            if p99 > BREACH_FRACTION * self.target_p99_ms and window_bound:
                self.scale = max(0.05, self.scale * 0.7)
                # Judge the next step only on items served under the new window; otherwise
                # one burst's breach shrinks it again every 16 items until it leaves the 2 s.
                self._latencies.clear()
            elif p99 < 0.7 * self.target_p99_ms:
                self.scale = min(1.5, self.scale * 1.15)

    @staticmethod
    def _clock() -> float:
        import time

        return time.monotonic() * 1000.0

    # ---- model ---------------------------------------------------------------------------
    @property
    def arrival_rate_per_ms(self) -> float:
        return 0.0 if self._gap_ms is None else 1.0 / self._gap_ms

    def cost_ms(self, n: int) -> float:
        """Fitted cost of a batch of ``n`` items (0 before any batch ran)."""
        intercept, slope = self._fit
        return intercept + slope * n

    def cost_spread(self) -> float:
        """RMS relative residual of the measured costs around the fitted ``c(n)``."""
        return self._spread

    def _model_window(self) -> float:
        lam = self.arrival_rate_per_ms
        if self.target_p99_ms is not None and (lam <= 0 or not self._costs):
            return 0.0  # no rate or no cost measured yet: waiting would be a blind bet
        if lam <= 0:
            return self.max_wait_ms
        fill_ms = (self.max_batch_size - 1) / lam
        if self.target_p99_ms is None:
            return fill_ms
        budget = BUDGET_FRACTION * self.target_p99_ms
        tail = 1 + 2 * self.cost_spread()
        best = 0.0
        for i in range(33):
            w = min(fill_ms, self.max_wait_ms) * i / 32
            n = min(self.max_batch_size, 1 + int(lam * w))
            if w + self.cost_ms(n) * tail <= budget:
                best = w
        return best

    def window_ms(self) -> float:
        return max(0.0, min(self.scale * self._model_window(), self.max_wait_ms))
