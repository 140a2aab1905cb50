"""Request: one sequence's state as the scheduler sees it, with an explicit state machine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from swiftserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every value above RUNNING means finished (vLLM's convention)."""

    WAITING = 0
    PREEMPTED = 1
    RUNNING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_DEADLINE = 7  # its deadline passed, or the engine saw it could not be met

    @property
    def finished(self) -> bool:
        return self > RequestStatus.RUNNING

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_DEADLINE: "deadline_exceeded",
}

_ALLOWED = {
    RequestStatus.WAITING: {RequestStatus.RUNNING},
    RequestStatus.PREEMPTED: {RequestStatus.RUNNING},
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED, RequestStatus.RUNNING},
}


class IllegalTransition(RuntimeError):
    """A request was moved between states in a way the state machine forbids."""


@dataclass(eq=False)
class Request:
    """A sequence being generated. Only the scheduler mutates it.

    ``num_computed_tokens`` catches up with ``num_tokens`` (prompt + output so far); the
    difference is what the next steps must run through the model. The scheduler counts a
    step's tokens as computed when it schedules them; ``num_placeholders`` are output tokens
    a scheduled step will sample but whose ids are not back yet (at most one; with async
    scheduling the next step already runs the placeholder through the model).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    max_tokens: int = 16
    cache_salt: str | None = None
    deadline: float | None = None  # time.monotonic() by which it must finish (None: no deadline)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_placeholders: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    prompt_logprob_pos: int = 0  # prompt positions whose logprobs were already reported
    block_hashes: list[int] = field(default_factory=list)
    slo_lost: bool = False  # the planner found it can no longer meet a latency target (triage)
    slo_bank: float = 0.0  # seconds its recent tokens came under the TPOT target (core/slo.py)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model, the placeholder included."""
        return self.num_tokens + self.num_placeholders - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) over prompt + output."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def due_time(self, slack_s: float) -> float:
        """The time it is ordered by (earliest deadline first): its deadline, or, without one,
        ``slack_s`` after its arrival (which bounds how long deadlines can overtake it)."""
        return self.deadline if self.deadline is not None else self.arrival_time + slack_s

    def min_remaining_outputs(self) -> int:
        """Output tokens it must still produce whatever it samples (a lower bound): all of
        them with ignore_eos, else up to min_tokens, and at least the first one."""
        params = self.sampling_params
        target = self.max_tokens if params.ignore_eos else max(1, params.min_tokens)
        return max(0, target - self.num_output_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def set_status(self, new: RequestStatus) -> None:
        """Move to ``new``; finishing is allowed from any live state, nothing leaves finished."""
        if self.status.finished:
            raise IllegalTransition(f"{self.request_id}: {self.status.name} is final")
        if not new.finished and new not in _ALLOWED[self.status]:
            raise IllegalTransition(f"{self.request_id}: {self.status.name} -> {new.name}")
        self.status = new
