"""Prometheus metrics (``swiftserve:`` prefix, names mirroring vLLM's)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from swiftserve.outputs import RequestMetrics
from swiftserve.server.live_stats import LiveStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """All server-side metrics in one registry (one per app, so tests can run several)."""

    def __init__(self, target_ttft_s: float | None = None, target_tpot_s: float | None = None) -> None:
        self.target_ttft_s = target_ttft_s
        self.target_tpot_s = target_tpot_s
        targets = {"ttft": target_ttft_s, "tpot": target_tpot_s}
        # The dashboard's view of the same instruments (GET /v1/stats).
        self.live = LiveStats(targets_ms={k: v * 1000 for k, v in targets.items() if v is not None})
        r = self.registry = CollectorRegistry()
        self.running = Gauge("swiftserve:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("swiftserve:num_requests_waiting", "Requests waiting to run", registry=r)
        self.kv_usage = Gauge("swiftserve:kv_cache_usage_perc", "Fraction of KV blocks in use", registry=r)
        self.prefix_queries = Gauge("swiftserve:prefix_cache_queries", "Prompt tokens looked up", registry=r)
        self.prefix_hits = Gauge("swiftserve:prefix_cache_hits", "Prompt tokens found cached", registry=r)
        self.preemptions = Gauge("swiftserve:num_preemptions_total", "Preemptions so far", registry=r)
        # speculative decoding, vLLM's names (counts so far; the engine's counters)
        self.spec = {
            name: Gauge(f"swiftserve:spec_decode_{name}", text, registry=r)
            for name, text in (
                ("num_drafts", "Steps that verified drafts"),
                ("num_draft_tokens", "Draft tokens proposed"),
                ("num_accepted_tokens", "Draft tokens accepted"),
                ("num_emitted_tokens", "Tokens emitted by verifying steps"),
            )
        }
        # data parallel: each replica's own gauges, labelled engine="0", "1", ... (the
        # unlabelled ones above are their sums; KV usage their mean)
        self.per_engine = {
            key: Gauge(f"swiftserve:engine_{name}", text, ["engine"], registry=r)
            for key, name, text in (
                ("num_running", "num_requests_running", "Requests running on this replica"),
                ("num_waiting", "num_requests_waiting", "Requests waiting on this replica"),
                ("kv_cache_usage", "kv_cache_usage_perc", "This replica's KV blocks in use"),
                ("routed_requests", "routed_requests", "Requests routed to this replica so far"),
                ("num_steps", "num_steps", "Engine steps this replica ran"),
            )
        }
        self.frontend_requests = Gauge(
            "swiftserve:frontend_requests", "Requests holding frontend state (queue, detokenizer)", registry=r
        )
        self.sequences_in_flight = Gauge(
            "swiftserve:sequences_in_flight", "Admitted sequences (prompts x n) not yet answered", registry=r
        )
        self.ttft = Histogram(
            "swiftserve:time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "swiftserve:inter_token_latency_seconds", "ITL", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "swiftserve:e2e_request_latency_seconds",
            "End to end",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "swiftserve:request_queue_time_seconds",
            "Queue time",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            "swiftserve:request_success", "Finished requests", ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("swiftserve:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("swiftserve:generation_tokens", "Generated tokens", registry=r)
        self.rejected = Counter("swiftserve:request_rejected", "Rejected requests", ["reason"], registry=r)
        self.embed_batches = Gauge("swiftserve:embedding_batches_total", "Embedding batches run", registry=r)
        self.embed_items = Gauge("swiftserve:embedding_inputs_total", "Inputs embedded", registry=r)
        self.embed_mean_batch = Gauge("swiftserve:embedding_mean_batch_size", "Mean batch size", registry=r)
        self.embed_wait_p99 = Gauge(
            "swiftserve:embedding_queue_wait_p99_seconds", "Queue wait P99", registry=r
        )
        self.embed_latency_p99 = Gauge("swiftserve:embedding_latency_p99_seconds", "Latency P99", registry=r)
        self.embed_window = Gauge("swiftserve:embedding_batch_window_seconds", "Current window", registry=r)
        # Goodput (vLLM's definition): finished requests that met every latency target.
        self.slo = Counter(
            "swiftserve:slo_requests",
            "Finished requests by latency target (ttft, tpot, all) and whether they met it",
            ["slo", "met"],
            registry=r,
        )
        self.pipeline_in_flight = Gauge(
            "swiftserve:pipeline_max_micro_batches_in_flight",
            "Most pipeline-parallel micro-batches seen in flight at once (1 without stages)",
            registry=r,
        )
        self.step_budget = Gauge("swiftserve:step_token_budget", "Token budget of the last step", registry=r)
        self.deadline_failed = Gauge(
            "swiftserve:deadline_failures_total",
            "Requests ended for their deadline: passed (expired) or not reachable (infeasible)",
            ["reason"],
            registry=r,
        )
        self.computed_tokens = Gauge(
            "swiftserve:computed_tokens_total", "Tokens the engine has computed", registry=r
        )
        self.deadline_wasted = Gauge(
            "swiftserve:deadline_wasted_tokens_total",
            "Tokens computed for requests that then ended for their deadline",
            registry=r,
        )

    def observe_finished(
        self,
        metrics: RequestMetrics | None,
        reasons: list[str],
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        for reason in reasons:
            self.success.labels(finished_reason=reason).inc()
        ok = all(reason in ("stop", "length") for reason in reasons)
        if metrics is None:
            self.live.observe_request(None, None, None, completion_tokens, ok)
            return
        first, done = metrics.first_token_time, metrics.finished_time
        ttft = None if first is None else first - metrics.arrival_time
        e2e = None if done is None else done - metrics.arrival_time
        if ttft is not None:
            self.ttft.observe(ttft)
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        if e2e is not None:
            self.e2e.observe(e2e)
        self.live.observe_request(ttft, _tpot(metrics, completion_tokens), e2e, completion_tokens, ok)
        self._observe_slo(metrics, completion_tokens)

    def _observe_slo(self, metrics: RequestMetrics, completion_tokens: int) -> None:
        if self.target_ttft_s is None and self.target_tpot_s is None:
            return
        first = metrics.first_token_time
        met = []
        if self.target_ttft_s is not None:
            ok = first is not None and first - metrics.arrival_time <= self.target_ttft_s
            self.slo.labels(slo="ttft", met=str(ok).lower()).inc()
            met.append(ok)
        tpot = _tpot(metrics, completion_tokens)
        if self.target_tpot_s is not None and tpot is not None:
            ok = tpot <= self.target_tpot_s
            self.slo.labels(slo="tpot", met=str(ok).lower()).inc()
            met.append(ok)
        self.slo.labels(slo="all", met=str(bool(met) and all(met)).lower()).inc()

    def render(self, stats: dict[str, Any], embedding: dict[str, Any] | None = None) -> bytes:
        if stats:
            self.running.set(stats["num_running"])
            self.waiting.set(stats["num_waiting"])
            self.kv_usage.set(stats["kv_cache_usage"])
            self.prefix_queries.set(stats["prefix_queries"])
            self.prefix_hits.set(stats["prefix_hits"])
            self.preemptions.set(stats["num_preemptions"])
            self.pipeline_in_flight.set(stats.get("pipeline_max_in_flight", 1))
        if "step_budget" in stats:
            self.step_budget.set(stats["step_budget"])
            self.deadline_failed.labels(reason="expired").set(stats["deadline_expired"])
            self.deadline_failed.labels(reason="infeasible").set(stats["deadline_infeasible"])
            self.deadline_wasted.set(stats["deadline_wasted_tokens"])
            self.computed_tokens.set(stats["computed_tokens"])
            for name, gauge in self.spec.items():
                gauge.set(stats.get(f"spec_decode_{name}", 0.0))
        for index, engine_stats in enumerate(stats.get("engines", ())):
            for key, gauge in self.per_engine.items():
                gauge.labels(engine=str(index)).set(engine_stats.get(key, 0.0))
        if "frontend_requests" in stats:
            self.frontend_requests.set(stats["frontend_requests"])
        if embedding is not None:
            self.embed_batches.set(embedding["batches"])
            self.embed_items.set(embedding["items"])
            self.embed_mean_batch.set(embedding["mean_batch_size"])
            self.embed_wait_p99.set(embedding["queue_wait_ms"][99] / 1000)
            self.embed_latency_p99.set(embedding["latency_ms"][99] / 1000)
            self.embed_window.set(embedding["current_window_ms"] / 1000)
        return generate_latest(self.registry)


def _tpot(metrics: RequestMetrics, completion_tokens: int) -> float | None:
    """Mean time per output token after the first (0 for a one-token answer; None if unknown)."""
    first, done = metrics.first_token_time, metrics.finished_time
    if first is None or done is None:
        return None
    return (done - first) / (completion_tokens - 1) if completion_tokens > 1 else 0.0
