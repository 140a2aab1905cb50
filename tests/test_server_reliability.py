"""Events a server must survive: disconnects, overload, SIGTERM drain, engine death."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from server_utils import Server, running_server

LONG = {"prompt": "def main():", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def wait_idle(server: Server, timeout: float = 15) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["swiftserve:num_requests_running"] == 0 and m["swiftserve:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_disconnects_free_everything(llama_dir: Path, tmp_path: Path) -> None:
    args = ("--max-model-len", "256", "--max-num-seqs", "3")
    with running_server(llama_dir, *args, log_dir=tmp_path) as server:
        idle = wait_idle(server)["swiftserve:kv_cache_usage_perc"]

        async def open_and_drop(i: int) -> int:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {**LONG, "stream": True}
                path = "/v1/completions" if i % 2 else "/v1/chat/completions"
                if i % 2 == 0:
                    body = {
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 200,
                        "ignore_eos": True,
                        "stream": True,
                    }
                async with client.stream("POST", f"{server.url}{path}", json=body) as resp:
                    seen = 0
                    async for line in resp.aiter_lines():
                        seen += line.startswith("data:")
                        if seen >= 3:
                            break  # leave mid-stream: the connection closes
                    return seen

        async def drop_all() -> list[int]:
            streams = [open_and_drop(i) for i in range(6)]  # 6 > max_num_seqs: some still queued
            non_stream = asyncio.create_task(_abandon_non_streaming(server.url))
            results = await asyncio.gather(*streams)
            await non_stream
            return results

        assert all(seen >= 3 for seen in asyncio.run(drop_all()))
        after = wait_idle(server)
        assert after["swiftserve:kv_cache_usage_perc"] == idle
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert ok.status_code == 200


async def _abandon_non_streaming(url: str) -> None:
    async with httpx.AsyncClient(timeout=0.05) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 240})


def test_overload_rejects_fast_and_loses_nothing(llama_dir: Path, tmp_path: Path) -> None:
    args = ("--max-model-len", "256", "--max-num-seqs", "2", "--max-queued-requests", "2")
    with running_server(llama_dir, *args, log_dir=tmp_path) as server:

        async def one(client: httpx.AsyncClient) -> tuple[int, float, httpx.Response]:
            start = time.perf_counter()
            resp = await client.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 60})
            return resp.status_code, time.perf_counter() - start, resp

        async def burst() -> list[tuple[int, float, httpx.Response]]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(one(client) for _ in range(10)))

        results = asyncio.run(burst())
        statuses = [s for s, _, _ in results]
        assert len(results) == 10 and set(statuses) <= {200, 503}
        assert statuses.count(200) >= 4 and statuses.count(503) >= 1
        for status, _, resp in results:
            if status == 503:
                assert resp.headers.get("Retry-After") and resp.json()["error"]["code"] == "overloaded"
            else:
                assert resp.json()["usage"]["completion_tokens"] == 60  # admitted ones complete


def test_sigterm_drains_then_exits_zero(llama_dir: Path, tmp_path: Path) -> None:
    with running_server(
        llama_dir, "--max-model-len", "256", "--shutdown-timeout", "30", log_dir=tmp_path
    ) as server:

        async def scenario() -> tuple[httpx.Response, int]:
            async with httpx.AsyncClient(timeout=60) as client:
                inflight = asyncio.create_task(
                    client.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 150})
                )
                await asyncio.sleep(0.5)
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                try:
                    late = await client.post(f"{server.url}/v1/completions", json={"prompt": "x"})
                    late_status = late.status_code
                except httpx.HTTPError:
                    late_status = -1  # listener already closed: also a refusal
                return await inflight, late_status

        done, late_status = asyncio.run(scenario())
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 150
        assert late_status in (503, -1)
        assert server.proc.wait(timeout=30) == 0


def test_engine_death_errors_health_and_exit_code(llama_dir: Path, tmp_path: Path) -> None:
    env = {"SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER": "5"}
    with running_server(llama_dir, "--max-model-len", "256", env=env, log_dir=tmp_path) as server:
        resp = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=30)
        assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_dead"
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
        assert server.proc.wait(timeout=10) != 0


def test_huge_prompt_is_refused_before_tokenization(llama_dir: Path, tmp_path: Path) -> None:
    """A 1 MB prompt is over the character budget: refused untokenized, /health unaffected."""
    with running_server(llama_dir, "--max-model-len", "256", log_dir=tmp_path) as server:

        async def scenario() -> tuple[httpx.Response, list[int]]:
            async with httpx.AsyncClient(timeout=60) as client:
                prompt = "for i in range(10): print(i)  # é\n" * 30_000  # about 1 MB
                big = asyncio.create_task(
                    client.post(f"{server.url}/v1/completions", json={"prompt": prompt})
                )
                health = []
                while not big.done():
                    health.append((await client.get(f"{server.url}/health")).status_code)
                    await asyncio.sleep(0.01)
                return await big, health

        resp, health = asyncio.run(scenario())
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
        assert "longer than that many tokens can spell" in resp.json()["error"]["message"]
        assert set(health) <= {200}


def test_thread_engine_mode_serves_and_reports_death(llama_dir: Path, tmp_path: Path) -> None:
    """The in-process engine thread (--engine-mode thread) keeps the same contract."""
    env = {"SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER": "40"}
    with running_server(
        llama_dir, "--max-model-len", "256", "--engine-mode", "thread", env=env, log_dir=tmp_path
    ) as server:
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 8}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
        dead = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=30)
        assert dead.status_code == 500 and dead.json()["error"]["code"] == "engine_dead"
        assert server.proc.wait(timeout=10) != 0
