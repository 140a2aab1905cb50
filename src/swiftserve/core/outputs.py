"""What a finished step means for one request: its sampled tokens, its times, its outputs.

Helpers of core/scheduler.py's ``update``; pure functions over Request and the messages.
"""

from __future__ import annotations

from swiftserve.core.messages import (
    EngineCoreOutput,
    LogprobEntry,
    RequestTimes,
    RunnerOutput,
    ScheduledRequest,
)
from swiftserve.core.request import Request, RequestStatus


def deadline_output(request: Request) -> EngineCoreOutput:
    """The output that ends a request the deadline check failed."""
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        new_logprobs=[],
        prompt_logprobs=None,
        finish_reason=RequestStatus.FINISHED_DEADLINE.finish_reason,
        stop_reason=request.stop_reason,
        times=request_times(request),
    )


def request_times(request: Request) -> RequestTimes:
    return RequestTimes(
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finished_time=request.finished_time,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
    )


def sampled_tokens(item: ScheduledRequest, result: RunnerOutput) -> tuple[list[int], list[LogprobEntry]]:
    """The tokens a step produced for one request (several when drafts were accepted)."""
    rid = item.request_id
    if item.num_spec:
        return result.spec_token_ids.get(rid, []), result.spec_logprobs.get(rid, [])
    token = result.sampled_token_ids.get(rid) if item.sample else None
    logprob = result.logprobs.get(rid)
    return ([token] if token is not None else []), ([logprob] if logprob is not None else [])


def latencies(request: Request) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) of a finished request, as the engine measured them."""
    first = request.first_token_time
    if first is None:
        return None, None
    tpot = None
    if request.num_output_tokens > 1 and request.finished_time is not None:
        tpot = (request.finished_time - first) / (request.num_output_tokens - 1)
    return first - request.arrival_time, tpot
