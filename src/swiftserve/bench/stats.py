"""Latency statistics for ``bench serve`` (TTFT, TPOT, ITL, E2EL, throughput, goodput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    priority: int
    ok: bool
    status: int
    start: float = 0.0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    timed: bool = False  # carried a timeout (deadline)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def _dist(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ms = np.asarray(values_s) * 1000
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def summarize(
    results: list[RequestResult], duration_s: float, slo: dict[str, float] | None
) -> dict[str, Any]:
    """The JSON block for one set of requests (the whole run, or one priority class)."""
    done = [r for r in results if r.ok]
    tpots = [t for r in done if (t := r.tpot) is not None]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[str(r.status)] = errors.get(str(r.status), 0) + 1
    out: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors_by_status": errors,
        "ttft_ms": _dist([r.ttft for r in done]),
        "tpot_ms": _dist(tpots),
        "itl_ms": _dist([g for r in done for g in r.itl]),
        "e2el_ms": _dist([r.e2el for r in done]),
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_token_throughput": sum(r.output_tokens for r in done) / duration_s if duration_s else 0.0,
        "total_token_throughput": sum(r.output_tokens + r.prompt_tokens for r in done) / duration_s
        if duration_s
        else 0.0,
    }
    if slo:
        good = [
            r
            for r in done
            if r.ttft * 1000 <= slo.get("ttft", float("inf"))
            and ((r.tpot or 0.0) * 1000 <= slo.get("tpot", float("inf")))
        ]
        out["goodput"] = len(good) / duration_s if duration_s else 0.0
    return out


def parse_slo(spec: str | None) -> dict[str, float] | None:
    """'ttft:500,tpot:50' -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    if not spec:
        return None
    slo = {}
    for part in spec.split(","):
        key, value = part.split(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--slo: unknown metric {key!r} (ttft, tpot, e2el)")
        slo[key] = float(value)
    return slo
