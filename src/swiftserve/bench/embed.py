"""``swiftserve bench embed``: single-sentence ``/v1/embeddings`` load against one or more
OpenAI-compatible embedding servers, side by side on the same trace.

Traces: ``bursty`` (2 s at 15 req/s, then 1 s at 150 req/s, three times: the overload a
burst brings, where what matters is how fast a server drains its backlog; ``bursty:2``
doubles both rates, for machines that carry the plain one too easily) and
``steady:RATE`` (Poisson at RATE req/s for ``--duration`` seconds). Each request embeds one
sentence of 8-40 words drawn from a fixed vocabulary, fresh for every run (a new seed), so
no server answers from a cache. Targets run one after another in each round, the order
alternating between rounds; the report gives throughput and p50/p90/p99 per target and
trace, the median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import numpy as np

BURSTY = [(15.0, 2.0), (150.0, 1.0)] * 3  # (req/s, seconds)
_VOCABULARY = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "time people year way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education quickly slowly bright "
    "ancient river mountain signal engine network latency server request batch model vector"
)
_WORDS = _VOCABULARY.split()


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(8, 40))).capitalize() + "." for _ in range(n)]


def arrivals(trace: str, duration: float, seed: int) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process over the trace's phases."""
    kind, _, value = trace.partition(":")
    if kind == "bursty":  # bursty:SCALE multiplies both phases' rates (default 1)
        phases = [(rate * float(value or 1), length) for rate, length in BURSTY]
    else:
        phases = [(float(value), duration)]
    rng = random.Random(seed)
    out: list[float] = []
    start = 0.0
    for rate, length in phases:
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + length:
                break
            out.append(t)
        start += length
    return out


class _StaleConnection(ConnectionError):
    """The server closed a kept-alive connection before answering on it."""


class RawClient:
    """A minimal HTTP/1.1 keep-alive client for POSTing JSON at high rates.

    httpx spent ~12 ms of CPU per request with a thousand requests in flight (its pool scans
    its connections on every request), which on a 2-core machine made the load generator
    the bottleneck of the servers it measured. This costs a small fraction of that.
    """

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body``; a kept-alive connection the server closed meanwhile (its idle
        timeout) is replaced and the request sent again, as any HTTP client does."""
        while self._idle:
            conn = self._idle.pop()
            try:
                return await self._exchange(conn, path, body)
            except _StaleConnection:
                continue
        return await self._exchange(await asyncio.open_connection(self.host, self.port), path, body)

    async def _exchange(
        self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], path: str, body: bytes
    ) -> tuple[int, bytes]:
        reader, writer = conn
        try:
            head = (
                f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            writer.write(head.encode() + body)
            try:
                status_line = await reader.readline()
            except ConnectionResetError as e:
                raise _StaleConnection from e
            if not status_line:
                raise _StaleConnection
            status = int(status_line.split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip().lower()
            if headers.get("transfer-encoding") == "chunked":
                data = b""
                while size := int((await reader.readline()).strip(), 16):
                    data += (await reader.readexactly(size + 2))[:-2]
                await reader.readline()
            else:
                data = await reader.readexactly(int(headers.get("content-length", "0")))
        except BaseException:
            writer.close()
            raise
        if headers.get("connection") == "close":
            writer.close()
        else:
            self._idle.append(conn)
        return status, data

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def run_trace(
    base_url: str, model: str | None, offsets: list[float], texts: list[str]
) -> dict[str, Any]:
    """Send one request per offset; latencies of the successful ones, errors by status."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    client = RawClient(base_url)
    start = time.perf_counter()

    async def one(offset: float, text: str) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        t0 = time.perf_counter()
        try:
            status, data = await client.post(
                "/embeddings", msgspec.json.encode({"model": model, "input": text})
            )
            ok = status == 200 and len(msgspec.json.decode(data)["data"][0]["embedding"]) > 0
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
            status, ok = type(e).__name__, False  # type: ignore[assignment]
        if ok:
            latencies.append((time.perf_counter() - t0) * 1000)
        else:
            errors[str(status)] = errors.get(str(status), 0) + 1

    await asyncio.gather(*(one(o, t) for o, t in zip(offsets, texts, strict=True)))
    duration = time.perf_counter() - start
    client.close()
    ms = np.asarray(latencies) if latencies else np.zeros(1)
    return {
        "requests": len(offsets),
        "completed": len(latencies),
        "errors": errors,
        "duration_s": duration,
        "throughput_rps": len(latencies) / duration,
        **{f"p{q}_ms": float(np.percentile(ms, q)) for q in (50, 90, 99)},
        "mean_ms": float(ms.mean()),
    }


def _model_of(base_url: str) -> str | None:
    try:
        data = httpx.get(f"{base_url}/models", timeout=10).json()["data"]
        return str(data[-1]["id"]) if data else None
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def _targets(spec: str) -> list[tuple[str, str]]:
    out = []
    for part in spec.split(","):
        name, _, url = part.partition("=")
        out.append((name.strip(), url.strip().rstrip("/")))
    return out


def main(args: argparse.Namespace) -> dict[str, Any]:
    targets = _targets(args.targets)
    models = {name: _model_of(url) for name, url in targets}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for trace in args.traces.split(","):
        for r in range(args.rounds):
            seed = args.seed + 7919 * r
            offsets = arrivals(trace, args.duration, seed)
            order = targets if r % 2 == 0 else targets[::-1]
            for k, (name, url) in enumerate(order):
                # fresh sentences per target and round: nothing any server saw before
                texts = sentences(len(offsets), seed * 31 + k + 1)
                if args.warmup:
                    asyncio.run(run_trace(url, models[name], [0.0] * 16, sentences(16, seed + 99)))
                report = asyncio.run(run_trace(url, models[name], offsets, texts))
                results.setdefault(trace, {}).setdefault(name, []).append(report)
                print(
                    f"{trace:<11} round {r + 1} {name:<12} {report['throughput_rps']:7.1f} req/s  "
                    f"p50 {report['p50_ms']:8.1f}  p90 {report['p90_ms']:8.1f}  "
                    f"p99 {report['p99_ms']:8.1f} ms  errors {report['errors'] or 0}",
                    flush=True,
                )
    summary = {
        trace: {
            name: {
                key: statistics.median(r[key] for r in runs)
                for key in ("throughput_rps", "p50_ms", "p90_ms", "p99_ms")
            }
            for name, runs in by_name.items()
        }
        for trace, by_name in results.items()
    }
    print(f"\nmedian over {args.rounds} rounds")
    for trace, by_name in summary.items():
        for name, row in by_name.items():
            cells = "  ".join(f"{k} {v:8.1f}" for k, v in row.items())
            print(f"  {trace:<11} {name:<12} {cells}")
    out = {"targets": dict(targets), "models": models, "median": summary, "runs": results}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=2))
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--targets",
        required=True,
        help="NAME=BASE_URL,... where BASE_URL/embeddings is the endpoint (ours: http://HOST:PORT/v1)",
    )
    parser.add_argument(
        "--traces", default="bursty,steady:10,steady:50", help="bursty[:SCALE] and/or steady:RATE"
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of each steady trace")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", action="store_true", help="16 requests before each run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
