"""``swiftserve bench reliability``: the figures shared/RELIABILITY.md asks to publish.

Starts real servers on 127.0.0.1 and measures: requests lost and 503 latency under 2x and 5x
overload; KV usage and RSS after a storm with 50% cancellations; time from engine death to
/health 503 and to process exit; /health latency while a 1 MB prompt is refused; and the
hardening figures of bench/hardening.py (giant prompts, 1,000 rejected requests, the drain).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from swiftserve.bench import hardening
from swiftserve.bench.launch import running_server


@contextmanager
def server(
    model: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with (
        tempfile.TemporaryDirectory() as logs,
        running_server(Path(model), *args, env=env, log_dir=Path(logs)) as srv,
    ):
        yield srv.url, srv.proc


def _gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("swiftserve:") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _rss_mb(pid: int) -> float:
    """RSS of the server and its children (the engine process), in MiB."""
    pids = [pid] + [
        int(p)
        for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    ]
    total = 0
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


async def _overload(url: str, concurrent: int) -> dict[str, Any]:
    async def one(client: httpx.AsyncClient) -> tuple[str, float, float | None]:
        start = time.perf_counter()
        try:
            async with client.stream(
                "POST",
                f"{url}/v1/completions",
                json={"prompt": "def main():", "max_tokens": 32, "ignore_eos": True, "stream": True},
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return str(resp.status_code), time.perf_counter() - start, None
                ttft = None
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and ttft is None:
                        ttft = time.perf_counter() - start
                return "200", time.perf_counter() - start, ttft
        except httpx.HTTPError:
            return "lost", time.perf_counter() - start, None

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        results = await asyncio.gather(*(one(client) for _ in range(concurrent)))
    rejected = [t for s, t, _ in results if s == "503"]
    ttfts = [f for s, _, f in results if s == "200" and f is not None]
    return {
        "sent": concurrent,
        "completed": sum(s == "200" for s, _, _ in results),
        "rejected_503": len(rejected),
        "lost": sum(s not in ("200", "503") for s, _, _ in results),
        "p99_rejection_ms": float(np.percentile(rejected, 99) * 1000) if rejected else None,
        "admitted_ttft_p99_ms": float(np.percentile(ttfts, 99) * 1000) if ttfts else None,
    }


async def _storm(url: str, n: int) -> None:
    async def one(client: httpx.AsyncClient, cancel: bool) -> None:
        async with client.stream(
            "POST",
            f"{url}/v1/completions",
            json={"prompt": "import os", "max_tokens": 64, "ignore_eos": True, "stream": True},
        ) as resp:
            async for line in resp.aiter_lines():
                if cancel and line.startswith("data: {"):
                    return  # drop the connection mid-stream

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        await asyncio.gather(*(one(client, i % 2 == 0) for i in range(n)))


def _wait_idle(url: str) -> dict[str, float]:
    for _ in range(600):
        g = _gauges(url)
        if g["swiftserve:num_requests_running"] == 0 and g["swiftserve:num_requests_waiting"] == 0:
            return g
        time.sleep(0.05)
    return _gauges(url)


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {}
    seats = ("--max-num-seqs", "4", "--max-queued-requests", "4", "--max-model-len", "256")
    with server(args.model, *seats) as (url, proc):
        for factor in (2, 5):
            report[f"overload_{factor}x"] = asyncio.run(_overload(url, 8 * factor))
        idle = _wait_idle(url)
        rss0 = _rss_mb(proc.pid)
        asyncio.run(_storm(url, 40))
        after = _wait_idle(url)
        report["cancellation_storm"] = {
            "requests": 40,
            "cancelled": 20,
            "kv_usage_before": idle["swiftserve:kv_cache_usage_perc"],
            "kv_usage_after": after["swiftserve:kv_cache_usage_perc"],
            "rss_mb_before": rss0,
            "rss_mb_after": _rss_mb(proc.pid),
        }
        lat: list[float] = []

        async def health_during_big_prompt() -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                big = asyncio.create_task(
                    client.post(f"{url}/v1/completions", json={"prompt": "x = 1  # é\n" * 80_000})
                )
                while not big.done():
                    t0 = time.perf_counter()
                    await client.get(f"{url}/health")
                    lat.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.01)
                await big

        asyncio.run(health_during_big_prompt())
        report["giant_prompts"] = asyncio.run(hardening.giant_prompts(url))
        report["rejected_requests"] = hardening.rejected_requests_rss(url, proc.pid, _rss_mb)
        report["health_latency_during_1mb_prompt"] = {
            "samples": len(lat),
            "p50_ms": float(np.percentile(lat, 50) * 1000),
            "p99_ms": float(np.percentile(lat, 99) * 1000),
            "max_ms": max(lat) * 1000,
        }
    with server(args.model, "--max-model-len", "256", env={"SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER": "3"}) as (
        url,
        proc,
    ):
        httpx.post(
            f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 50, "ignore_eos": True}, timeout=60
        )
        died = time.perf_counter()
        to_503 = None
        while proc.poll() is None:
            try:
                if to_503 is None and httpx.get(f"{url}/health", timeout=0.5).status_code == 503:
                    to_503 = time.perf_counter() - died
            except httpx.HTTPError:
                pass
            time.sleep(0.005)
        report["engine_death"] = {
            "error_to_health_503_ms": None if to_503 is None else to_503 * 1000,
            "error_to_exit_ms": (time.perf_counter() - died) * 1000,
            "exit_code": proc.returncode,
        }
    slow = {"SWIFTSERVE_INJECT_STEP_DELAY_S": "0.05"}  # in-flight work outlasts the timeout
    with server(args.model, "--max-model-len", "256", "--shutdown-timeout", "2", env=slow) as (url, proc):
        report["drain"] = hardening.drain(url, proc, 2.0)
    print(json.dumps(report, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory to serve")
    parser.add_argument("--output-json", default=None)
