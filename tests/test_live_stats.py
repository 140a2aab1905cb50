"""LiveStats (the dashboard's data) on a simulated clock: percentiles over a sliding window,
per-interval rates and hit rates from counters, bounded memory, and ``since`` paging."""

from __future__ import annotations

from swiftserve.server.live_stats import LiveStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(**overrides: float) -> dict[str, float]:
    stats = {
        "num_running": 2,
        "num_waiting": 1,
        "kv_cache_usage": 0.25,
        "prefix_queries": 0,
        "prefix_hits": 0,
        "num_preemptions": 0,
        "step_budget": 512,
        "num_steps": 0,
        "scheduled_rows": 0,
        "computed_tokens": 0,
    }
    stats.update(overrides)
    return stats


def test_latency_percentiles_cover_only_the_window() -> None:
    clock = Clock()
    live = LiveStats(window_s=10, clock=clock, wall_clock=clock)
    for i in range(100):  # TTFT 1..100 ms, all finished now
        live.observe_request((i + 1) / 1000, 0.02, 0.5, 10, ok=True)
    sample = live.sample(_engine())
    assert sample["ttft_p50_ms"] == 50 and sample["ttft_p99_ms"] == 99
    assert sample["tpot_p99_ms"] == 20 and sample["e2e_p50_ms"] == 500
    clock.now += 11  # past the window: no latency to show, totals stay
    sample = live.sample(_engine())
    assert sample["ttft_p50_ms"] is None and sample["finished"] == 100


def test_rates_and_hit_rate_come_from_counter_deltas() -> None:
    clock = Clock()
    live = LiveStats(clock=clock, wall_clock=clock)
    live.sample(
        _engine(prefix_queries=100, prefix_hits=10, num_steps=5, scheduled_rows=5, computed_tokens=50)
    )
    clock.now += 2
    for _ in range(4):
        live.observe_request(0.1, 0.01, 0.3, 25, ok=True)
    live.observe_request(None, None, None, 0, ok=False)
    sample = live.sample(
        _engine(prefix_queries=300, prefix_hits=160, num_steps=15, scheduled_rows=45, computed_tokens=450)
    )
    assert sample["prefix_hit_rate"] == 0.75  # 150 of the 200 tokens looked up in this interval
    assert sample["batch_size_mean"] == 4.0 and sample["tokens_per_step"] == 40.0
    assert sample["steps_per_s"] == 5.0
    assert sample["requests_per_s"] == 2.5 and sample["tokens_per_s"] == 50.0
    assert sample["finished"] == 5 and sample["failed"] == 1
    assert sample["running"] == 2 and sample["waiting"] == 1 and sample["kv_cache_usage"] == 0.25
    clock.now += 1
    assert live.sample(_engine(prefix_queries=300, prefix_hits=160))["prefix_hit_rate"] is None


def test_history_and_recent_requests_are_bounded() -> None:
    clock = Clock()
    live = LiveStats(interval_s=1, history_s=30, max_recent=50, clock=clock, wall_clock=clock)
    for _ in range(200):
        for _ in range(10):
            live.observe_request(0.1, 0.01, 0.2, 3, ok=True)
        live.sample(_engine())
        clock.now += 1
    snap = live.snapshot()
    assert len(snap["samples"]) == 30 and snap["last_seq"] == 200
    assert len(live._recent) <= 50
    assert [s["seq"] for s in live.snapshot(since=197)["samples"]] == [198, 199, 200]
    assert live.snapshot(since=200)["samples"] == []


def test_embedding_fields_and_targets() -> None:
    clock = Clock()
    live = LiveStats(targets_ms={"ttft": 500.0}, clock=clock, wall_clock=clock)
    embed = {"batches": 2, "items": 10, "current_window_ms": 4.0, "queue_wait_ms": {99: 3.5}}
    live.sample({}, embed)
    clock.now += 1
    sample = live.sample({}, {**embed, "batches": 6, "items": 42})
    assert sample["embed_batch_size_mean"] == 8.0 and sample["embed_window_ms"] == 4.0
    assert "running" not in sample  # no LLM engine on this server
    assert live.snapshot()["targets_ms"] == {"ttft": 500.0}


def test_counters_that_appear_late_count_from_zero() -> None:
    """The engine's first stats can arrive after the first samples: the steps of that first
    busy interval still count (they once vanished, leaving the batch chart empty)."""
    clock = Clock()
    live = LiveStats(clock=clock, wall_clock=clock)
    live.sample({})  # no engine stats yet
    clock.now += 1
    sample = live.sample(_engine(num_steps=10, scheduled_rows=30, computed_tokens=300))
    assert sample["batch_size_mean"] == 3.0 and sample["steps_per_s"] == 10.0
