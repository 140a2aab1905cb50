"""Plain message types crossing the core's boundaries (no torch; msgspec-friendly shapes).

SchedulerOutput goes from the scheduler to the model runner; RunnerOutput comes back;
EngineCoreOutput goes from the engine core to the frontend (detokenizer, API).
The frontend -> core commands (Add, Abort, Stop) and CoreInfo are typed msgspec Structs:
the pipe to the engine process carries exactly these, never pickle, never tagged tuples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from swiftserve.sampling_params import SamplingParams

# The engine's own finish reason for a request it refused to apply (a message it could not
# decode or validate): that one request fails, never the engine process.
FINISH_REJECTED = "rejected"
FINISH_DEADLINE = "deadline_exceeded"  # the request's deadline passed or could not be met

# A token id not known when the step was scheduled (async scheduling: the previous step,
# still running, samples it); the runner reads it from its own record of sampled tokens.
PLACEHOLDER = -1

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
    num_spec: int = 0  # the last num_spec of token_ids are draft tokens to verify


@dataclass(frozen=True)
class SchedulerOutput:
    """What the next forward pass computes. Immutable; built by ``Scheduler.schedule``."""

    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData]
    finished_request_ids: frozenset[str]
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...] = ()
    draft_ids: frozenset[str] = frozenset()  # requests the draft model proposes for after the step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """Results of one forward pass, keyed by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, LogprobEntry] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)
    # speculative rows: the accepted drafts plus one token sampled after them, and their logprobs
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)
    # the draft model's proposals for the next step (core/draft.py)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


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


def rejected_output(request_id: str, message: str) -> EngineCoreOutput:
    """The output that fails one request the core could not apply (``stop_reason``: why)."""
    now = time.monotonic()
    return EngineCoreOutput(
        request_id, [], [], None, FINISH_REJECTED, message, RequestTimes(now, None, None, now)
    )


# ---- frontend -> core commands ----------------------------------------------------------------
class EngineCoreRequest(msgspec.Struct, frozen=True):
    """A tokenized, validated request as the core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = msgspec.field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() (one clock for both processes on Linux)
    cache_salt: str | None = None  # isolates prefix-cache hits between tenants (vLLM's name)


class Add(msgspec.Struct, frozen=True, tag="add"):
    """Queue these requests (the n children of one user request: all or nothing)."""

    requests: list[EngineCoreRequest]


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    """Finish these requests now: aborted, or ``stopped`` by a stop string."""

    request_ids: list[str]
    stopped: bool = False


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    """End the engine loop."""


Command = Add | Abort | Stop


class CoreInfo(msgspec.Struct, frozen=True):
    """What the frontend must know about the engine to validate requests."""

    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


# ---- core -> frontend replies (engine process) ------------------------------------------------
class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """The engine process is built and serving."""

    info: CoreInfo


class Outputs(msgspec.Struct, frozen=True, tag="out"):
    """One step's outputs (possibly none) and the latest scheduler gauges."""

    outputs: list[EngineCoreOutput]
    stats: dict[str, float]


class Failed(msgspec.Struct, frozen=True, tag="error"):
    """The engine process is dying with this error."""

    message: str


Reply = Ready | Outputs | Failed


class ModelInfo(msgspec.Struct, frozen=True):
    """What a worker tells the engine core about the model it loaded."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    weight_bytes: int
    device: str
