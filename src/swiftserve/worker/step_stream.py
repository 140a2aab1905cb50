"""StepStream: the model's steps, in order, on one thread of their own (async scheduling).

With ``async_scheduling`` the engine core schedules step N+1 while step N runs (engine/core.py).
The steps run here, one after another on a single "step" thread, the way kernels run in
order on a CUDA stream: step N+1 is queued behind step N, and its inputs are prepared only
after step N has sampled, so the runner can fill in the placeholder tokens from its own
record of what it sampled. The engine thread waits for a step's result either parked on a
condition variable (no GIL held, no core burnt) or, with ``busy_poll``, spinning on the
done flag with a yield per turn (the microsecond wake-up path, for machines with a spare
core). Every result carries the step's own run time and how long after it finished the
waiting thread woke up.

The step thread also builds the worker (load, profiling forward, KV allocation, graph
capture): all torch work of the engine happens on it. That is not tidiness. Each thread that
runs an OpenMP region gets its own team, and once a process holds more OpenMP threads than
cores, libgomp stops spinning between regions: measured on 2 cores, a batch-1 bfloat16
linear took 62 us with one team and 150 us once the main thread had also run one region,
and a whole decode step ran 2x slower. On CUDA the step thread is where the device
synchronises (logits to the host); the engine thread never blocks on the GPU.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from swiftserve.core.messages import RunnerOutput, SchedulerOutput

T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    """A finished step: the runner's output, its run time and the waiter's wake-up delay."""

    output: RunnerOutput
    seconds: float  # the step's run time on the step thread
    wakeup_s: float  # from the step's end to the waiting thread running again


class StepHandle:
    """A step queued on the stream; ``result()`` waits for it."""

    def __init__(self, future: Future[tuple[RunnerOutput, float, float]], busy_poll: bool):
        self._future = future
        self._busy_poll = busy_poll

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> StepResult:
        """Wait for the step (re-raising what it raised)."""
        future = self._future
        if self._busy_poll:
            while not future.done():
                os.sched_yield()  # releases the GIL: the step thread needs it between kernels
        output, seconds, finished_at = future.result()
        return StepResult(output, seconds, max(0.0, time.perf_counter() - finished_at))


class StepStream:
    """One thread that runs submitted steps (and any other torch work) in submission order."""

    def __init__(self, *, busy_poll: bool = False):
        self._busy_poll = busy_poll
        threads = torch.get_num_threads()  # the step thread computes with the same thread pool size
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="swiftserve-step",
            initializer=torch.set_num_threads,
            initargs=(threads,),
        )
        self._closed = threading.Event()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the step thread (after what is queued) and wait for it."""
        if self._closed.is_set():
            raise RuntimeError("the step stream is shut down")
        return self._pool.submit(fn, *args, **kwargs).result()

    def submit(self, run: Callable[[SchedulerOutput], RunnerOutput], sched: SchedulerOutput) -> StepHandle:
        """Queue one step, ``run(sched)``, behind those already queued."""
        if self._closed.is_set():
            raise RuntimeError("the step stream is shut down")
        return StepHandle(self._pool.submit(self._timed, run, sched), self._busy_poll)

    @staticmethod
    def _timed(
        run: Callable[[SchedulerOutput], RunnerOutput], sched: SchedulerOutput
    ) -> tuple[RunnerOutput, float, float]:
        start = time.perf_counter()
        output = run(sched)
        end = time.perf_counter()
        return output, end - start, end

    def shutdown(self) -> None:
        """Finish the queued steps and stop the thread."""
        self._closed.set()
        self._pool.shutdown(wait=True)
