"""Incremental detokenizer: UTF-8 safety and stop strings spanning tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from swiftserve.engine.detokenizer import IncrementalDetokenizer, make_decode_fn
from swiftserve.engine.tokenizer import load_tokenizer
from swiftserve.sampling_params import SamplingParams

TEXT = "def héllo(wörld):\n    return '日本語 🙂' + \"x\"  # done STOP after\n"


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path):  # type: ignore[no-untyped-def]
    return load_tokenizer(llama_dir)


def stream(
    tokenizer, params: SamplingParams, prompt: str = "x = 1\n"
) -> tuple[list[str], IncrementalDetokenizer, str | None]:  # type: ignore[no-untyped-def]
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(make_decode_fn(tokenizer), prompt_ids, params)
    deltas, stop = [], None
    for token in ids:
        stop = detok.update([token])
        deltas.append(detok.delta(finished=stop is not None))
        if stop is not None:
            break
    if stop is None:
        detok.flush()
        deltas.append(detok.delta(finished=True))
    return deltas, detok, stop


def test_multibyte_characters_never_split(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TEXT.encode()) // 4  # non-ASCII characters span several tokens
    deltas, detok, _ = stream(tokenizer, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == detok.text


def test_stop_string_across_tokens_never_leaks(tokenizer) -> None:  # type: ignore[no-untyped-def]
    deltas, detok, stop = stream(tokenizer, SamplingParams(stop=["STOP", "never-there"]))
    assert stop == "STOP"
    expected = TEXT[: TEXT.index("STOP")]
    assert "".join(deltas) == expected == detok.text
    # No delta emitted before the end may contain a prefix of the stop string past the text.
    assert all("ST" not in d for d in deltas)


def test_include_stop_str_in_output(tokenizer) -> None:  # type: ignore[no-untyped-def]
    deltas, detok, _stop = stream(tokenizer, SamplingParams(stop="STOP", include_stop_str_in_output=True))
    assert detok.text == TEXT[: TEXT.index("STOP") + 4]
    assert "".join(deltas) == detok.text


def test_incomplete_trailing_character_flushes_like_decode(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer("ok 🙂", add_special_tokens=False)["input_ids"]
    cut = ids[:-1]  # drop the emoji's last byte token
    detok = IncrementalDetokenizer(make_decode_fn(tokenizer), [], SamplingParams())
    detok.update(cut)
    detok.flush()
    assert detok.text == tokenizer.decode(cut)
