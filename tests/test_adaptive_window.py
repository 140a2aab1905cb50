"""The adaptive window's control law (batching/adaptive.py), driven with explicit times."""

from __future__ import annotations

import pytest

from swiftserve.batching.adaptive import BUDGET_FRACTION, AdaptiveWindow


def fed(target: float | None = 60.0, gap_ms: float = 4.0, noise_ms: float = 0.0) -> AdaptiveWindow:
    """A controller that saw one arrival every ``gap_ms`` and 32 batches costing
    ``2 + 0.5 n`` ms, each ``noise_ms`` above or below that, alternately in fours."""
    w = AdaptiveWindow(max_batch_size=32, max_wait_ms=100, target_p99_ms=target)
    for i in range(200):
        w.observe_arrival(gap_ms * i)
    for i, n in enumerate((1, 4, 8, 16) * 8):
        w.observe_batch(n, 2 + 0.5 * n + (noise_ms if (i // 4) % 2 else -noise_ms), now_ms=float(i))
    return w


def test_cost_fit_and_rate() -> None:
    w = fed()
    assert w.cost_ms(10) == pytest.approx(7.0)
    assert w.arrival_rate_per_ms == pytest.approx(0.25)
    assert w.margin_ms() == pytest.approx(0.0, abs=1e-9)  # an exact fit makes no errors


def test_window_is_zero_until_a_cost_is_measured() -> None:
    w = AdaptiveWindow(max_batch_size=32, max_wait_ms=100, target_p99_ms=60)
    w.observe_arrival(0.0)
    w.observe_arrival(5.0)
    assert w.window_ms() == 0.0


def test_deadline_plan_meets_the_budget_exactly() -> None:
    """The oldest item of the planned batch finishes at ``BUDGET_FRACTION * T``."""
    w = fed(target=60.0)
    lam = w.arrival_rate_per_ms
    for queued, age in ((1, 0.0), (3, 5.0), (6, 2.0)):
        window = w.window_ms(queued, age)
        n = queued + lam * (window - age)
        assert 0 < window < 100
        assert window + w.cost_ms(n) == pytest.approx(BUDGET_FRACTION * 60.0)


def test_small_batches_wait_longer_than_big_ones() -> None:
    w = fed()
    assert w.window_ms(1, 0.0) > w.window_ms(8, 0.0) > w.window_ms(20, 0.0)
    quiet = fed(gap_ms=200.0)  # a sparse stream adds few items while it waits
    assert quiet.window_ms(1, 0.0) > w.window_ms(1, 0.0)


def test_full_batch_plans_with_the_full_cost() -> None:
    w = fed(target=60.0)
    window = w.window_ms(30, 0.0)  # fills (32) after 8 ms at 4 ms per item
    assert window == pytest.approx(BUDGET_FRACTION * 60 - w.cost_ms(32))


def test_noisy_costs_and_late_timers_get_a_margin() -> None:
    steady, noisy = fed(), fed(noise_ms=5.0)
    assert 5.0 <= noisy.margin_ms() <= 10.0  # +-5 ms around the fit (+-10 while it learns)
    assert noisy.window_ms(1, 0.0) < steady.window_ms(1, 0.0)
    late = fed()
    for i in range(8):  # batches that started 10 ms after their window closed
        late.observe_batch(4, 4.0, late_ms=10.0, now_ms=100.0 + i)
    assert late.margin_ms() == pytest.approx(10.0)
    assert late.window_ms(1, 0.0) == pytest.approx(steady.window_ms(1, 0.0) - 10.0 / (1 + 0.5 * 0.25))


def test_margin_forgets_old_errors() -> None:
    w = fed(noise_ms=5.0)
    for i in range(8):  # 8 exact batches, 10 s later: the noisy ones left the 3 s horizon
        w.observe_batch(4, 4.0, now_ms=10_000.0 + i)
    assert w.margin_ms() == pytest.approx(0.0, abs=0.5)


def test_p99_breach_shrinks_budget_and_headroom_gives_it_back() -> None:
    w = fed(target=60.0)
    before = w.window_ms(1, 0.0)
    for _ in range(16):
        w.observe_fire(True)  # batches fire on their window: the window is to blame
    for i in range(32):
        w.observe_latency(100.0, now_ms=1000.0 + i)
    assert w.backoff_ms == pytest.approx(2 * 0.05 * 60)
    assert w.window_ms(1, 0.0) < before
    for i in range(16 * 10):  # ten checks, each giving back 0.01 T
        w.observe_latency(10.0, now_ms=1100.0 + i)  # well under 0.9 T
    assert w.backoff_ms == pytest.approx(0.0, abs=1e-9)
    assert w.window_ms(1, 0.0) == pytest.approx(before)


def test_breach_under_backlog_does_not_shrink() -> None:
    w = fed(target=60.0)
    for _ in range(16):
        w.observe_fire(False)  # batches fire on a freed slot: the latency is queueing
    for i in range(32):
        w.observe_latency(100.0, now_ms=1000.0 + i)
    assert w.backoff_ms == 0.0


def test_max_wait_is_a_hard_cap_and_no_target_fills_batches() -> None:
    assert fed(target=1000.0).window_ms(1, 0.0) == 100.0
    no_target = fed(target=None)
    assert no_target.window_ms() == pytest.approx(min(100.0, 31 / 0.25))
    assert AdaptiveWindow(16, 5, None).window_ms() == 5.0


def test_busy_stream_leaves_the_next_batch_room() -> None:
    """Near saturation the batch stops growing where its cost plus the next batch's (the
    items arriving while it runs) meets the budget, before its own deadline would."""
    w = fed(target=20.0, gap_ms=0.5)  # 2 items per ms
    lam = w.arrival_rate_per_ms
    window = w.window_ms(1, 0.0)
    n = 1 + lam * window
    assert w.cost_ms(n) + w.cost_ms(lam * w.cost_ms(n)) == pytest.approx(BUDGET_FRACTION * 20.0)
    assert window + w.cost_ms(n) < BUDGET_FRACTION * 20.0  # its own deadline had slack left
    assert w.window_ms(15, 0.0) == 0.0  # already past n_max: fire now


def test_latency_first_window_does_not_wait_for_company_that_is_not_coming() -> None:
    """min_expected_arrivals=1: a wait expected to bring less than one item is not taken."""
    quiet_plain = fed(gap_ms=200.0)
    assert quiet_plain.window_ms(1, 0.0) > 0  # the deadline plan would wait
    quiet = fed(gap_ms=200.0)
    quiet.min_expected_arrivals = 1.0
    assert quiet.window_ms(1, 0.0) == 0.0
    busy_plain, busy = fed(gap_ms=4.0), fed(gap_ms=4.0)
    busy.min_expected_arrivals = 1.0
    assert busy.window_ms(1, 0.0) == busy_plain.window_ms(1, 0.0) > 4.0  # company is coming
    # the oldest has waited nearly the whole window: under one item left to gain, fire now
    gap = 1 / busy_plain.arrival_rate_per_ms
    age = next(a for a in range(200) if 0 < busy_plain.window_ms(1, float(a)) - a < gap)
    assert busy.window_ms(1, float(age)) == 0.0
