"""The command line: generate on a checkpoint, bench throughput smoke run, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiftserve.cli import main


def test_generate(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(llama_dir), "--prompt", "def f():", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "finish_reason: length, tokens: 5" in out


def test_bench_throughput_both_backends(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "throughput",
        "--model",
        str(llama_dir),
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--backend",
        "swiftserve,hf",
        "--hf-batch-size",
        "2",
        "--rounds",
        "2",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert [r["backend"] for r in report["runs"]] == ["swiftserve", "hf", "swiftserve", "hf"]  # alternated
    for run in report["runs"]:
        assert run["output_tokens"] == 16 and run["output_tokens_per_s"] > 0
        assert {"num_prompts", "elapsed_s", "total_tokens_per_s"} <= set(run)
    assert len(report["ratios_per_round"]) == 2
    assert report["ratio_output_tokens_per_s"] == pytest.approx(sum(report["ratios_per_round"]) / 2)


def test_user_errors_are_one_line(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--model", str(llama_dir), "--prompt", "x", "--temperature", "-1"])
    assert code == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--model", "/nonexistent/dir", "--prompt", "x"]) == 2


def test_bench_batcher_smoke(tmp_path: Path) -> None:
    out = tmp_path / "batcher.json"
    args = [
        "bench",
        "batcher",
        "--workload",
        "cost",
        "--duration-scale",
        "0.05",
        "--fixed-windows",
        "0,5",
        "--target-p99-ms",
        "20,50",
        "--rounds",
        "2",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["rounds"] == 2
    assert set(report["results"]) == {
        "fixed 0 ms",
        "fixed 5 ms",
        "adaptive (target 20)",
        "adaptive (target 50)",
    }
    for r in report["results"].values():
        assert r["batches"] >= 1 and r["p99_ms"] >= r["p50_ms"] >= 0
        assert len(r["rounds_p99_ms"]) == len(r["rounds_batches"]) == 2
        assert min(r["rounds_p99_ms"]) <= r["p99_ms"] <= max(r["rounds_p99_ms"])
    assert [v["target_p99_ms"] for v in report["verdicts"]] == [20.0, 50.0]
    for v in report["verdicts"]:
        meeting = [
            n for n in ("fixed 0 ms", "fixed 5 ms") if report["results"][n]["p99_ms"] <= v["target_p99_ms"]
        ]
        assert v["fixed_meeting_target"] == sorted(meeting)


def test_bench_reliability_help() -> None:
    """The reliability benchmark is wired into the CLI (it starts servers; run on demand)."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "reliability", "--help"])
    assert info.value.code == 0


def test_bench_quant_smoke(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "quant.json"
    argv = ["bench", "quant", "--model", str(llama_dir), "--variants", "bfloat16,int8,int4-g32",
            "--input-len", "8", "--output-len", "4", "--batch-size", "2", "--repeats", "1",
            "--batch-rounds", "1", "--perplexity-tokens", "300", "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["int8"]["weight_bytes"] < rows["bfloat16"]["weight_bytes"]
    assert rows["int4-g32"]["weight_bytes"] < rows["int8"]["weight_bytes"]
    for row in rows.values():
        assert row["perplexity"] > 1 and row["tpot_ms"] > 0 and row["batch_output_tokens_per_s"] > 0


def test_bench_batcher_median_over_rounds() -> None:
    from swiftserve.bench.batching import median_result

    runs = [
        {"p50_ms": 10.0, "p99_ms": 90.0, "throughput_rps": 30.0, "batches": 140, "mean_batch_size": 4.8},
        {"p50_ms": 12.0, "p99_ms": 300.0, "throughput_rps": 29.0, "batches": 150, "mean_batch_size": 4.5},
        {"p50_ms": 11.0, "p99_ms": 95.0, "throughput_rps": 31.0, "batches": 141, "mean_batch_size": 4.8},
    ]
    med = median_result(runs)  # one stalled round does not decide the verdict
    assert med["p99_ms"] == 95.0 and med["batches"] == 141 and med["p50_ms"] == 11.0
    assert med["rounds_p99_ms"] == [90.0, 300.0, 95.0]
    assert "rounds_p99_ms" not in median_result(runs[:1])
    with pytest.raises(SystemExit):  # zero rounds would have nothing to take a median of
        main(["bench", "batcher", "--rounds", "0"])
