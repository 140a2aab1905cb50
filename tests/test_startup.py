"""Cold start: what the fast start-up relies on, and ``bench startup`` end to end."""

from __future__ import annotations

import argparse
import logging
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swiftserve import LLM, SamplingParams
from swiftserve.bench import startup as bench_startup
from swiftserve.engine.core_client import _start_method
from swiftserve.startup import Timeline, process_start_epoch
from swiftserve.worker.kv_memory import allocate_kv_caches


def test_kv_pool_is_zero_without_touching_its_memory() -> None:
    """The CPU pool is all zeros (padded gathers read unused slots) and costs no RSS up front."""
    shape = (4, 2048, 16, 64)  # 16 MiB per tensor in bfloat16; 32 layers x K,V = 1 GiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    kv = allocate_kv_caches(32, shape, torch.bfloat16, torch.device("cpu"))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 64, f"allocating the pool touched {grown_mib:.0f} MiB"
    assert len(kv) == 32 and all(k.shape == shape and v.shape == shape for k, v in kv)
    assert all(t.is_contiguous() for pair in kv for t in pair)
    for layer in (0, 17, 31):  # reading touches only these
        assert not kv[layer][0].any() and not kv[layer][1].any()
    kv[3][1][0, 5].fill_(1.0)  # layers are disjoint views
    assert kv[3][1][0, 5].all() and not kv[3][0].any() and not kv[4][0].any()


def test_prebuilt_kernel_folder_is_torchs() -> None:
    from torch.utils.cpp_extension import _get_build_directory

    from swiftserve.model.kernels import _build_dir, build_name

    name = build_name()
    assert str(_build_dir(name)) == _get_build_directory(name, verbose=False)


def test_fork_only_from_a_bare_interpreter() -> None:
    assert _start_method() == "spawn"  # this test process has torch loaded
    code = "from swiftserve.engine.core_client import _start_method as s; print(s())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    assert out == ("fork" if sys.platform == "linux" else "spawn")


def test_timeline_logs_phases(caplog: pytest.LogCaptureFixture) -> None:
    # /proc/uptime and the start time in clock ticks both have 10 ms resolution
    assert process_start_epoch() <= Timeline("x").anchor + 0.025
    timeline = Timeline("unit", anchor=0.0)
    with caplog.at_level(logging.INFO, logger="swiftserve.startup"), timeline.phase("step one"):
        pass
    timeline.mark("ready")
    names = [p[0] for p in timeline.phases]
    assert names == ["step one", "ready"]
    assert any("startup[unit]: step one" in r.message for r in caplog.records)
    parsed = bench_startup.phases("\n".join(r.getMessage() for r in caplog.records))
    assert parsed and parsed[0]["process"] == "unit" and parsed[0]["phase"] == "step one"


def test_llm_records_its_startup_and_generates(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=128, progress=False)
    names = [p[0] for p in llm.startup.phases]
    for phase in ("tokenizer", "kernels", "load weights", "KV cache", "ready"):
        assert phase in names
    out = llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_bench_startup_end_to_end(llama_dir: Path, tmp_path: Path) -> None:
    args = argparse.Namespace(
        model=str(llama_dir),
        dtype="float32",
        runs=1,
        targets="serve,llm",
        serve_args="--max-model-len 128",
        pythonpath=None,
        output_json=str(tmp_path / "startup.json"),
    )
    report = bench_startup.run(args)
    serve = report["serve"]["median"]
    assert 0 < serve["to_healthy_s"] <= serve["to_first_token_s"]
    seen = {(p["process"], p["phase"]) for p in report["serve"]["median_run_phases"]}
    for key in (("server", "spawn engine"), ("engine", "import torch"), ("engine", "load weights")):
        assert key in seen
    assert ("server", "listening") in seen
    llm = report["llm"]["median"]
    assert 0 < llm["llm_init_s"] < llm["to_first_token_s"]
    assert (tmp_path / "startup.json").is_file()
    with pytest.raises(ValueError, match="targets"):
        bench_startup.run(argparse.Namespace(**{**vars(args), "targets": "gpu"}))
