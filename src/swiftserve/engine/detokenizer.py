"""Incremental detokenizer: UTF-8 safe streaming text and stop strings across tokens.

Text is decoded over a small sliding window of token ids (seeded with the prompt's last
tokens so leading spaces come out right). A window whose text ends in U+FFFD is a
multi-byte character split across tokens: nothing is emitted until it completes.
Stop strings are searched only where a new match can end; while generating, the last
``max_stop_len - 1`` characters are held back so a partial stop string never leaks.
"""

from __future__ import annotations

from typing import Any

from swiftserve.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 6


def make_decode_fn(tokenizer: Any):  # type: ignore[no-untyped-def]
    """A fast ``decode(ids, skip_special_tokens)`` (the Rust backend when there is one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, with stop-string handling."""

    def __init__(self, decode: Any, prompt_token_ids: list[int], params: SamplingParams):
        self._decode = decode
        self._skip = params.skip_special_tokens
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_output = 0
        max_stop = max((len(s) for s in self._stop), default=0)
        self._holdback = max_stop - 1 if max_stop and not self._include_stop else 0
        self._max_stop = max_stop
        self.text = ""
        self._emitted = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string that matched (text is then cut), else None."""
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._num_output += 1
            old_len = len(self.text)
            self._advance(final=False)
            if self._stop and len(self.text) > old_len and self._num_output > self._min_tokens:
                match = self._find_stop(old_len)
                if match is not None:
                    return match
        return None

    def _advance(self, final: bool) -> None:
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset], self._skip)
        new_text = self._decode(ids[self._prefix_offset :], self._skip)
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)

    def flush(self) -> None:
        """At the end, emit a trailing incomplete character as decode() would (U+FFFD)."""
        if self._read_offset < len(self._ids):
            self._advance(final=True)

    def _find_stop(self, old_len: int) -> str | None:
        start = max(0, old_len - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + (len(stop) if self._include_stop else 0)]
        return stop

    def delta(self, finished: bool) -> str:
        """Text not yet returned; holds back a possible partial stop string until finished."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
