"""Results returned to users: RequestOutput and CompletionOutput (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """Log probability of one token, its rank in the distribution, and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position: token id -> Logprob (the chosen token plus the top-N alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class RequestMetrics:
    """Timestamps in time.monotonic() seconds."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence (of ``n``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything produced for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
