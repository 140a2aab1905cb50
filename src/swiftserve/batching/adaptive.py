"""The adaptive batching window: a deadline planned from measured costs, corrected by P99.

Control law (all times in ms; ``T`` is ``target_p99_ms``):

1. Arrival rate ``lam`` (items/ms): EWMA of inter-arrival gaps, ``gap <- 0.8 gap + 0.2 new``,
   ``lam = 1 / gap``.
2. Batch cost ``c(n) = a + b n``: least squares over the last 64 measured batches
   (fixed overhead ``a``, per-item cost ``b``); until two distinct sizes are seen, the
   mean observed cost is used for every n.
3. Prediction error. Each batch records how much later its oldest item finished than the
   plan said: the timer's lateness past the window (when the batch fired because its window
   closed; 0 when it fired full or on a freed slot) plus ``cost - c(n)``. The margin ``m``
   is the 95th percentile of these errors over the batches of the last 3 s (at least the
   last 8); ``0.2 T`` until 8 batches have run. The oldest item of a batch is its slowest,
   and with a few items per batch the items' P99 is about the batches' P95.
4. Deadline. The batch now forming holds ``q`` items and its oldest has waited ``age``.
   Letting the oldest wait until ``w`` adds ``lam (w - age)`` items, so it finishes at
   about ``w + c(q + lam (w - age)) + m``. The window is the largest ``w`` that keeps this
   within the budget ``B = 0.9 T - d``:

       w = (B - m - a - b q + b lam age) / (1 + b lam)

   (or ``B - m - c(max_batch)`` when the batch would fill before that). The batch must
   also leave the next one room: an item that arrives just after it fires waits ``c(n)``
   for the function, then runs in a batch of about ``lam c(n)`` items, so the batch stops
   growing at the ``n_max`` where ``c(n) + c(lam c(n)) + m = B`` (the window is cut to the
   time it reaches ``n_max``, or to now when it already has). This binds near saturation,
   where waiting for one more item would make everyone behind it late. Every batch is
   planned to finish at the same deadline, so small batches (quiet phases) wait longer
   than big ones, where a fixed window must be sized for the biggest; and since ``q`` and
   ``age`` are the live queue's, a burst shortens the window as soon as items pile up,
   before the rate estimate has caught up. It is re-planned at every arrival and wake-up
   (with no new arrival the plan converges to firing when ``age + c(q) + m`` reaches
   ``B``). The window is 0 until a batch cost is known.
5. Feedback. Every 16 completed items, P99 over the latencies of the last 2 s (at most 256)
   is compared with ``T``. Above ``T``, the budget shrinks, ``d += 0.05 T`` (at most
   ``0.5 T``), and the latency sample is cleared, so that the next step judges only items
   served under the new budget. Below ``0.9 T`` the headroom is given back, ``d -= 0.01 T``
   (down to 0). A breach only counts when at least half of the last 32 batches fired
   because their window closed: when batches fire full or on a freed slot, the latency is
   queueing, and a smaller window would only make batches smaller and the queue longer.
6. Output ``window = clamp(w, 0, max_wait_ms)``: ``max_wait_ms`` is a hard cap. Without a
   target the window is the time to fill a full batch, ``(max_batch - 1) / lam``.
7. Optional, for latency-first users (``min_expected_arrivals`` > 0, the embedding server
   sets 1): a wait that is expected to bring fewer than that many items, ``lam w <
   min_expected_arrivals``, is not taken (window 0). A quiet stream then fires every item at
   once instead of spending the budget on company that will not come; under load the items
   that arrive while a batch runs still form the next one (the batcher runs one at a time).
   The default (0) keeps the plan above, which minimizes the number of batches for a
   function with a high fixed cost per call (an accelerator).
"""

from __future__ import annotations

from collections import deque

BUDGET_FRACTION = 0.9  # every batch is planned to finish by this fraction of the target
HEADROOM_FRACTION = 0.9  # P99 below this fraction of the target gives budget back
ERROR_QUANTILE = 95.0  # the margin: this percentile of the batches' prediction errors
MIN_ERRORS = 8  # errors needed before the margin is measured rather than assumed


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    return percentiles(values, (q,))[q]


def percentiles(values: list[float], qs: tuple[float, ...]) -> dict[float, float]:
    """Several nearest-rank percentiles from one sort (0.0 each for no values)."""
    if not values:
        return dict.fromkeys(qs, 0.0)
    ordered = sorted(values)
    n = len(ordered)
    return {q: ordered[max(0, min(n - 1, round(q / 100 * n + 0.5) - 1))] for q in qs}


