"""Bad input over raw HTTP: 400 (never 422) with an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server_utils import Server, running_server

KEY = "secret"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = (
        "--max-model-len",
        "128",
        "--api-key",
        KEY,
        "--max-body-bytes",
        "200000",
        "--max-stop-strings",
        "4",
        "--max-stop-length",
        "20",
        "--served-model-name",
        "tiny",
    )
    with running_server(llama_dir, *args, log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv


def post(
    server: Server, path: str, content: bytes | str, headers: dict[str, str] | None = None
) -> httpx.Response:
    hdrs = {"Content-Type": "application/json", **HEADERS, **(headers or {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=hdrs, timeout=30)


def assert_error(
    resp: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body


def assert_still_serving(server: Server) -> None:
    resp = post(server, "/v1/completions", '{"prompt": "ok", "max_tokens": 2}')
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


BAD_COMPLETIONS = {
    "json-array": ("[1, 2, 3]", None),
    "broken-json": ('{"prompt": "x",', None),
    "nan-literal": ('{"prompt": "x", "temperature": NaN}', "temperature"),
    "infinity-literal": ('{"prompt": "x", "top_p": Infinity}', "top_p"),
    "wrong-type": ('{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
    "empty-prompt": ('{"prompt": ""}', "prompt"),
    "empty-prompt-list": ('{"prompt": []}', "prompt"),
    "token-out-of-range": ('{"prompt": [1, 2, 99999999]}', "prompt"),
    "max-tokens-zero": ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    "negative-temperature": ('{"prompt": "x", "temperature": -1}', "temperature"),
    "top-p-zero": ('{"prompt": "x", "top_p": 0}', "top_p"),
    "top-k-zero": ('{"prompt": "x", "top_k": 0}', "top_k"),
    "top-k-below-minus-one": ('{"prompt": "x", "top_k": -5}', "top_k"),
    "logprobs-too-many": ('{"prompt": "x", "logprobs": 21}', "logprobs"),
    "too-many-stops": ('{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    "stop-too-long": ('{"prompt": "x", "stop": ["' + "y" * 50 + '"]}', "stop"),
    "unknown-field": ('{"prompt": "x", "frobnicate": 1}', "frobnicate"),
    "n-too-large": ('{"prompt": "x", "n": 17}', "n"),
    "negative-timeout": ('{"prompt": "x", "timeout": -1}', "timeout"),
}


@pytest.mark.parametrize("case", list(BAD_COMPLETIONS))
def test_bad_completion_requests(server: Server, case: str) -> None:
    content, param = BAD_COMPLETIONS[case]
    assert_error(post(server, "/v1/completions", content), 400, param)
    assert_still_serving(server)


def test_n_one_million_rejected_fast(server: Server) -> None:
    resp = post(server, "/v1/completions", '{"prompt": "x", "n": 1000000}')
    assert_error(resp, 400, "n")  # refused before any fan-out (rejection latency: bench reliability)
    assert_still_serving(server)


def test_context_length_exceeded(server: Server) -> None:
    resp = post(server, "/v1/completions", '{"prompt": "hello", "max_tokens": 500}')
    body = assert_error(resp, 400, "max_tokens", "context_length_exceeded")
    assert body["error"]["message"].startswith(
        "This model's maximum context length is 128 tokens. However, you requested"
    )
    assert_still_serving(server)


def test_bad_chat_requests(server: Server) -> None:
    assert_error(post(server, "/v1/chat/completions", '{"messages": []}'), 400, "messages")
    assert_error(
        post(server, "/v1/chat/completions", '{"messages": [{"role": "robot", "content": "x"}]}'),
        400,
    )
    assert_error(
        post(
            server,
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}',
        ),
        400,
        "top_logprobs",
    )
    assert_still_serving(server)


def test_unknown_model_is_404(server: Server) -> None:
    assert_error(
        post(server, "/v1/completions", '{"prompt": "x", "model": "gpt-9"}'),
        404,
        "model",
        "model_not_found",
    )


def test_auth(server: Server) -> None:
    assert_error(post(server, "/v1/completions", '{"prompt": "x"}', {"Authorization": "Bearer nope"}), 401)
    resp = httpx.post(f"{server.url}/v1/completions", content='{"prompt": "x"}')
    assert_error(resp, 401)
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
    assert httpx.get(f"{server.url}/metrics", headers=HEADERS).status_code == 200


def test_body_too_large(server: Server) -> None:
    big = '{"prompt": "' + "x" * 300_000 + '"}'
    assert_error(post(server, "/v1/completions", big), 413)
    assert_still_serving(server)


def test_deadline_is_a_distinct_error(server: Server) -> None:
    resp = post(
        server,
        "/v1/completions",
        '{"prompt": "x", "max_tokens": 100, "ignore_eos": true, "timeout": 0.001}',
    )
    assert_error(resp, 408, "timeout", "deadline_exceeded")
    assert_still_serving(server)
    deadline = time.monotonic() + 10
    while server.metrics(HEADERS).get("swiftserve:num_requests_running", 1) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_metrics_names(server: Server) -> None:
    names = set(server.metrics(HEADERS))
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
    ):
        assert f"swiftserve:{name}" in names, name
    assert any(n.startswith("swiftserve:time_to_first_token_seconds") for n in names)
    assert any(n.startswith('swiftserve:request_success_total{finished_reason="length"}') for n in names)


def _raw(server: Server, payload: bytes) -> bytes:
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    data = b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(payload)
            while chunk := sock.recv(4096):
                data += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may close before reading everything; its reply is already in `data`
    return data


def test_oversized_headers_get_431(server: Server) -> None:
    # No terminating blank line: h11 limits the *incomplete* header block (64 KiB by default).
    reply = _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431")
    assert set(__import__("json").loads(body)["error"]) == {"message", "type", "param", "code"}
    assert_still_serving(server)


def test_malformed_http_gets_json_400(server: Server) -> None:
    reply = _raw(server, b"NOT HTTP AT ALL\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b'"error"' in body
    assert_still_serving(server)
