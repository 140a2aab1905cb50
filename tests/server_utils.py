"""Test helpers: the server launcher lives in swiftserve.bench.launch (benchmarks use it too)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from swiftserve import LLM, SamplingParams
from swiftserve.bench.launch import Server, free_port, running_server

__all__ = ["Server", "free_port", "greedy_texts_match_offline", "leave_stream_early", "running_server"]


def greedy_texts_match_offline(model_dir: Path, client: openai.OpenAI, prompts: list[str]) -> list[str]:
    """Assert a batched greedy completion through the server equals the offline engine's text
    (12 tokens, ignore_eos); returns the offline texts."""
    reference = LLM(model=str(model_dir), max_model_len=256).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    got = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=prompts,
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    texts = {c.index: c.text for c in got.choices}
    want = [r.outputs[0].text for r in reference]
    assert [texts[i] for i in range(len(prompts))] == want
    return want


def leave_stream_early(server: Server) -> None:
    """Start a long streamed completion and leave after a few chunks: the server must abort it."""
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 3:
                break  # leave mid-stream: the server aborts the request
