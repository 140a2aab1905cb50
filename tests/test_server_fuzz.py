"""Schemathesis against the server's own OpenAPI schema, positive and negative: no 5xx,
negative data rejected with 4xx, and the server alive afterwards."""

from __future__ import annotations

import json
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


# ---- hypothesis: the hostile values schemathesis does not try ----------------------------------
FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
                        "stop_token_ids", "priority", "logprobs", "min_tokens", "stream", "timeout",
                        "repetition_penalty", "echo", "stream_options"],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_k",
                             "n", "seed", "stop", "logprobs", "top_logprobs", "priority", "stream"],
    "/v1/embeddings": ["input", "model", "encoding_format", "priority"],
}  # fmt: skip


def _hostile_values():  # type: ignore[no-untyped-def]
    from hypothesis import strategies as st

    huge = st.one_of(
        st.integers(min_value=2**63 - 2, max_value=2**200),
        st.integers(min_value=-(2**200), max_value=-(2**31)),
    )
    special = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -0.0])
    surrogate = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udc00"])  # lone and paired halves
    scalar = st.one_of(huge, special, surrogate, st.integers(-5, 50), st.floats(-3, 3), st.text(max_size=20),
                       st.booleans(), st.none())  # fmt: skip
    oversized = st.sampled_from([[1] * 5000, ["a"] * 2000, [[1, 2]] * 1000])
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bogus"]), "content": scalar})
    return st.one_of(scalar, oversized, st.lists(scalar, max_size=4), st.lists(message, max_size=3))


def _dumps(body: dict) -> str:
    """JSON as an attacker writes it: NaN/Infinity literals and lone surrogates escaped."""
    return json.dumps(body, allow_nan=True, ensure_ascii=True)


def test_hypothesis_hostile_values_never_5xx(llama_dir: Path, tmp_path: Path) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    with running_server(
        llama_dir, "--max-model-len", "64", "--max-num-seqs", "4", log_dir=tmp_path
    ) as server:
        statuses: list[int] = []

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(
            path=st.sampled_from([*FIELDS, "/health", "/v1/models", "/metrics", "/version", "/nope"]),
            data=st.data(),
        )
        def check(path: str, data) -> None:  # type: ignore[no-untyped-def]
            names = FIELDS.get(path, ["x"])
            body = data.draw(st.dictionaries(st.sampled_from(names), _hostile_values(), max_size=5))
            if path not in FIELDS and path != "/nope":  # the read-only routes
                resp = httpx.get(f"{server.url}{path}", timeout=60)
                statuses.append(resp.status_code)
                assert resp.status_code == 200
                return
            body.setdefault("max_tokens", 2) if path in ("/v1/completions",) else None
            resp = httpx.post(
                f"{server.url}{path}",
                content=_dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=60,
            )
            statuses.append(resp.status_code)
            assert resp.status_code < 500, (path, body, resp.text[:500])
            if resp.status_code >= 400:
                assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

        check()
        assert any(s == 400 for s in statuses) and any(s == 200 for s in statuses)
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert server.proc.poll() is None
