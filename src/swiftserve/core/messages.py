"""Plain message types crossing the core's boundaries (no torch; msgspec-friendly shapes).

SchedulerOutput goes from the scheduler to the model runner; RunnerOutput comes back;
EngineCoreOutput goes from the engine core to the frontend (detokenizer, API).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swiftserve.sampling_params import SamplingParams

# (token_id, logprob, rank, ((top_token_id, top_logprob), ...))
LogprobEntry = tuple[int, float, int, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class NewRequestData:
    """Sent to the runner the first time a request is scheduled."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: ``token_ids`` at positions ``start_pos...``."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    prompt_logprob_start: int | None = None  # first prompt position to report, or None


@dataclass(frozen=True)
class SchedulerOutput:
    """What the next forward pass computes. Immutable; built by ``Scheduler.schedule``."""

    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData]
    finished_request_ids: frozenset[str]
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """Results of one forward pass, keyed by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, LogprobEntry] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestTimes:
    """Timestamps (time.monotonic seconds) of a request's life so far."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass(frozen=True)
class EngineCoreOutput:
    """New tokens (and finish state) of one request after one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobEntry]
    prompt_logprobs: list[LogprobEntry] | None
    finish_reason: str | None
    stop_reason: int | str | None
    times: RequestTimes
