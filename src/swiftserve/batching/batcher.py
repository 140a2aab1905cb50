"""DynamicBatcher: queue items, fire a batch when it is full or when the window closes.

A batch fires when (a) ``max_batch_size`` items wait, (b) a preferred batch size is
reached (the largest one available is taken), or (c) the oldest item has waited the
current window (``max_wait_ms``, or the adaptive window of batching/adaptive.py, capped
by ``max_wait_ms``). Items leave the queue in priority order (lower first, with aging),
so the low-priority items of a mixed queue end up batched together after the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from swiftserve.batching.adaptive import AdaptiveWindow, percentiles
from swiftserve.batching.queue import BatchQueue, Entry


class QueueFull(RuntimeError):
    """The batcher's queue holds ``max_queue_size`` items already."""


class QueueTimeout(TimeoutError):
    """The item waited longer than its timeout before its batch started."""


class BatcherClosed(RuntimeError):
    """The batcher is stopping or stopped and takes no new items."""


class BatchResultError(RuntimeError):
    """``fn`` returned a result list whose length differs from the batch's."""


def _now_ms() -> float:
    return time.monotonic() * 1000.0


class DynamicBatcher:
    """Batches calls to ``fn(list) -> list`` (sync functions run in a worker thread)."""

    def __init__(
        self,
        fn: Callable[[list[Any]], Sequence[Any] | Awaitable[Sequence[Any]]],
        *,
        max_batch_size: int,
        max_wait_ms: float,
        preferred_batch_sizes: Sequence[int] = (),
        adaptive: bool = False,
        target_p99_ms: float | None = None,
        max_queue_size: int = 0,
        priority_levels: int = 1,
        aging_ms: float | None = None,
        queue_timeout_ms: float | None = None,
        timeout_action: str = "reject",
        max_concurrent_batches: int = 1,
        min_expected_arrivals: float = 0.0,
    ):
        _check(max_batch_size >= 1, "max_batch_size must be >= 1")
        _check(max_wait_ms >= 0, "max_wait_ms must be >= 0")
        _check(
            all(1 <= p <= max_batch_size for p in preferred_batch_sizes),
            "preferred_batch_sizes must lie in [1, max_batch_size]",
        )
        _check(target_p99_ms is None or target_p99_ms > 0, "target_p99_ms must be > 0")
        _check(max_queue_size >= 0, "max_queue_size must be >= 0 (0 = unbounded)")
        _check(priority_levels >= 1, "priority_levels must be >= 1")
        _check(aging_ms is None or aging_ms > 0, "aging_ms must be > 0")
        _check(queue_timeout_ms is None or queue_timeout_ms > 0, "queue_timeout_ms must be > 0")
        _check(timeout_action in ("reject", "delay"), "timeout_action must be 'reject' or 'delay'")
        _check(max_concurrent_batches >= 1, "max_concurrent_batches must be >= 1")
        self.fn = fn
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.preferred = sorted(set(preferred_batch_sizes), reverse=True)
        self.max_queue_size = max_queue_size
        self.priority_levels = priority_levels
        self.queue_timeout_ms = queue_timeout_ms
        self.timeout_action = timeout_action
        self.controller = (
            AdaptiveWindow(max_batch_size, max_wait_ms, target_p99_ms, min_expected_arrivals)
            if adaptive
            else None
        )
        # An object whose __call__ is async counts as async too.
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__  # type: ignore[operator]
        )
        self._queue = BatchQueue(aging_ms)
        self.max_concurrent_batches = max_concurrent_batches
        self._slots: asyncio.Semaphore | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False
        # When a batch last finished while every slot was busy: a window that closed before
        # that moment could not fire on time (backlog), one that closed after it did.
        self._slot_freed_ms = -math.inf
        self._waits: deque[float] = deque(maxlen=4096)
        self._latencies: deque[float] = deque(maxlen=4096)
        self._counts = {"batches": 0, "items": 0, "failed": 0, "rejected": 0, "timed_out": 0}

    # ---- lifecycle -----------------------------------------------------------------------
    async def __aenter__(self) -> DynamicBatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._slots = asyncio.Semaphore(self.max_concurrent_batches)
            self._task = asyncio.create_task(self._loop(), name="dynamic-batcher")

    async def stop(self) -> None:
        """Stop taking items, run everything already queued, wait for running batches."""
        self._closing = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    @property
    def current_window_ms(self) -> float:
        """The window for the queue as it stands (for an empty queue: a lone new item's)."""
        if not self.controller:
            return self.max_wait_ms
        oldest = self._queue.oldest_arrival_ms()
        age = 0.0 if oldest is None else _now_ms() - oldest
        return self.controller.window_ms(len(self._queue), age)

    # ---- submission ----------------------------------------------------------------------
    async def submit(self, item: Any, priority: int = 0, timeout_ms: float | None = None) -> Any:
        """Queue one item and wait for its result (raises QueueFull, QueueTimeout, ...)."""
        if self._task is None or self._closing:
            raise BatcherClosed("the batcher is not running (use `async with batcher:`)")
        if not 0 <= priority < self.priority_levels:
            raise ValueError(f"priority must be in [0, {self.priority_levels}), got {priority}")
        if self.max_queue_size and len(self._queue) >= self.max_queue_size:
            self._counts["rejected"] += 1
            raise QueueFull(f"queue is full ({self.max_queue_size} items)")
        now = _now_ms()
        timeout = timeout_ms if timeout_ms is not None else self.queue_timeout_ms
        entry = Entry(
            item,
            priority,
            now,
            now + timeout if timeout is not None else None,
            asyncio.get_running_loop().create_future(),
        )
        self._queue.push(entry)
        if self.controller:
            self.controller.observe_arrival(now)
        assert self._wake is not None
        self._wake.set()
        try:
            return await entry.future
        except asyncio.CancelledError:
            self._queue.remove(entry)  # no-op once its batch started
            raise

    # ---- the firing loop -----------------------------------------------------------------
    async def _loop(self) -> None:
        assert self._wake is not None and self._slots is not None
        while True:
            self._expire(_now_ms())
            if not len(self._queue):
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._slots.locked():  # every batch slot busy: wait, but keep timeouts honest
                deadline = self._queue.next_deadline_ms()
                await self._sleep(None if deadline is None else max(deadline - _now_ms(), 0) / 1000)
                continue
            size, wait_s, late_ms = self._decide(_now_ms())
            if size == 0:
                await self._sleep(wait_s)
                continue
            await self._slots.acquire()
            batch = [e for e in self._queue.pop_batch(size) if not e.future.done()]
            if not batch:
                self._slots.release()
                continue
            task = asyncio.create_task(self._run_batch(batch, late_ms))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _sleep(self, seconds: float | None) -> None:
        """Wait for a wake-up (arrival, finished batch, stop) or ``seconds``."""
        assert self._wake is not None
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _decide(self, now: float) -> tuple[int, float, float]:
        """(items to fire now, 0, ms the window closed before now) or (0, seconds to wait
        before deciding again, 0)."""
        n = len(self._queue)
        if n >= self.max_batch_size:
            return self.max_batch_size, 0.0, 0.0
        for p in self.preferred:
            if n >= p:
                return p, 0.0, 0.0
        oldest = self._queue.oldest_arrival_ms()
        if oldest is None:
            return n, 0.0, 0.0
        window = self.controller.window_ms(n, now - oldest) if self.controller else self.max_wait_ms
        if self._closing or now - oldest >= window:
            late_ms = 0.0
            if self.controller:
                # Fired by the window if a slot was free when it closed; a late timer wake-up
                # does not make it a backlog, a busy function does.
                by_window = self._slot_freed_ms <= oldest + window
                self.controller.observe_fire(by_window)
                late_ms = max(0.0, now - (oldest + window)) if by_window else 0.0  # 0 if closing
            return n, 0.0, late_ms
        wake_at = oldest + window
        deadline = self._queue.next_deadline_ms()
        if deadline is not None:
            wake_at = min(wake_at, deadline)
        return 0, max(wake_at - now, 0.0) / 1000.0, 0.0

    def _expire(self, now: float) -> None:
        for entry in self._queue.pop_expired(now):
            if self.timeout_action == "delay":
                self._queue.delay(entry)
            elif self._queue.remove(entry) and not entry.future.done():
                self._counts["timed_out"] += 1
                waited = now - entry.arrival_ms
                entry.future.set_exception(QueueTimeout(f"item waited {waited:.1f} ms without starting"))

    # ---- running a batch -----------------------------------------------------------------
    async def _call(self, items: list[Any]) -> list[Any]:
        if self._is_async:
            result = await self.fn(items)  # type: ignore[misc]
        else:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(None, functools.partial(self.fn, items))
            if inspect.isawaitable(result):  # a sync callable that returned a coroutine
                result = await result
        result = list(result)  # type: ignore[arg-type]
        if len(result) != len(items):
            raise BatchResultError(f"fn returned {len(result)} results for a batch of {len(items)}")
        return result

    async def _run_batch(self, batch: list[Entry], late_ms: float = 0.0) -> None:
        try:
            start = _now_ms()
            for e in batch:
                e.started = True
                self._waits.append(start - e.arrival_ms)
            await self._settle(batch)
            cost = _now_ms() - start
            self._counts["batches"] += 1
            self._counts["items"] += len(batch)
            if self.controller:
                self.controller.observe_batch(len(batch), cost, late_ms)
        finally:
            assert self._slots is not None
            if self._slots.locked():
                self._slot_freed_ms = _now_ms()
            self._slots.release()
            if self._wake is not None:
                self._wake.set()

    async def _settle(self, batch: list[Entry]) -> None:
        """Run the batch; on an exception, bisect so only the poisoned items fail."""
        error: Exception | None = None
        try:
            results = await self._call([e.item for e in batch])
        except Exception as e:
            error = e
        if error is not None:  # bisect outside the except block: no deep exception chains
            if isinstance(error, BatchResultError) or len(batch) == 1:
                self._fail(batch, error)
            else:
                mid = len(batch) // 2
                await self._settle(batch[:mid])
                await self._settle(batch[mid:])
            return
        now = _now_ms()
        for entry, result in zip(batch, results, strict=True):
            latency = now - entry.arrival_ms
            self._latencies.append(latency)
            if self.controller:
                self.controller.observe_latency(latency)
            if not entry.future.done():
                entry.future.set_result(result)

    def _fail(self, batch: list[Entry], error: BaseException) -> None:
        self._counts["failed"] += len(batch)
        for entry in batch:
            if not entry.future.done():
                entry.future.set_exception(error)

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Batches run, mean batch size, queue-wait and latency percentiles, current window."""
        waits, lats = list(self._waits), list(self._latencies)
        batches = self._counts["batches"]
        return {
            "batches": batches,
            "items": self._counts["items"],
            "mean_batch_size": self._counts["items"] / batches if batches else 0.0,
            "failed": self._counts["failed"],
            "rejected": self._counts["rejected"],
            "timed_out": self._counts["timed_out"],
            "queued": len(self._queue),
            # one sort each: the dashboard samples this every second on the event loop
            "queue_wait_ms": percentiles(waits, (50, 90, 99)),
            "latency_ms": percentiles(lats, (50, 90, 99)),
            "current_window_ms": self.current_window_ms,
        }


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"DynamicBatcher: {message}")


def batched(**options: Any) -> Callable[[Callable[..., Any]], Callable[..., Awaitable[Any]]]:
    """Decorator: ``@batched(max_batch_size=8, max_wait_ms=5)`` on ``fn(list) -> list``.

    The wrapped coroutine takes one item; the batcher starts on first use (on the running
    loop) and is reachable as ``wrapper.batcher`` (``await wrapper.batcher.stop()``).
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        batcher = DynamicBatcher(fn, **options)

        @functools.wraps(fn)
        async def wrapper(item: Any, priority: int = 0, timeout_ms: float | None = None) -> Any:
            await batcher.start()
            return await batcher.submit(item, priority=priority, timeout_ms=timeout_ms)

        wrapper.batcher = batcher  # type: ignore[attr-defined]
        return wrapper

    return decorate
