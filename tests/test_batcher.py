"""DynamicBatcher rules, with generous time margins (never flaky on a loaded machine)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from swiftserve.batching import (
    BatcherClosed,
    BatchResultError,
    DynamicBatcher,
    QueueFull,
    QueueTimeout,
    batched,
)


class Recorder:
    """A batched function that records every batch it saw."""

    def __init__(self, delay_s: float = 0.0, poison: Any = None):
        self.batches: list[list[Any]] = []
        self.delay_s = delay_s
        self.poison = poison

    async def __call__(self, items: list[Any]) -> list[Any]:
        self.batches.append(list(items))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.poison is not None and self.poison in items:
            raise RuntimeError("poisoned batch")
        return [x * 10 for x in items]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_fires_when_full_without_waiting_for_window() -> None:
    async def main() -> None:
        rec = Recorder()
        async with DynamicBatcher(rec, max_batch_size=4, max_wait_ms=600_000) as b:
            # A 10-minute window: waiting for it instead of firing when full would hang here.
            results = await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(8))), 120)
        assert results == [i * 10 for i in range(8)]
        assert [len(x) for x in rec.batches] == [4, 4]

    run(main())


def test_fires_when_window_closes() -> None:
    async def main() -> None:
        rec = Recorder()
        async with DynamicBatcher(rec, max_batch_size=100, max_wait_ms=200) as b:
            start = time.monotonic()
            assert await asyncio.gather(b.submit(1), b.submit(2)) == [10, 20]
            assert time.monotonic() - start >= 0.19
        assert rec.batches == [[1, 2]]

    run(main())


def test_preferred_batch_size_fires_early() -> None:
    async def main() -> None:
        rec = Recorder()
        async with DynamicBatcher(
            rec, max_batch_size=16, max_wait_ms=10_000, preferred_batch_sizes=(3,)
        ) as b:
            await asyncio.gather(*(b.submit(i) for i in range(3)))
        assert rec.batches == [[0, 1, 2]]

    run(main())


def test_sync_function_runs_in_worker_thread() -> None:
    import threading

    seen: list[str] = []

    def fn(items: list[int]) -> list[int]:
        seen.append(threading.current_thread().name)
        return [x + 1 for x in items]

    async def main() -> None:
        async with DynamicBatcher(fn, max_batch_size=2, max_wait_ms=1) as b:
            assert await b.submit(1) == 2
        assert seen and seen[0] != threading.main_thread().name

    run(main())


def test_priority_order_and_low_priority_grouped() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        rec = Recorder()

        async def fn(items: list[Any]) -> list[Any]:
            await gate.wait()
            return await rec(items)

        async with DynamicBatcher(fn, max_batch_size=2, max_wait_ms=0, priority_levels=3) as b:
            first = asyncio.create_task(b.submit(0))  # occupies the only batch slot
            await asyncio.sleep(0.05)
            tasks = [
                asyncio.create_task(b.submit(v, priority=p))
                for v, p in [(1, 2), (2, 0), (3, 2), (4, 0), (5, 1)]
            ]
            await asyncio.sleep(0.05)
            gate.set()
            await asyncio.gather(first, *tasks)
        assert rec.batches == [[0], [2, 4], [5, 1], [3]]

    run(main())


def test_aging_prevents_starvation() -> None:
    async def main() -> None:
        rec = Recorder(delay_s=0.02)
        async with DynamicBatcher(rec, max_batch_size=1, max_wait_ms=0, priority_levels=2, aging_ms=50) as b:
            low = asyncio.create_task(b.submit(-1, priority=1))
            high = []
            for i in range(30):  # a steady stream of high-priority work
                high.append(asyncio.create_task(b.submit(i, priority=0)))
                await asyncio.sleep(0.01)
            await asyncio.gather(low, *high)
        order = [batch[0] for batch in rec.batches]
        assert order.index(-1) < len(order) - 5  # served long before the stream ended

    run(main())


def test_queue_full() -> None:
    async def main() -> None:
        rec = Recorder(delay_s=0.2)
        async with DynamicBatcher(rec, max_batch_size=1, max_wait_ms=0, max_queue_size=2) as b:
            running = asyncio.create_task(b.submit(0))
            await asyncio.sleep(0.05)
            waiting = [asyncio.create_task(b.submit(i)) for i in (1, 2)]
            await asyncio.sleep(0)
            with pytest.raises(QueueFull):
                await b.submit(3)
            assert await asyncio.gather(running, *waiting) == [0, 10, 20]
            assert b.stats()["rejected"] == 1

    run(main())


def test_queue_timeout_reject_and_delay() -> None:
    async def main(action: str) -> list[Any]:
        rec = Recorder(delay_s=0.3)
        async with DynamicBatcher(rec, max_batch_size=1, max_wait_ms=0, timeout_action=action) as b:
            busy = asyncio.create_task(b.submit(0))
            await asyncio.sleep(0.05)
            late = asyncio.create_task(b.submit(1, timeout_ms=50))
            fresh = asyncio.create_task(b.submit(2))
            return await asyncio.gather(busy, late, fresh, return_exceptions=True)

    busy, late, fresh = run(main("reject"))
    assert busy == 0 and isinstance(late, QueueTimeout) and fresh == 20
    busy, late, fresh = run(main("delay"))
    assert (busy, late, fresh) == (0, 10, 20)


def test_cancellation_removes_waiting_item() -> None:
    async def main() -> None:
        rec = Recorder(delay_s=0.1)
        async with DynamicBatcher(rec, max_batch_size=1, max_wait_ms=0) as b:
            busy = asyncio.create_task(b.submit(0))
            await asyncio.sleep(0.02)
            doomed = asyncio.create_task(b.submit(1))
            await asyncio.sleep(0.02)
            doomed.cancel()
            assert await b.submit(2) == 20
            assert await busy == 0
        assert [1] not in rec.batches

    run(main())


def test_poisoned_item_is_isolated_by_bisection() -> None:
    async def main() -> None:
        rec = Recorder(poison=3)
        async with DynamicBatcher(rec, max_batch_size=8, max_wait_ms=10_000) as b:
            results = await asyncio.gather(*(b.submit(i) for i in range(8)), return_exceptions=True)
            assert [r for r in results if isinstance(r, Exception)] == [results[3]]
            assert isinstance(results[3], RuntimeError)
            assert [r for i, r in enumerate(results) if i != 3] == [i * 10 for i in range(8) if i != 3]
            assert await b.submit(5) == 50  # still serving

    run(main())


def test_wrong_length_result_fails_the_batch() -> None:
    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    async def main() -> None:
        async with DynamicBatcher(short, max_batch_size=2, max_wait_ms=10_000) as b:
            results = await asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True)
        assert all(isinstance(r, BatchResultError) for r in results)

    run(main())


def test_stop_drains_queued_items_and_refuses_new() -> None:
    async def main() -> None:
        rec = Recorder()
        b = DynamicBatcher(rec, max_batch_size=100, max_wait_ms=60_000)
        await b.start()
        tasks = [asyncio.create_task(b.submit(i)) for i in range(5)]
        await asyncio.sleep(0.05)
        await b.stop()  # does not wait the 60 s window: drains now
        assert [t.result() for t in tasks] == [0, 10, 20, 30, 40]
        with pytest.raises(BatcherClosed):
            await b.submit(1)

    run(main())


def test_decorator_and_stats() -> None:
    @batched(max_batch_size=4, max_wait_ms=20)
    async def double(items: list[int]) -> list[int]:
        return [2 * x for x in items]

    async def main() -> None:
        assert await asyncio.gather(*(double(i) for i in range(4))) == [0, 2, 4, 6]
        stats = double.batcher.stats()  # type: ignore[attr-defined]
        assert stats["batches"] == 1 and stats["mean_batch_size"] == 4
        assert stats["latency_ms"][99] >= stats["queue_wait_ms"][50] >= 0
        await double.batcher.stop()  # type: ignore[attr-defined]

    run(main())


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        DynamicBatcher(lambda x: x, max_batch_size=0, max_wait_ms=1)
    with pytest.raises(ValueError, match="timeout_action"):
        DynamicBatcher(lambda x: x, max_batch_size=1, max_wait_ms=1, timeout_action="drop")


def test_fires_are_told_apart_window_or_backlog() -> None:
    """A batch whose window closed while the function was busy is a backlog, whatever the
    timer's lateness; one whose window closed on an idle function fired by the window."""

    async def main() -> None:
        rec = Recorder(delay_s=0.3)
        async with DynamicBatcher(rec, max_batch_size=100, max_wait_ms=50, adaptive=True) as b:
            controller = b.controller
            assert controller is not None
            first = asyncio.create_task(b.submit(1))  # fires by its 50 ms window, runs 300 ms
            await asyncio.sleep(0.1)
            assert await b.submit(2) == 20  # its window closes while 1 runs: backlog
            await first
            third = asyncio.create_task(b.submit(3))  # alone again: by the window ...
            await asyncio.sleep(0.02)
            time.sleep(0.1)  # ... even when the loop wakes up 70 ms late (blocked here)
            assert await third == 30
            assert list(controller._fired_by_window) == [True, False, True]
            # The third batch started ~70 ms after its window closed: the plan's error
            # the controller recorded for it carries that lateness.
            assert controller._errors[-1][1] >= 40

    run(main())
