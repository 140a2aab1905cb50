"""Hardening figures for ``swiftserve bench reliability``: hostile requests against a real server.

- a 2-token request's latency while two 8 MB prompts are being rejected (and theirs);
- RSS of the server (and its engine process) before and after 1,000 rejected requests;
- the SIGTERM drain when in-flight work outlasts ``--shutdown-timeout``: what clients get,
  and how long the process takes to exit.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import httpx

HOSTILE = [
    '{"prompt": "a", "seed": 18446744073709551616}',
    '{"prompt": "a", "top_k": 10000000000000000000}',
    '{"prompt": "a", "stop_token_ids": [1, 36893488147419103232]}',
    '{"prompt": "a", "priority": -1180591620717411303424}',
    '{"prompt": "\\ud800"}',
    '{"prompt": "a", "max_tokens": "5"}',
    '{"messages": [{"role": "user", "content": "x\\udfff"}]}',
]


async def giant_prompts(url: str) -> dict[str, Any]:
    """Two 8 MB prompts sent at once, then a 2-token request: every latency in ms."""
    prompt = "word " * 1_600_000

    async def timed(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, float]:
        start = time.perf_counter()
        resp = await client.post(f"{url}/v1/completions", json=body)
        return resp.status_code, (time.perf_counter() - start) * 1000

    async with httpx.AsyncClient(timeout=300) as client:
        bigs = [asyncio.create_task(timed(client, {"prompt": prompt})) for _ in range(2)]
        await asyncio.sleep(0.05)  # the big bodies are on the wire first
        small = await timed(client, {"prompt": "x", "max_tokens": 2})
        big = await asyncio.gather(*bigs)
    return {
        "small_status": small[0],
        "small_latency_ms": small[1],
        "giant_statuses": [s for s, _ in big],
        "giant_latency_ms": [t for _, t in big],
    }


def rejected_requests_rss(
    url: str, pid: int, rss_mb: Callable[[int], float], n: int = 1000
) -> dict[str, Any]:
    """RSS before and after ``n`` requests that must all be refused with a 4xx."""
    before = rss_mb(pid)
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            body = HOSTILE[i % len(HOSTILE)]
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            code = client.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"})
            statuses[code.status_code] = statuses.get(code.status_code, 0) + 1
    return {"requests": n, "statuses": statuses, "rss_mb_before": before, "rss_mb_after": rss_mb(pid)}


def drain(url: str, proc: subprocess.Popen[bytes], shutdown_timeout: float) -> dict[str, Any]:
    """SIGTERM while a stream and a plain request run past the timeout: what each gets."""

    async def scenario() -> dict[str, Any]:
        body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=120) as client:
            plain = asyncio.create_task(client.post(f"{url}/v1/completions", json=body))
            lines: list[str] = []
            sent = 0.0
            async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        if len(lines) == 1:
                            proc.send_signal(signal.SIGTERM)
                            sent = time.perf_counter()
            answer = await plain
            return {
                "plain_status": answer.status_code,
                "plain_error_code": answer.json().get("error", {}).get("code"),
                "stream_last_events": [lines[-2][:120], lines[-1]],
                "sigterm_to_stream_end_ms": (time.perf_counter() - sent) * 1000,
                "sent": sent,
            }

    report = asyncio.run(scenario())
    proc.wait(timeout=60)
    report["sigterm_to_exit_ms"] = (time.perf_counter() - report.pop("sent")) * 1000
    report["exit_code"] = proc.returncode
    report["shutdown_timeout_s"] = shutdown_timeout
    return report
