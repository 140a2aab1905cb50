"""Smoke runs of the serving benchmark (against our own server) and the latency benchmark."""

from __future__ import annotations

import json
from pathlib import Path

from server_utils import running_server
from swiftserve.cli import main


def test_bench_serve_smoke(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    with running_server(
        llama_dir, "--max-model-len", "256", "--scheduling-policy", "priority", log_dir=tmp_path
    ) as server:
        args = [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--num-prompts",
            "12",
            "--input-len",
            "8-24",
            "--output-len",
            "6",
            "--request-rate",
            "50,inf",
            "--priority-mix",
            "0.25:0,0.75:3",
            "--slo",
            "ttft:5000,tpot:1000",
            "--vocab-size",
            "500",
            "--output-json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        ]
        assert main(args) == 0
    report = json.loads(out.read_text())
    assert [r["request_rate"] for r in report["sweep"]] == [50.0, float("inf")]
    for rep in report["sweep"]:
        assert rep["completed"] == 12 and rep["failed"] == 0
        assert set(rep["by_priority"]) <= {"0", "3"}
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(rep[key]) == {"mean", "p50", "p90", "p99"}
        assert rep["ttft_ms"]["p99"] >= rep["ttft_ms"]["p50"] > 0
        assert rep["goodput"] > 0 and rep["output_token_throughput"] > 0
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "plots" / "latency_vs_rate.png").stat().st_size > 0


def test_bench_latency_smoke(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    args = [
        "bench",
        "latency",
        "--model",
        str(llama_dir),
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--repeats",
        "2",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["tpot_ms"]["mean"] > 0 and report["ttft_ms"]["p50"] > 0


def test_length_mixes_and_timeout_mix() -> None:
    from swiftserve.bench.datasets import assign_timeouts, random_dataset

    reqs = random_dataset(400, "64:0.75,1024:0.25", "8", 1000, seed=0)
    lengths = [r.prompt_len for r in reqs]
    assert set(lengths) == {64, 1024} and 0.6 < lengths.count(64) / len(lengths) < 0.9
    timed = assign_timeouts(reqs, "0.2:3", seed=0)
    share = sum(r.timeout == 3.0 for r in timed) / len(timed)
    assert 0.1 < share < 0.3 and all(r.timeout in (None, 3.0) for r in timed)
    assert assign_timeouts(reqs, None, seed=0) is reqs
