"""What a finished step means for one request: its sampled tokens, its times, its outputs.

Helpers of core/scheduler.py; functions of a Request and the messages.
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


def prompt_logprob_start(request: Request, start: int) -> int | None:
    """The first prompt position a step starting at ``start`` reports logprobs for, or None.
    Prompt logprobs are reported once, even if a preempted request recomputes them."""
    if request.sampling_params.prompt_logprobs is None or request.num_output_tokens:
        return None
    if request.num_placeholders:  # the prompt ran in a step still in flight
        return None
    return max(start, request.prompt_logprob_pos)


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Whether ``token``, just appended to the request's output, ends it."""
    params = request.sampling_params
    if request.num_output_tokens > params.min_tokens or params.min_tokens == 0:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
