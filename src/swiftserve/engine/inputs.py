"""Input processing: prompt forms, tokenization and validation, before anything is queued.

A prompt longer than ``max_prompt_chars`` is refused before it is tokenized: no token of the
vocabulary covers more than ``max_token_chars`` characters, so such a prompt cannot fit in
the context (tokenizing an 8 MB prompt only to reject it once held up everyone else for
seconds and left the process a gigabyte larger).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swiftserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``param`` names the field, ``code`` is OpenAI's code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]


def is_token_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a list of them -> a list (a list of ints is one token-id prompt)."""
    if isinstance(prompts, str | dict) or is_token_list(prompts):
        return [prompts]  # type: ignore[list-item]
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise InvalidRequestError("prompt: must not be empty", "prompt")
        return list(prompts)
    raise InvalidRequestError(f"prompt: unsupported type {type(prompts).__name__}", "prompt")


def max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters of text one token can stand for.

    The longest vocabulary entry as the tokenizer spells it (byte-level BPE spells each byte
    as one character, so this bounds the decoded characters too); at least 1.
    """
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(token) for token in vocab), default=1) or 1


def context_error(limit: int, num_prompt_tokens: int | None, requested: int | None) -> InvalidRequestError:
    """OpenAI's context_length_exceeded error (prompt size unknown when it was never tokenized)."""
    if num_prompt_tokens is None:
        return InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, your prompt is "
            "longer than that many tokens can spell. Please reduce the length of the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    wanted = num_prompt_tokens + (requested or 0)
    return InvalidRequestError(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{wanted} tokens ({num_prompt_tokens} in the prompt, {requested or 0} in max_tokens). "
        "Please reduce the length of the prompt or max_tokens.",
        param="max_tokens" if requested else "prompt",
        code="context_length_exceeded",
    )


class InputProcessor:
    """Tokenizes prompts and checks them against the model's vocabulary and context."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, token_chars: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_chars = token_chars * max_model_len

    def check_chars(self, num_chars: int) -> None:
        """context_length_exceeded, before any tokenization, for text that cannot fit."""
        if num_chars > self.max_prompt_chars:
            raise context_error(self.max_model_len, None, None)

    def process(self, prompt: Prompt, *, add_special_tokens: bool = True) -> ProcessedPrompt:
        text: str | None = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise InvalidRequestError(f"prompt: unknown keys {sorted(unknown)}", "prompt")
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self.process(prompt["prompt"], add_special_tokens=add_special_tokens)
            else:
                raise InvalidRequestError("prompt: dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        elif isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty", "prompt")
            self.check_chars(len(prompt))
            text = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            token_ids = prompt
        return ProcessedPrompt(text, self._check_ids(token_ids))

    def _check_ids(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, list) or not token_ids:
            raise InvalidRequestError("prompt: must be a non-empty string or list of token ids", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise context_error(self.max_model_len, len(token_ids), None)
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt: token id {t!r} is out of range [0, {self.vocab_size})", "prompt"
                )
        return list(token_ids)

    def max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The request's max_tokens; raises if prompt + max_tokens exceeds the context."""
        limit = self.max_model_len
        requested = params.max_tokens
        if num_prompt_tokens >= limit or (requested is not None and num_prompt_tokens + requested > limit):
            raise context_error(limit, num_prompt_tokens, requested)
        return requested if requested is not None else limit - num_prompt_tokens
