"""EngineCore: the step. ``schedule -> executor.execute_model -> update``, nothing else.

It holds the scheduler and an executor; the workers behind the executor own the model. It
speaks plain messages (EngineCoreRequest in, EngineCoreOutput out), driven by the one loop
of engine/core_loop.py in the offline LLM, a thread, or its own process.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swiftserve.config import EngineConfig
from swiftserve.core.block_manager import BlockManager
from swiftserve.core.draft import DraftProposer
from swiftserve.core.messages import EngineCoreOutput, EngineCoreRequest, RunnerOutput, SchedulerOutput
from swiftserve.core.ngram import NgramProposer
from swiftserve.core.request import Request, RequestStatus
from swiftserve.core.scheduler import Scheduler
from swiftserve.core.slo import SLOTargets
from swiftserve.engine.step_log import StepLog
from swiftserve.worker.executor import Executor, UniProcExecutor

if TYPE_CHECKING:
    from swiftserve.worker.step_stream import StepHandle

logger = logging.getLogger(__name__)


def make_executor(config: EngineConfig, model_dir: str | Path, progress: bool) -> Executor:
    """One worker in this process, or pipeline stages in their own processes."""
    if config.pipeline_parallel_size > 1:
        from swiftserve.worker.pipeline import PipelineExecutor

        return PipelineExecutor(config, model_dir, progress=progress)
    return UniProcExecutor(config, model_dir, progress=progress)


class EngineCore:
    """Scheduler + an executor (the workers that own the model), stepped by the caller."""

    def __init__(self, config: EngineConfig, model_dir: str | Path, *, progress: bool = True):
        self.config = config
        self.executor: Executor = make_executor(config, model_dir, progress)
        self.depth = config.pipeline_parallel_size  # micro-batches in flight (pipeline parallel)
        self.model_info = self.executor.model_info
        self.max_model_len = self.model_info.max_model_len
        blocks = self.executor.determine_num_kv_blocks()
        self.executor.initialize_kv_cache(blocks)
        self.block_manager = BlockManager(blocks, config.block_size, config.enable_prefix_caching)
        spec = config.speculative_config
        proposer: NgramProposer | None = None
        if spec is not None and spec.method == "draft_model":
            proposer = DraftProposer(spec.num_speculative_tokens, spec.adaptive)
        elif spec is not None:
            proposer = NgramProposer(
                spec.num_speculative_tokens,
                spec.prompt_lookup_min or 1,
                spec.prompt_lookup_max or 1,
                spec.adaptive,
            )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            aging_interval_s=config.aging_interval_s,
            edf_slack_s=config.edf_slack_s,
            deadline_scheduling=config.deadline_scheduling,
            targets=SLOTargets(
                config.target_ttft_ms / 1000 if config.target_ttft_ms else None,
                config.target_tpot_ms / 1000 if config.target_tpot_ms else None,
            ),
            proposer=proposer,
            async_scheduling=config.async_scheduling,
            pipeline_depth=self.depth,
        )
        self._in_flight: tuple[SchedulerOutput, StepHandle, float] | None = None
        self._queue: deque[tuple[SchedulerOutput, Any, float]] = deque()  # pipeline micro-batches
        self.max_in_flight = 0  # the most micro-batches seen in flight at once
        self.wakeups_us: deque[float] = deque(maxlen=2048)
        self.step_log = StepLog(config.step_log) if config.step_log else None
        # Everything allocated so far lives as long as the engine: keep the cyclic GC from
        # walking it on every collection during steps (DESIGN.md, performance rules).
        gc.collect()
        gc.freeze()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError if it can never fit or a value is out of range.

        The frontend validates first; these checks are the core defending itself.
        """
        if not -(2**31) < request.priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {request.priority!r}")
        if not 1 <= request.max_tokens < 2**31:
            raise ValueError(f"max_tokens must be in [1, 2**31), got {request.max_tokens!r}")
        ids = request.prompt_token_ids
        if not ids or min(ids) < 0 or max(ids) >= self.model_info.vocab_size:
            raise ValueError("prompt must be non-empty token ids inside the vocabulary")
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_ids=request.eos_token_ids,
                priority=request.priority,
                arrival_time=request.arrival_time,
                max_tokens=request.max_tokens,
                deadline=request.deadline,
                cache_salt=request.cache_salt,
            )
        )

    def abort_requests(self, request_ids: list[str], *, stopped: bool = False) -> None:
        """Finish requests now (aborted, or stopped by a stop string); frees their blocks."""
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        self.scheduler.finish_requests(request_ids, status)

    def step(self) -> list[EngineCoreOutput]:
        """One forward pass over the scheduled tokens; returns what changed."""
        if self.config.async_scheduling:
            return self._step_overlapped()
        if self.depth > 1:
            return self._step_pipelined()
        sched = self.scheduler.schedule()
        predicted = self._predict(sched) if self.step_log is not None else 0.0
        start = time.perf_counter()
        result = self.executor.execute_model(sched)
        return self._apply(sched, result, time.perf_counter() - start, predicted)

    def _step_overlapped(self) -> list[EngineCoreOutput]:
        """Schedule and queue step N+1, then wait for step N and apply its result.

        Step N+1 is scheduled while step N still runs on the step thread (tokens it has not
        sampled yet are placeholders the runner fills in), and step N's result is applied
        while step N+1 runs: the engine thread's work hides under the forward passes. The
        first call only launches; a call with nothing left to schedule only drains.
        """
        launched = None
        if self.scheduler.has_unfinished():
            sched = self.scheduler.schedule()
            predicted = self._predict(sched) if self.step_log is not None else 0.0
            launched = (sched, self.executor.submit_model(sched), predicted)
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return []
        sched, handle, predicted = previous
        done = handle.result()
        self.wakeups_us.append(done.wakeup_s * 1e6)
        return self._apply(sched, done.output, done.seconds, predicted)

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Fill the pipeline up to ``depth`` micro-batches, then apply the oldest's result.

        Requests whose sampled token is still in flight sit a micro-batch out (the scheduler
        sees to that), so a micro-batch can come back empty: it is dropped unless it carries
        finished requests the stages must forget.
        """
        while len(self._queue) < self.depth and self.scheduler.has_unfinished():
            sched = self.scheduler.schedule()
            if sched.is_empty and not sched.finished_request_ids:
                self.scheduler.discard(sched)
                break
            predicted = self._predict(sched) if self.step_log is not None else 0.0
            self._queue.append((sched, self.executor.submit_model(sched), predicted))
            self.max_in_flight = max(self.max_in_flight, sum(not s.is_empty for s, _, _ in self._queue))
            if sched.is_empty:
                break
        if not self._queue:
            return []
        sched, handle, predicted = self._queue.popleft()
        done = handle.result()
        return self._apply(sched, done.output, done.seconds, predicted)

    def _apply(
        self, sched: SchedulerOutput, result: RunnerOutput, seconds: float, predicted: float
    ) -> list[EngineCoreOutput]:
        if self.step_log is not None:  # (with async scheduling, the budget is the next step's)
            self.step_log.record(self.scheduler, sched, seconds, predicted)
        self.scheduler.observe_step(sched, seconds)
        return self.scheduler.update(sched, result)

    def wakeup_stats(self) -> dict[str, float]:
        """How long the engine thread took to resume after a step ended (async scheduling)."""
        if not self.wakeups_us:
            return {}
        values = sorted(self.wakeups_us)
        return {
            "step_wakeup_us_p50": values[len(values) // 2],
            "step_wakeup_us_p99": values[min(len(values) - 1, int(len(values) * 0.99))],
        }

    def _predict(self, sched: SchedulerOutput) -> float:
        rows = sum(1 for item in sched.scheduled if len(item.token_ids) == 1)
        return self.scheduler.cost.predict(sched.num_batched_tokens - rows, rows)

    def has_unfinished(self) -> bool:
        """Requests left to step, or a step still in flight whose result is not applied."""
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._queue)

    def shutdown(self) -> None:
        """Stop the executor's workers (and the step thread)."""
        self.executor.shutdown()