class AdaptiveWindow:
    """Chooses how long the oldest queued item may wait before its batch fires."""

    def __init__(
        self,
        max_batch_size: int,
        max_wait_ms: float,
        target_p99_ms: float | None,
        min_expected_arrivals: float = 0.0,
    ):
        self.max_batch_size = max_batch_size
        self.min_expected_arrivals = min_expected_arrivals
        self.max_wait_ms = max_wait_ms
        self.target_p99_ms = target_p99_ms
        self.backoff_ms = 0.0  # ``d``: budget taken away by measured P99 breaches
        self._gap_ms: float | None = None
        self._last_arrival: float | None = None
        self._costs: deque[tuple[int, float]] = deque(maxlen=64)
        self._errors: deque[tuple[float, float]] = deque(maxlen=256)  # (time, error)
        self._latencies: deque[tuple[float, float]] = deque(maxlen=256)  # (time, latency)
        self.feedback_window_ms = 2000.0
        self.error_window_ms = 3000.0
        self._since_feedback = 0
        self._fired_by_window: deque[bool] = deque(maxlen=32)
        self._fit = (0.0, 0.0)  # (a, b) of c(n) = a + b n
        self._margin = 0.2 * (target_p99_ms or 0.0)  # ``m``, assumed until measured

    # ---- observations --------------------------------------------------------------------
    def observe_arrival(self, now_ms: float) -> None:
        if self._last_arrival is not None:
            gap = max(now_ms - self._last_arrival, 1e-3)
            self._gap_ms = gap if self._gap_ms is None else 0.8 * self._gap_ms + 0.2 * gap
        self._last_arrival = now_ms

    def observe_batch(
        self, size: int, cost_ms: float, late_ms: float = 0.0, now_ms: float | None = None
    ) -> None:
        """A batch of ``size`` ran in ``cost_ms``; it started ``late_ms`` after its window
        closed (0 unless it fired by the window). Records the plan's error, then refits."""
        now = now_ms if now_ms is not None else self._clock()
        if len(self._costs) >= 2:  # a fit exists to be wrong
            self._errors.append((now, late_ms + cost_ms - self.cost_ms(size)))
        self._costs.append((size, cost_ms))
        self._refit()
        self._remeasure_margin()

    def _refit(self) -> None:
        """Least-squares ``c(n) = a + b n``, once per batch (the window is asked for on
        every arrival; refitting there cost ~1 ms each)."""
        sizes = [s for s, _ in self._costs]
        costs = [c for _, c in self._costs]
        mean_s, mean_c = sum(sizes) / len(sizes), sum(costs) / len(costs)
        var = sum((s - mean_s) ** 2 for s in sizes)
        slope = 0.0 if var == 0 else max(sum((s - mean_s) * (c - mean_c) for s, c in self._costs) / var, 0.0)
        self._fit = (max(mean_c - slope * mean_s, 0.0), slope)

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
            self._feedback(percentile([lat for _, lat in self._latencies], 99))

    def _feedback(self, p99: float) -> None:
        target = self.target_p99_ms
        assert target is not None
        window_bound = sum(self._fired_by_window) >= len(self._fired_by_window) / 2
        if p99 > target and window_bound:
            self.backoff_ms = min(0.5 * target, self.backoff_ms + 0.05 * target)
            # Judge the next step only on items served under the new budget; otherwise
            # one burst's breach shrinks it again every 16 items until it leaves the 2 s.
            self._latencies.clear()
        elif p99 < HEADROOM_FRACTION * target:
            self.backoff_ms = max(0.0, self.backoff_ms - 0.01 * target)

    @staticmethod
    def _clock() -> float:
        import time

        return time.monotonic() * 1000.0

    # ---- model ---------------------------------------------------------------------------
    @property
    def arrival_rate_per_ms(self) -> float:
        return 0.0 if self._gap_ms is None else 1.0 / self._gap_ms

    def cost_ms(self, n: int | float) -> float:
        """Fitted cost of a batch of ``n`` items (0 before any batch ran)."""
        intercept, slope = self._fit
        return intercept + slope * n

    def margin_ms(self) -> float:
        """``m``: the 95th percentile of recent prediction errors (0.2 T until measured)."""
        return self._margin

    def _remeasure_margin(self) -> None:
        """Once per batch, like the fit: errors change only here, and the window is asked
        for on every arrival."""
        if len(self._errors) < MIN_ERRORS:
            return
        horizon = self._errors[-1][0] - self.error_window_ms
        recent = [e for t, e in self._errors if t >= horizon]
        if len(recent) < MIN_ERRORS:
            recent = [e for _, e in list(self._errors)[-MIN_ERRORS:]]
        self._margin = max(0.0, percentile(recent, ERROR_QUANTILE))

    def _deadline_window(self, queued: int, age_ms: float) -> float:
        """The largest wait that lets the forming batch finish within the budget."""
        assert self.target_p99_ms is not None
        if not self._costs:
            return 0.0  # no cost measured yet: waiting would be a blind bet
        lam = self.arrival_rate_per_ms
        a, b = self._fit
        slack = BUDGET_FRACTION * self.target_p99_ms - self.backoff_ms - self.margin_ms()
        w = (slack - a - b * queued + b * lam * age_ms) / (1 + b * lam)
        if queued + lam * max(w - age_ms, 0.0) > self.max_batch_size:
            w = slack - self.cost_ms(self.max_batch_size)  # it fires full before w anyway
        if b > 0 and lam > 0:  # leave the next batch room: stop growing at n_max items
            n_max = (slack - 2 * a - a * b * lam) / (b * (1 + b * lam))
            w = min(w, age_ms + (n_max - queued) / lam)
        return w

    def window_ms(self, queued: int = 1, age_ms: float = 0.0) -> float:
        """How long the oldest of ``queued`` items (waiting ``age_ms`` so far) may wait."""
        if self.target_p99_ms is not None:
            w = self._deadline_window(max(queued, 1), age_ms)
        else:
            lam = self.arrival_rate_per_ms
            w = self.max_wait_ms if lam <= 0 else (self.max_batch_size - 1) / lam
        w = max(0.0, min(w, self.max_wait_ms))
        if self.arrival_rate_per_ms * max(w - age_ms, 0.0) < self.min_expected_arrivals:
            return 0.0  # rule 7: nobody is expected to join in the time left
        return w
