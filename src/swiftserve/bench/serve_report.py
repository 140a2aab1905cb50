"""Tables and plots for ``bench serve`` results."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def print_table(reports: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "rate",
        "class",
        "done",
        "fail",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p99",
        "E2EL p99",
        "goodput",
    ):
        table.add_column(col, justify="right")
    for rep in reports:
        rows = (
            [("all", rep)] + [(k, v) for k, v in rep["by_priority"].items()]
            if len(rep["by_priority"]) > 1
            else [("all", rep)]
        )
        for name, r in rows:
            table.add_row(
                f"{rep['request_rate']:g}",
                name,
                str(r["completed"]),
                str(r["failed"]),
                f"{r['request_throughput']:.2f}",
                f"{r['output_token_throughput']:.0f}",
                f"{r['ttft_ms']['p50']:.0f}",
                f"{r['ttft_ms']['p99']:.0f}",
                f"{r['tpot_ms']['p50']:.1f}",
                f"{r['tpot_ms']['p99']:.1f}",
                f"{r['itl_ms']['p99']:.1f}",
                f"{r['e2el_ms']['p99']:.0f}",
                f"{r['goodput']:.2f}" if "goodput" in r else "-",
            )
    console = Console()
    console.print(table)
    for rep in reports:
        d = rep.get("deadlines", {})
        parts = []
        if d.get("timed_requests"):
            parts.append(f"with a timeout: {d['timed_ok']}/{d['timed_requests']} succeeded")
        if "wasted_share" in d:
            parts.append(
                f"compute on requests that failed their deadline: {d['wasted_tokens']:.0f} of "
                f"{d['computed_tokens']:.0f} tokens ({100 * d['wasted_share']:.1f}%)"
            )
        if parts:
            console.print(f"rate {rep['request_rate']:g}: " + "; ".join(parts))


def save_plots(reports: list[dict[str, Any]], out_dir: str) -> list[Path]:
    """Latency CDFs per rate, and p50/p99 TTFT and TPOT against rate (per class)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for rep in reports:
        done = [r for r in rep["_results"] if r.ok]
        for ax, key in zip(axes, ("ttft", "e2el"), strict=True):
            values = np.sort([getattr(r, key) * 1000 for r in done])
            if len(values):
                ax.plot(
                    values,
                    np.arange(1, len(values) + 1) / len(values),
                    label=f"{rep['request_rate']:g} req/s",
                )
    for ax, name in zip(axes, ("TTFT (ms)", "E2E latency (ms)"), strict=True):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    files.append(out / "latency_cdf.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    if len(reports) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        rates = [r["request_rate"] for r in reports]
        classes = sorted({k for r in reports for k in r["by_priority"]}, key=int)
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms"), strict=True):
            for cls in classes:
                for q, style in (("p50", "--"), ("p99", "-")):
                    ys = [r["by_priority"].get(cls, {}).get(key, {}).get(q, np.nan) for r in reports]
                    ax.plot(rates, ys, style, marker="o", label=f"priority {cls} {q}")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(key.replace("_ms", " (ms)").upper())
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(out / "latency_vs_rate.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files
