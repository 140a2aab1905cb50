"""``swiftserve eval perplexity``: the engine's perplexity equals transformers' on the same windows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swiftserve.cli import main
from swiftserve.tools.corpus import HELDOUT_MODULUS, is_heldout, split_files
from swiftserve.tools.evaluate import windows_of


def test_windows_cover_the_text_without_overlap() -> None:
    ids = list(range(10))
    assert windows_of(ids, 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows_of(ids, 4, 9) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail scores nothing


def test_heldout_split_is_fixed_and_disjoint() -> None:
    train, heldout = split_files()
    assert heldout and len(train) > 10 * len(heldout)
    assert not set(train) & set(heldout)
    assert all(is_heldout(p.name) in (True, False) for p in heldout[:3])
    assert HELDOUT_MODULUS == 20  # changing the rule changes the published perplexities


def run_eval(model: Path, out: Path, *flags: str) -> dict[str, Any]:
    """``swiftserve eval perplexity`` through the CLI; returns its JSON report."""
    argv = ["eval", "perplexity", "--model", str(model), "--output-json", str(out), "--quiet", *flags]
    assert main(argv) == 0
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_perplexity_matches_transformers(llama_dir: Path, tmp_path: Path, dtype: str) -> None:
    flags = ("--dtype", dtype, "--context-len", "128", "--max-eval-tokens", "1500", "--reference", "hf")
    report = run_eval(llama_dir, tmp_path / "ppl.json", *flags)
    assert report["tokens"] == 1500 - 12  # 12 windows (the last one shorter), first token of each unscored
    assert report["perplexity"] > 1
    tolerance = 1e-5 if dtype == "float32" else 5e-3  # the issue asks for 0.5%
    assert abs(report["relative_difference"]) < tolerance


def test_quantized_perplexity_is_reported(llama_dir: Path, tmp_path: Path) -> None:
    flags = ("--dtype", "float32", "--quantization", "int4", "--quant-group-size", "32")
    report = run_eval(llama_dir, tmp_path / "ppl.json", *flags, "--max-eval-tokens", "600")
    assert report["quantization"] == "int4" and report["quant_group_size"] == 32
    assert report["tokens"] > 500 and report["weight_bytes"] > 0
