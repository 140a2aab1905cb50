"""Schemathesis against the server's own OpenAPI schema, positive and negative: no 5xx,
negative data rejected with 4xx, and the server alive afterwards."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server_utils import running_server


def test_schemathesis_no_server_errors(llama_dir: Path, tmp_path: Path) -> None:
    st = shutil.which("st") or str(Path(sys.executable).with_name("st"))
    if not Path(st).exists():
        pytest.skip("schemathesis is not installed")
    with running_server(
        llama_dir, "--max-model-len", "96", "--max-num-seqs", "8", log_dir=tmp_path
    ) as server:
        proc = subprocess.run(
            [
                st,
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "not_a_server_error,negative_data_rejection",
                "--mode",
                "all",
                "--max-examples",
                "20",
                "--request-timeout",
                "30",
                "--seed",
                "1",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
        assert "passed" in proc.stdout
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert server.proc.poll() is None
