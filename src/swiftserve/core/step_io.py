"""The scheduler's two ends of a step: the ``SchedulerOutput`` it hands the runner, and the
runner's results applied back to the requests (tokens, stops, speculative-decoding counts).

``StepIO`` is a base of ``core/scheduler.py: Scheduler``, split out only to keep each file
readable: it holds no state of its own (the attributes below are the Scheduler's).
"""

from __future__ import annotations

from collections.abc import Callable

from swiftserve.core.block_manager import BlockManager
from swiftserve.core.deadlines import DeadlineKeeper
from swiftserve.core.messages import (
    PLACEHOLDER,
    EngineCoreOutput,
    NewRequestData,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from swiftserve.core.ngram import NgramProposer, SpecDecodeStats
from swiftserve.core.outputs import (
    check_stop,
    deadline_output,
    prompt_logprob_start,
    request_times,
    sampled_tokens,
)
from swiftserve.core.request import Request, RequestStatus


class StepIO:
    """Builds a step's output and applies its results (see the module docstring)."""

    running: list[Request]
    requests: dict[str, Request]
    bm: BlockManager
    deadlines: DeadlineKeeper
    proposer: NgramProposer | None
    spec: SpecDecodeStats
    max_model_len: int
    pipeline_depth: int
    _drafts: dict[str, list[int]]
    _new_ids: set[str]
    _finished_ids: set[str]
    _want_drafts: bool
    _batches: dict[int, list[tuple[Request, int]]]
    clock: Callable[[], float]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        raise NotImplementedError

    def _build_output(self, scheduled: dict[str, int], preempted: list[str]) -> SchedulerOutput:
        items: list[ScheduledRequest] = []
        new: list[NewRequestData] = []
        batch: list[tuple[Request, int]] = []
        draft_ids: set[str] = set()
        for request in self.running:
            num_new = scheduled.get(request.request_id)
            if num_new is None:
                continue
            start = request.num_computed_tokens
            drafts = self._drafts.get(request.request_id, [])
            num_new -= len(drafts)
            if request.request_id in self._new_ids:
                self._new_ids.discard(request.request_id)
                new.append(
                    NewRequestData(
                        request.request_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        list(request.output_token_ids),
                        request.eos_token_ids,
                    )
                )
            end = start + num_new
            known = min(end, request.num_tokens)  # later positions: tokens still in flight
            sample = end == request.num_tokens + request.num_placeholders
            items.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.token_ids(start, known) + [PLACEHOLDER] * (end - known) + drafts,
                    start_pos=start,
                    block_ids=list(self.bm.block_table(request.request_id)),
                    sample=sample,
                    prompt_logprob_start=prompt_logprob_start(request, start),
                    num_spec=len(drafts),
                )
            )
            # counted as computed now (the next schedule may come before this step's result)
            request.num_computed_tokens = end + len(drafts)
            request.num_placeholders += sample
            batch.append((request, request.num_preemptions))
            if sample and self.proposer is not None and self.proposer.wants(request) and self._want_drafts:
                draft_ids.add(request.request_id)
        finished = frozenset(self._finished_ids)
        self._finished_ids.clear()
        out = SchedulerOutput(
            items, new, finished, sum(scheduled.values()), tuple(preempted), frozenset(draft_ids)
        )
        while len(self._batches) >= self.pipeline_depth + 3:  # a step that never came back (an engine fault)
            del self._batches[next(iter(self._batches))]
        self._batches[id(out)] = batch
        return out

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Advance requests by a finished step; finish those that stopped."""
        outputs = [deadline_output(r) for r in self.deadlines.take_failed()]
        now = self.clock()
        batch = self._batches.pop(id(sched), None)
        for i, item in enumerate(sched.scheduled):
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted in between
            if batch is not None and (batch[i][0] is not request or batch[i][1] != request.num_preemptions):
                continue  # a finished request's id reused, or preempted, while the step was in flight
            tokens, logprobs = sampled_tokens(item, result)
            # drafts the verifier rejected leave no computed tokens behind (their KV slots
            # are simply overwritten later)
            request.num_computed_tokens -= item.num_spec - max(len(tokens) - 1, 0)
            request.num_placeholders = max(0, request.num_placeholders - item.sample)
            if item.prompt_logprob_start is not None:
                request.prompt_logprob_pos = item.start_pos + len(item.token_ids)
            new_tokens: list[int] = []
            status: RequestStatus | None = None
            for token in tokens:
                new_tokens.append(token)
                request.output_token_ids.append(token)
                if request.first_token_time is None:
                    request.first_token_time = now
                status = check_stop(request, token, self.max_model_len)
                if status is not None:
                    break
            if item.num_spec:  # a stop inside the accepted drafts: only what precedes it counts
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            self.bm.cache_full_blocks(request)
            self.spec.observe(item.num_spec, max(len(tokens) - 1, 0), len(new_tokens))
            if self.proposer is not None:
                if item.num_spec:
                    self.proposer.observe(request.request_id, item.num_spec, max(len(tokens) - 1, 0))
                if item.request_id in result.draft_token_ids:
                    self.proposer.receive(item.request_id, result.draft_token_ids[item.request_id])
            prompt_lps = result.prompt_logprobs.get(item.request_id)
            if not new_tokens and prompt_lps is None:
                continue
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=new_tokens,
                    new_logprobs=logprobs[: len(new_tokens)],
                    prompt_logprobs=prompt_lps,
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=request.stop_reason,
                    times=request_times(request),
                )
            )
        return outputs
