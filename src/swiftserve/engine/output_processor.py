"""OutputProcessor: turns EngineCoreOutputs (token ids) into RequestOutputs (text).

A request with ``n > 1`` fans out into n child sequences in the core; this module gathers
them back under the parent. Stop strings are found here, after detokenization; the
children that hit one are returned so the caller can abort them in the core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swiftserve.core.messages import EngineCoreOutput, LogprobEntry
from swiftserve.engine.detokenizer import IncrementalDetokenizer, make_decode_fn
from swiftserve.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from swiftserve.sampling_params import SamplingParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Core-level ids of a request's n sequences."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


@dataclass
class _Sequence:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestState:
    """Frontend state of one user request (all its sequences)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, _Sequence]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())


class OutputProcessor:
    """Detokenizes, applies stop strings and assembles outputs, per request."""

    def __init__(self, tokenizer: Any):
        self._decode = make_decode_fn(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self._parent_of: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> list[str]:
        """Register a request; returns the child ids to submit to the core."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = child_request_ids(request_id, params.n)
        sequences = {
            cid: _Sequence(
                i,
                IncrementalDetokenizer(self._decode, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i, cid in enumerate(children)
        }
        plp: list[PositionLogprobs | None] | None = [None] if params.prompt_logprobs is not None else None
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, sequences, plp)
        for cid in children:
            self._parent_of[cid] = request_id
        return children

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[str]]:
        """Apply one step's outputs. Returns (touched requests, child ids to abort as stopped)."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent_id = self._parent_of.get(out.request_id)
            if parent_id is None:
                continue
            state = self.requests[parent_id]
            seq = state.sequences[out.request_id]
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None and seq.index == 0:
                state.prompt_logprobs.extend(self._logprob_dicts(out.prompt_logprobs))
            seq.token_ids.extend(out.new_token_ids)
            if seq.logprobs is not None and out.new_logprobs:
                seq.logprobs.extend(self._logprob_dicts(out.new_logprobs))
                seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(e[1] for e in out.new_logprobs)
            stop = seq.detok.update(out.new_token_ids)
            if stop is not None and out.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
            if seq.finish_reason is not None:
                if stop is None:
                    seq.detok.flush()
                self._parent_of.pop(out.request_id, None)
            t = out.times
            state.metrics = RequestMetrics(
                t.arrival_time,
                t.first_scheduled_time,
                t.first_token_time,
                t.finished_time,
                t.num_preemptions,
            )
            state.num_cached_tokens = t.num_cached_tokens
            touched[parent_id] = state
        return list(touched.values()), to_abort

    def parent_of(self, child_id: str) -> str | None:
        """The user request a core-level (child) id belongs to, while it is unfinished."""
        return self._parent_of.get(child_id)

    def abort(self, request_id: str) -> list[str]:
        """Mark every unfinished sequence of a request aborted; returns its child ids."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        children = []
        for cid, seq in state.sequences.items():
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                self._parent_of.pop(cid, None)
            children.append(cid)
        return children

    def pop(self, request_id: str) -> RequestState | None:
        """Forget a request (after its final output was delivered)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for cid in state.sequences:
                self._parent_of.pop(cid, None)
        return state

    def _logprob_dicts(self, entries: list[LogprobEntry]) -> list[PositionLogprobs]:
        result = []
        for token, logprob, rank, top in entries:
            d: PositionLogprobs = {token: Logprob(logprob, rank, self._decode([token], False))}
            for r, (tid, lp) in enumerate(top, start=1):
                if tid not in d:
                    d[tid] = Logprob(lp, r, self._decode([tid], False))
            result.append(d)
        return result

    @staticmethod
    def to_request_output(state: RequestState, *, delta: bool = False) -> RequestOutput:
        """Build a RequestOutput (cumulative text, or only new text when ``delta``)."""
        completions = []
        for seq in sorted(state.sequences.values(), key=lambda s: s.index):
            text = seq.detok.delta(seq.finish_reason is not None) if delta else seq.detok.text
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=seq.logprobs,
                    cumulative_logprob=seq.cumulative_logprob,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            prompt_logprobs=state.prompt_logprobs,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
        )
