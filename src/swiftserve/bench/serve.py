"""``swiftserve bench serve``: an asyncio load generator for any OpenAI-compatible server.

Streams every request (``/v1/completions``, ``ignore_eos``, exact output lengths) to time
each token: TTFT, TPOT, ITL and end-to-end latency, per priority class, over one request
rate or a sweep. Arrivals are Poisson (or gamma with ``--burstiness``), seeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

from swiftserve.bench.datasets import (
    BenchRequest,
    assign_priorities,
    assign_timeouts,
    jsonl_dataset,
    parse_priority_mix,
    random_dataset,
    shared_prefix,
    synthetic_chat,
)
from swiftserve.bench.stats import RequestResult, parse_slo, summarize


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    n, seed, vocab = args.num_prompts, args.bench_seed, args.vocab_size
    if args.dataset == "random":
        reqs = random_dataset(n, args.input_len, args.output_len, vocab, seed)
    elif args.dataset == "synthetic-chat":
        reqs = synthetic_chat(n, args.mean_input_len, args.mean_output_len, vocab, seed)
    elif args.dataset == "shared-prefix":
        reqs = shared_prefix(
            n, args.groups, args.prefix_len, args.suffix_len, int(args.output_len), vocab, seed
        )
    else:
        reqs = jsonl_dataset(args.dataset_path, n, int(args.output_len))
    reqs = assign_priorities(reqs, parse_priority_mix(args.priority_mix), seed)
    return assign_timeouts(reqs, args.timeout_mix, seed)


def intervals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between arrivals: gamma(shape=burstiness) with mean 1/rate (Poisson at 1.0)."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def one_request(
    client: httpx.AsyncClient, args: argparse.Namespace, req: BenchRequest
) -> RequestResult:
    body: dict[str, Any] = {
        "model": args.model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.priority_mix:
        body["priority"] = req.priority
    if req.timeout is not None:
        body["timeout"] = req.timeout
    result = RequestResult(
        priority=req.priority, ok=False, status=0, prompt_tokens=req.prompt_len, timed=req.timeout is not None
    )
    start = time.perf_counter()
    result.start = start
    last: float | None = None
    finished = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.status = 599
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                # A chunk that carries a choice is a token, even if its text is empty (e.g. a
                # byte that only completes a character in the next token).
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except httpx.HTTPError:
        result.status = 0
        return result
    result.e2el = time.perf_counter() - start
    result.ok = finished and last is not None
    return result


async def run_rate(
    args: argparse.Namespace, reqs: list[BenchRequest], rate: float, progress: Any
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=args.timeout, limits=limits, headers=headers
    ) as client:

        async def guarded(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await one_request(client, args, req)
            else:
                async with sem:
                    res = await one_request(client, args, req)
            progress()
            return res

        before = await _server_counters(client)
        tasks = []
        start = time.perf_counter()
        for req, gap in zip(reqs, intervals(len(reqs), rate, args.burstiness, args.bench_seed), strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(guarded(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await _server_counters(client)
    slo = parse_slo(args.slo)
    report = {"request_rate": rate, "duration_s": duration, **summarize(results, duration, slo)}
    report["deadlines"] = _deadline_report(results, before, after)
    classes = sorted({r.priority for r in results})
    report["by_priority"] = {
        str(p): summarize([r for r in results if r.priority == p], duration, slo) for p in classes
    }
    report["_results"] = results
    return report


_COUNTERS = ("swiftserve:computed_tokens_total", "swiftserve:deadline_wasted_tokens_total")


async def _server_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """swiftserve's compute counters from /metrics (empty for servers that have none)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _COUNTERS:
            out[name] = float(value)
    return out


def _deadline_report(
    results: list[RequestResult], before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    """Share of requests with a timeout that succeeded, and compute spent on failed ones."""
    timed = [r for r in results if r.timed]
    report: dict[str, Any] = {"timed_requests": len(timed)}
    if timed:
        report["timed_ok"] = sum(r.ok for r in timed)
        report["timed_ok_share"] = report["timed_ok"] / len(timed)
    if all(name in after and name in before for name in _COUNTERS):
        computed = after[_COUNTERS[0]] - before[_COUNTERS[0]]
        wasted = after[_COUNTERS[1]] - before[_COUNTERS[1]]
        report["computed_tokens"], report["wasted_tokens"] = computed, wasted
        report["wasted_share"] = wasted / computed if computed else 0.0
    return report


def main(args: argparse.Namespace) -> dict[str, Any]:
    from rich.progress import Progress

    from swiftserve.bench.serve_report import print_table, save_plots

    rates = [float(x) for x in str(args.request_rate).split(",")]
    reports = []
    with Progress() as progress:
        for i, rate in enumerate(rates):
            # Distinct prompts per rate: a sweep must not find the previous rate's prompts cached.
            reqs = build_requests(
                argparse.Namespace(**{**vars(args), "bench_seed": args.bench_seed + 1000 * i})
            )
            task = progress.add_task(f"rate {rate:g} req/s", total=len(reqs))
            reports.append(asyncio.run(run_rate(args, reqs, rate, lambda t=task: progress.advance(t))))
    print_table(
        reports,
        f"bench serve: {args.dataset}, {args.num_prompts} fresh requests per rate, {args.base_url}",
    )
    if args.plot:
        for file in save_plots(reports, args.plot):
            print(f"saved {file}")
    clean = [{k: v for k, v in r.items() if k != "_results"} for r in reports]
    result: dict[str, Any] = clean[0] if len(clean) == 1 else {"sweep": clean}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name sent in requests")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--dataset", choices=("random", "synthetic-chat", "shared-prefix", "jsonl"), default="random"
    )
    parser.add_argument("--dataset-path", default=None, help="JSONL file for --dataset jsonl")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--input-len", default="128", help="N, LO-HI, or a mix N:W,N:W (e.g. 64:0.8,1024:0.2)"
    )
    parser.add_argument("--output-len", default="128", help="N or LO-HI")
    parser.add_argument("--mean-input-len", type=float, default=200)
    parser.add_argument("--mean-output-len", type=float, default=100)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=8000, help="token ids are drawn below this")
    parser.add_argument("--request-rate", default="inf", help="req/s, 'inf', or a sweep '1,2,4,8'")
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--priority-mix", default=None, help="fraction:priority,... e.g. 0.2:0,0.8:5")
    parser.add_argument(
        "--timeout-mix", default=None, help="FRACTION:SECONDS, e.g. 0.2:3 (that share carries a timeout)"
    )
    parser.add_argument("--slo", default=None, help="e.g. ttft:500,tpot:50 (ms) for goodput")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--bench-seed", "--seed", dest="bench_seed", type=int, default=0, help="(vLLM's name: --seed)"
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, help="directory for PNG plots")
