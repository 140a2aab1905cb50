"""GPU-only checks (marked ``gpu``; skipped without CUDA, run by ``bench/gpu_check.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swiftserve.bench.gpu_check import graph_vs_eager, parity

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_parity_with_transformers_on_the_gpu(llama_dir: Path) -> None:
    report = parity(llama_dir, "cuda", "triton")
    for entry in report["prompts"]:  # a divergence is only acceptable at a near-tie
        assert entry["equal"] or entry.get("hf_logit_margin", 1.0) < 1e-3, report


def test_graph_replay_equals_eager_bitwise(llama_dir: Path) -> None:
    assert graph_vs_eager(llama_dir)["bitwise_equal_logprobs"]


def test_engine_picks_the_gpu_by_default(llama_dir: Path) -> None:
    from swiftserve import LLM

    llm = LLM(str(llama_dir), progress=False)
    worker = llm.engine.executor.worker
    assert worker.device.type == "cuda" and worker.ops.name == "triton"
