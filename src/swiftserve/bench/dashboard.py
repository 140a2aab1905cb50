"""``swiftserve bench dashboard``: does an open dashboard slow serving?

The same ``bench serve`` load (fresh prompts every run) runs with nobody watching and with
the dashboard open, alternating the order every round so drift on a shared machine cancels.
Two kinds of watcher, because they answer different questions:

- ``http``: a client that polls ``/v1/stats`` once a second exactly as the page does: the
  server's own cost of being watched;
- ``browser``: the real page in headless Chromium (Debian's, driven by Playwright) on the
  same machine: the server's cost plus the browser's rendering competing for the same cores,
  the worst case (a user's browser normally runs elsewhere).

Reports TTFT and TPOT (p50/p99) per mode, the median over rounds, and open/closed ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from swiftserve.bench import serve as serve_bench

_METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"))
_BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextlib.asynccontextmanager
async def http_watcher(base_url: str, api_key: str | None) -> AsyncIterator[dict[str, int]]:
    """Poll /v1/stats once a second with ``since`` paging, as the page does."""
    counts = {"samples": 0}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def loop(client: httpx.AsyncClient) -> None:
        since = 0
        while True:
            reply = (await client.get(f"/v1/stats?since={since}")).json()
            since = reply["last_seq"]
            counts["samples"] += len(reply["samples"])
            await asyncio.sleep(1.0)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as client:
        task = asyncio.create_task(loop(client))
        try:
            yield counts
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.asynccontextmanager
async def browser_watcher(base_url: str, api_key: str | None, chromium: str) -> AsyncIterator[dict[str, int]]:
    """The real dashboard in headless Chromium, polling and drawing for the whole run
    (its sample count is what the page holds: the server's history plus what it polled)."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=_BROWSER_ARGS)
        page = await browser.new_page(viewport={"width": 1360, "height": 900})
        if api_key:
            await page.add_init_script(f"localStorage.setItem('swiftserve.apiKey', {json.dumps(api_key)})")
        await page.goto(f"{base_url}/#dashboard")
        await page.wait_for_function("() => document.getElementById('chart-queue').dataset.samples")
        counts = {"samples": 0}
        try:
            yield counts
        finally:
            counts["samples"] = int(await page.get_attribute("#chart-queue", "data-samples") or 0)
            await browser.close()


async def _one_run(args: argparse.Namespace, mode: str, seed: int) -> dict[str, Any]:
    run_args = argparse.Namespace(**{**vars(args), "bench_seed": seed})
    reqs = serve_bench.build_requests(run_args)
    rate = float(args.request_rate)
    if mode == "closed":
        watcher: Any = contextlib.nullcontext({"samples": 0})
    elif args.watcher == "browser":
        watcher = browser_watcher(args.base_url, args.api_key, args.chromium)
    else:
        watcher = http_watcher(args.base_url, args.api_key)
    async with watcher as counts:
        report = await serve_bench.run_rate(run_args, reqs, rate, lambda: None)
    report.pop("_results", None)
    report["mode"], report["samples_seen"] = mode, counts["samples"]
    return report


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.watcher == "browser" and not shutil.which(args.chromium):
        raise SystemExit(f"no Chromium at {args.chromium} (make browser installs Debian's package)")
    runs: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = ("closed", "open") if i % 2 == 0 else ("open", "closed")
        for j, mode in enumerate(order):
            report = asyncio.run(_one_run(args, mode, args.bench_seed + 1000 * (2 * i + j)))
            runs.append(report)
            cells = ", ".join(f"{m} {q} {report[m][q]:.1f}" for m, q in _METRICS)
            print(
                f"round {i + 1} {mode:>6}: {cells} ms; failed {report['failed']}, "
                f"samples seen {report['samples_seen']}"
            )
    summary = {
        mode: {f"{m}_{q}": statistics.median(r[m][q] for r in runs if r["mode"] == mode) for m, q in _METRICS}
        for mode in ("closed", "open")
    }
    ratios = {k: summary["open"][k] / summary["closed"][k] for k in summary["closed"] if summary["closed"][k]}
    print(f"\nmedian over {args.rounds} rounds (watcher: {args.watcher})")
    for key in summary["closed"]:
        print(
            f"  {key:<12} closed {summary['closed'][key]:8.2f} ms   open {summary['open'][key]:8.2f} ms"
            f"   open/closed {ratios.get(key, float('nan')):.3f}"
        )
    result = {
        "watcher": args.watcher,
        "rounds": args.rounds,
        "median": summary,
        "ratio": ratios,
        "runs": runs,
    }
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


def add_args(parser: argparse.ArgumentParser) -> None:
    serve_bench.add_args(parser)
    parser.add_argument("--rounds", type=int, default=3, help="closed/open pairs, order alternating")
    parser.add_argument("--watcher", choices=("http", "browser"), default="http")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
