"""Executor: the seam between the engine core and its workers (vLLM's names).

EngineCore talks to one Executor and never to a model. ``UniProcExecutor`` runs one Worker
in the engine's own process; executors with several workers (pipeline stages, tensor
parallel, Ray) go beside it without touching EngineCore.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from swiftserve.config import EngineConfig
from swiftserve.core.messages import ModelInfo, RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from swiftserve.worker.step_stream import StepHandle, StepStream
    from swiftserve.worker.worker import Worker

T = TypeVar("T")


class Executor(ABC):
    """Runs scheduled steps on one or more workers."""

    model_info: ModelInfo

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every worker."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """One forward pass over the scheduled tokens; sampled tokens back."""

    def submit_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Queue a step behind those in flight (async scheduling); wait on the handle."""
        raise NotImplementedError(f"{type(self).__name__} does not run steps asynchronously")

    def check_health(self) -> None:  # noqa: B027 (optional hook: in-process workers cannot vanish)
        """Raise if a worker is gone."""

    def shutdown(self) -> None:  # noqa: B027 (optional hook)
        """Release the workers."""


class UniProcExecutor(Executor):
    """One Worker in this process."""

    def __init__(self, config: EngineConfig, model_dir: str | Path, *, progress: bool = True):
        # Imported here, not at the top: torch loads only in the process that owns the model
        # (the server's frontend imports this module's callers but never builds a worker).
        from swiftserve.worker.worker import Worker

        self._stream: StepStream | None = None
        if config.async_scheduling:  # all torch work on the step thread (worker/step_stream.py)
            from swiftserve.worker.step_stream import StepStream

            self._stream = StepStream(busy_poll=config.busy_poll)
        self.worker: Worker = self._call(Worker, config, model_dir, progress=progress)
        self.model_info = self.worker.model_info

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """On the step thread when there is one, else here."""
        if self._stream is None:
            return fn(*args, **kwargs)
        return self._stream.call(fn, *args, **kwargs)

    def determine_num_kv_blocks(self) -> int:
        return self._call(self.worker.determine_num_kv_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call(self.worker.initialize_kv_cache, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def submit_model(self, scheduler_output: SchedulerOutput) -> StepHandle:
        if self._stream is None:
            raise RuntimeError("submit_model needs async_scheduling")
        return self._stream.submit(self.worker.execute_model, scheduler_output)

    def shutdown(self) -> None:
        if self._stream is not None:
            self._stream.shutdown()
            self._stream = None
