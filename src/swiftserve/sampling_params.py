"""SamplingParams: how to pick tokens and when to stop (vLLM's names and semantics)."""

from __future__ import annotations

import dataclasses
import json as json_module
from dataclasses import dataclass
from typing import Any

from swiftserve._options import check_finite, check_range, reject_unknown_options

MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit value
MAX_INT = 2**31 - 1  # counts and token ids: bounded so no tensor or message overflows


@reject_unknown_options
@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's ``structured_outputs``): exactly one of
    ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON object), ``regex``,
    ``choice`` (one of these strings) or ``grammar`` (Lark, llguidance's dialect).

    JSON output has no free whitespace (items ``", "``, keys ``": "``) unless
    ``disable_any_whitespace=False``: small models that may add whitespace often never stop.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            # one text per schema (property order kept: the output follows it): the cache key
            object.__setattr__(self, "json", json_module.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        own = "StructuredOutputsParams"
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                f"{own}: set exactly one of json, json_object, regex, choice, grammar (got {kinds or 'none'})"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"{own}.choice must be a non-empty list of non-empty strings")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{own}.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@reject_unknown_options
@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping options.

    ``temperature == 0`` means greedy. ``top_k == -1`` disables top-k. ``max_tokens=None``
    means "up to the model's context length". Stop strings are matched on the detokenized
    text and never leak partially into the output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Token rules, applied to the logits before everything else (vLLM's names). logit_bias:
    # (token id, bias in [-100, 100]) pairs (a dict is accepted); allowed_token_ids: only
    # these may be sampled; bad_words: never completed; the frontend fills
    # bad_words_token_ids from them with the model's tokenizer.
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Output constrained to a JSON schema, regex, choice or grammar (a dict is accepted).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Normalise convenience forms (a single stop string, lists) into tuples.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias or ())))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        object.__setattr__(
            self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids or ())
        )
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        self._validate()

    def _validate(self) -> None:
        own = "SamplingParams"
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                check_finite(own, f.name, value)
        _check_int(own, "n", self.n, 1, MAX_INT)
        check_range(own, "temperature", self.temperature, 0.0)
        check_range(own, "top_p", self.top_p, 0.0, 1.0, low_open=True)
        if (
            not isinstance(self.top_k, int)
            or isinstance(self.top_k, bool)
            or (self.top_k < 1 and self.top_k != -1)
            or self.top_k > MAX_INT
        ):
            raise ValueError(f"{own}.top_k must be -1 (disabled) or in [1, {MAX_INT}], got {self.top_k!r}")
        check_range(own, "min_p", self.min_p, 0.0, 1.0)
        check_range(own, "presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range(own, "frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_range(own, "repetition_penalty", self.repetition_penalty, 0.0, low_open=True)
        if self.max_tokens is not None:
            _check_int(own, "max_tokens", self.max_tokens, 1, MAX_INT)
        _check_int(own, "min_tokens", self.min_tokens, 0, MAX_INT)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"{own}.min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(own, name, value, 0, MAX_LOGPROBS)
        if self.seed is not None:
            _check_int(own, "seed", self.seed, 0, MAX_SEED)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"{own}.stop entries must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int(own, "stop_token_ids", t, 0, MAX_INT)
        for t, b in self.logit_bias:
            _check_int(own, "logit_bias", t, 0, MAX_INT)
            check_range(own, "logit_bias", b, -100.0, 100.0)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError(f"{own}.allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                _check_int(own, "allowed_token_ids", t, 0, MAX_INT)
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"{own}.bad_words entries must be non-empty strings, got {w!r}")

    @property
    def token_ids_named(self) -> list[tuple[str, int]]:
        """(field, id) of every token id the rules name, for a vocabulary check."""
        named = [("logit_bias", t) for t, _ in self.logit_bias]
        return named + [("allowed_token_ids", t) for t in self.allowed_token_ids or ()]

    @property
    def has_token_rules(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits, nothing else asked: no logprobs, token rules, min_tokens or
        penalties (the runner then takes the argmax where the logits are, e.g. on the GPU)."""
        return (
            self.greedy
            and self.logprobs is None
            and not self.has_token_rules
            and not self.min_tokens
            and not self.uses_penalties
            and self.structured_outputs is None
        )

    @property
    def uses_penalties(self) -> bool:
        """True when any repetition/presence/frequency penalty is active."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _check_int(owner: str, name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{owner}.{name} must be {rng}, got {value!r}")
