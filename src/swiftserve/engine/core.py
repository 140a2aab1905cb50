"""EngineCore: the step. ``schedule -> executor.execute_model -> update``, nothing else.

It holds the scheduler and an executor; the workers behind the executor own the model. It
speaks plain messages (EngineCoreRequest in, EngineCoreOutput out), driven by the one loop
of engine/core_loop.py in the offline LLM, a thread, or its own process.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

from swiftserve.config import EngineConfig
from swiftserve.core.block_manager import BlockManager
from swiftserve.core.messages import EngineCoreOutput, EngineCoreRequest, SchedulerOutput
from swiftserve.core.ngram import NgramProposer
from swiftserve.core.request import Request, RequestStatus
from swiftserve.core.scheduler import Scheduler
from swiftserve.core.slo import SLOTargets
from swiftserve.engine.step_log import StepLog
from swiftserve.worker.executor import Executor, UniProcExecutor

logger = logging.getLogger(__name__)


class EngineCore:
    """Scheduler + an executor (the workers that own the model), stepped by the caller."""

    def __init__(self, config: EngineConfig, model_dir: str | Path, *, progress: bool = True):
        self.config = config
        self.executor: Executor = UniProcExecutor(config, model_dir, progress=progress)
        self.model_info = self.executor.model_info
        self.max_model_len = self.model_info.max_model_len
        blocks = self.executor.determine_num_kv_blocks()
        self.executor.initialize_kv_cache(blocks)
        self.block_manager = BlockManager(blocks, config.block_size, config.enable_prefix_caching)
        spec = config.speculative_config
        proposer = (
            NgramProposer(
                spec.num_speculative_tokens,
                spec.prompt_lookup_min or 1,
                spec.prompt_lookup_max or 1,
                spec.adaptive,
            )
            if spec is not None
            else None
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
        )
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
        sched = self.scheduler.schedule()
        predicted = self._predict(sched) if self.step_log is not None else 0.0
        start = time.perf_counter()
        result = self.executor.execute_model(sched)
        seconds = time.perf_counter() - start
        if self.step_log is not None:
            self.step_log.record(self.scheduler, sched, seconds, predicted)
        self.scheduler.observe_step(sched, seconds)
        return self.scheduler.update(sched, result)

    def _predict(self, sched: SchedulerOutput) -> float:
        rows = sum(1 for item in sched.scheduled if len(item.token_ids) == 1)
        return self.scheduler.cost.predict(sched.num_batched_tokens - rows, rows)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()
