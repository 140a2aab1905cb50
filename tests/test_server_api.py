"""The server through the official openai client: text equal to the offline LLM's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from server_utils import Server, running_server
from swiftserve import LLM, SamplingParams

API_KEY = "test-key"
MODEL = "tiny"
ENGINE_ARGS = ("--max-model-len", "256", "--served-model-name", MODEL, "--api-key", API_KEY)


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(llama_dir, *ENGINE_ARGS, log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), progress=False, max_model_len=256)


PROMPT = "def fibonacci(n):\n"


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_matches_offline(client: openai.OpenAI, offline: LLM) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.id.startswith("cmpl-") and resp.model == MODEL


def test_streaming_completion_equals_non_streamed(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    # Equal, U+FFFD included: a random model emits invalid byte sequences that decode() also
    # shows as U+FFFD; split valid characters are covered in test_detokenizer.py.
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


def test_chat_matches_offline_streamed_and_not(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Write a loop."}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ref.outputs[0].text


def test_n_choices_and_seed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=1.0,
        n=3,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs)  # type: ignore[call-overload]
    again = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 30


def test_multiple_prompts(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=["a = 1", "import os"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in resp.choices) == [0, 1]


def test_logprobs(client: openai.OpenAI, offline: LLM) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    expected = [ref.outputs[0].logprobs[i][t].logprob for i, t in enumerate(ref.outputs[0].token_ids)]  # type: ignore[index]
    assert lp is not None and lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    # A dict keyed by token text: distinct tokens with equal text (e.g. lone bytes) collapse.
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # type: ignore[union-attr]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_stop_strings(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = full[5:8]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_auth_required(server: Server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
