"""The device check's CPU version (``--smoke``) runs end to end, so the script cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

from swiftserve.bench.gpu_check import main


def test_gpu_check_smoke_writes_results(tmp_path: Path) -> None:
    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["parity_cpu"]["ok"] and results["parity_cpu"]["result"]["all_equal"]
    assert results["parity_cpu_async"]["result"]["all_equal"]
    speed = results["speed_tiny_cpu"]["result"]
    assert speed["batch1"]["tpot_ms_median"] > 0 and speed["batch4"]["output_tokens_per_s"] > 0
    overlapped = results["speed_tiny_cpu_async"]["result"]
    assert overlapped["batch4"]["output_tokens_per_s"] > 0 and overlapped["step_wakeup_us_p50"] > 0
