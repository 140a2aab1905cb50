"""The built-in demo model is the trained one: far below chance perplexity on held-out stdlib
files, and `make serve` (serve without --model) answers with Python-like text."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import openai
from safetensors import safe_open

from server_utils import running_server
from swiftserve import LLM
from swiftserve.engine.generation_config import default_sampling
from swiftserve.engine.model_source import demo_model_dir
from swiftserve.tools.evaluate import engine_nll, load_text, windows_of

PY_MARKERS = ("def ", "return", "self", "import ", "if ", " = ", "(", ":\n", "    ")


def python_like(text: str) -> bool:
    """Mostly printable characters and several marks of Python source."""
    printable = sum(c.isprintable() or c in "\n\t" for c in text) / max(1, len(text))
    return printable > 0.95 and sum(mark in text for mark in PY_MARKERS) >= 3


def _numel(f: Any, key: str) -> int:
    return math.prod(f.get_slice(key).get_shape())


def test_demo_is_the_trained_checkpoint() -> None:
    path = demo_model_dir()
    # counted from the weights themselves (not from the committed training report); that it is
    # trained, not random, is what the held-out perplexity test below measures
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        parameters = sum(_numel(f, key) for key in f.keys())  # noqa: SIM118
    assert 10e6 <= parameters <= 30e6
    assert (path / "model.safetensors").stat().st_size < 25e6
    assert default_sampling(path) == {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}


def test_demo_heldout_perplexity_is_far_below_chance() -> None:
    llm = LLM(progress=False, max_model_len=513)
    ids = llm.tokenizer.encode(load_text("held-out"), add_special_tokens=False)
    nll, count = engine_nll(llm, windows_of(ids, 512, 4096), progress=False)
    perplexity = math.exp(nll / count)
    assert perplexity < 100, perplexity  # chance is the vocabulary size, 6144


def test_make_serve_answers_with_python_like_text(tmp_path: Path) -> None:
    with running_server(None, "--max-model-len", "512", log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        prompt = "def read_config(path):\n"
        texts = [
            client.completions.create(model=model, prompt=prompt, max_tokens=48, seed=seed).choices[0].text
            for seed in range(4)
        ]
    assert sum(python_like(t) for t in texts) >= 3, texts
    assert len(set(texts)) > 1  # the checkpoint's temperature 0.7 applies: seeds differ
