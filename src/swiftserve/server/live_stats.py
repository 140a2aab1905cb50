"""Live serving statistics for the web dashboard: a ring of once-a-second samples.

The dashboard polls ``GET /v1/stats?since=SEQ`` and gets only the samples it has not seen.
Everything here is bounded: the samples live in a deque of ``history_s / interval_s`` entries,
and the latencies of recently finished requests in a deque trimmed to the last ``window_s``
seconds (and capped at ``max_recent`` entries), so memory stays constant however long the
server runs and however often the page polls. Polling only serializes what the sampler
already computed; the sampler runs once a second whether or not anyone looks.

The inputs are the same instruments as ``/metrics``: the engine's stats dict (queue lengths,
KV and prefix-cache counters, step counters) and the per-request timings the server records
when a request finishes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class _Finished:
    at: float
    ttft: float | None
    tpot: float | None
    e2e: float | None


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def _rate(delta: float, seconds: float) -> float:
    return round(delta / seconds, 3) if seconds > 0 else 0.0


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


class LiveStats:
    """Recent request latencies plus a bounded history of dashboard samples."""

    def __init__(
        self,
        interval_s: float = 1.0,
        history_s: float = 600.0,
        window_s: float = 10.0,
        max_recent: int = 10_000,
        targets_ms: dict[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.targets_ms = targets_ms or {}
        self._clock, self._wall = clock, wall_clock
        self._recent: deque[_Finished] = deque(maxlen=max_recent)
        self._samples: deque[dict[str, Any]] = deque(maxlen=max(1, int(history_s / interval_s)))
        self._seq = 0
        self._finished = 0
        self._failed = 0
        self._tokens = 0
        self._prev: dict[str, float] = {}
        self._prev_time: float | None = None

    # ---- inputs ------------------------------------------------------------------------
    def observe_request(
        self, ttft: float | None, tpot: float | None, e2e: float | None, completion_tokens: int, ok: bool
    ) -> None:
        """One finished request (seconds; None where it has no such time)."""
        self._recent.append(_Finished(self._clock(), ttft, tpot, e2e))
        self._finished += 1
        self._failed += 0 if ok else 1
        self._tokens += completion_tokens

    def sample(
        self, engine: dict[str, Any], embedding: dict[str, Any] | None = None, in_flight: int = 0
    ) -> dict[str, Any]:
        """Append one sample built from the engine's (and embedder's) latest stats."""
        now = self._clock()
        while self._recent and self._recent[0].at < now - self.window_s:
            self._recent.popleft()
        dt = now - self._prev_time if self._prev_time is not None else 0.0
        counters = self._counters(engine, embedding)
        if self._prev_time is None:
            delta = dict.fromkeys(counters, 0.0)
        else:  # a counter the last sample lacked (no engine stats yet then) starts from 0
            delta = {k: v - self._prev.get(k, 0.0) for k, v in counters.items()}
        self._prev, self._prev_time = counters, now
        self._seq += 1
        sample: dict[str, Any] = {
            "seq": self._seq,
            "time": round(self._wall(), 3),
            **self._latencies(),
            "finished": self._finished,
            "failed": self._failed,
            "requests_per_s": _rate(delta["finished"], dt),
            "tokens_per_s": _rate(delta["tokens"], dt),
            "in_flight": in_flight,
        }
        if engine:
            sample.update(self._engine_fields(engine, delta, dt))
        if embedding is not None:
            sample.update(self._embedding_fields(embedding, delta))
        self._samples.append(sample)
        return sample

    # ---- output ------------------------------------------------------------------------
    def snapshot(self, since: int = 0) -> dict[str, Any]:
        """The samples after ``since`` (all retained ones for 0) and the fixed facts."""
        samples = [s for s in self._samples if s["seq"] > since] if since else list(self._samples)
        return {
            "object": "stats",
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "targets_ms": self.targets_ms,
            "last_seq": self._seq,
            "samples": samples,
        }

    # ---- helpers -----------------------------------------------------------------------
    def _counters(self, engine: dict[str, Any], embedding: dict[str, Any] | None) -> dict[str, float]:
        counters = {"finished": float(self._finished), "tokens": float(self._tokens)}
        for name in ("prefix_queries", "prefix_hits", "num_steps", "scheduled_rows", "computed_tokens"):
            if name in engine:
                counters[name] = float(engine[name])
        if embedding is not None:
            counters["embed_batches"] = float(embedding["batches"])
            counters["embed_items"] = float(embedding["items"])
        return counters

    def _latencies(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name in ("ttft", "tpot", "e2e"):
            values = [v for v in (getattr(f, name) for f in self._recent) if v is not None]
            out[f"{name}_p50_ms"] = _ms(_percentile(values, 50))
            out[f"{name}_p99_ms"] = _ms(_percentile(values, 99))
        return out

    @staticmethod
    def _engine_fields(engine: dict[str, Any], delta: dict[str, float], dt: float) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "running": engine.get("num_running", 0),
            "waiting": engine.get("num_waiting", 0),
            "kv_cache_usage": round(float(engine.get("kv_cache_usage", 0.0)), 4),
            # The hit rate of the prompt tokens looked up during this interval (None: no lookups).
            "prefix_hit_rate": _ratio(delta.get("prefix_hits", 0.0), delta.get("prefix_queries", 0.0)),
            "preemptions": engine.get("num_preemptions", 0),
            "step_budget": engine.get("step_budget"),
        }
        steps = delta.get("num_steps", 0.0)
        fields["steps_per_s"] = _rate(steps, dt)
        fields["batch_size_mean"] = _ratio(delta.get("scheduled_rows", 0.0), steps)
        fields["tokens_per_step"] = _ratio(delta.get("computed_tokens", 0.0), steps)
        return fields

    @staticmethod
    def _embedding_fields(embedding: dict[str, Any], delta: dict[str, float]) -> dict[str, Any]:
        return {
            "embed_window_ms": round(float(embedding["current_window_ms"]), 3),
            "embed_batch_size_mean": _ratio(delta.get("embed_items", 0.0), delta.get("embed_batches", 0.0)),
            "embed_queue_wait_p99_ms": embedding["queue_wait_ms"][99],
        }
