"""The batcher's waiting queue: priority with aging, lazy removal, deadlines.

Order key: ``(delayed, priority + arrival_ms / aging_ms, arrival_ms, seq)``. Every item ages
at the same rate, so the key never changes while it waits (as in core/request_queue.py):
an item of priority p is ahead of every item of priority q that arrives later than
``arrival + (p - q) * aging_ms``. Without aging the key is plain (priority, arrival).
Items whose timeout passed with ``timeout_action="delay"`` move behind all others.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Entry:
    """One submitted item and the future its caller awaits."""

    item: Any
    priority: int
    arrival_ms: float
    deadline_ms: float | None
    future: asyncio.Future[Any]
    seq: int = 0
    delayed: bool = False
    started: bool = False
    removed: bool = False
    key: tuple[Any, ...] = field(default=())


class BatchQueue:
    """Heap of entries with O(log n) push/pop and lazy removal."""

    def __init__(self, aging_ms: float | None):
        self.aging_ms = aging_ms
        self._heap: list[tuple[tuple[Any, ...], Entry]] = []
        self._deadlines: list[tuple[float, int, Entry]] = []
        self._seq = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _key(self, e: Entry) -> tuple[Any, ...]:
        prio = e.priority + e.arrival_ms / self.aging_ms if self.aging_ms else float(e.priority)
        return (e.delayed, prio, e.arrival_ms, e.seq)

    def push(self, entry: Entry) -> None:
        entry.seq = next(self._seq)
        entry.key = self._key(entry)
        heapq.heappush(self._heap, (entry.key, entry))
        if entry.deadline_ms is not None:
            heapq.heappush(self._deadlines, (entry.deadline_ms, entry.seq, entry))
        self._size += 1

    def _clean(self) -> None:
        while self._heap and (self._heap[0][1].removed or self._heap[0][0] != self._heap[0][1].key):
            heapq.heappop(self._heap)

    def peek(self) -> Entry | None:
        self._clean()
        return self._heap[0][1] if self._heap else None

    def oldest_arrival_ms(self) -> float | None:
        """Arrival time of the oldest live item (the window is measured from it)."""
        live = [e.arrival_ms for key, e in self._heap if not e.removed and key == e.key]
        return min(live) if live else None

    def pop_batch(self, size: int) -> list[Entry]:
        batch: list[Entry] = []
        while len(batch) < size:
            entry = self.peek()
            if entry is None:
                break
            heapq.heappop(self._heap)
            entry.removed = True
            self._size -= 1
            batch.append(entry)
        return batch

    def remove(self, entry: Entry) -> bool:
        """Drop a waiting entry (cancelled caller). False if it already left the queue."""
        if entry.removed:
            return False
        entry.removed = True
        self._size -= 1
        return True

    def delay(self, entry: Entry) -> None:
        """Move an entry behind every non-delayed one (timeout_action='delay')."""
        entry.delayed = True
        entry.key = self._key(entry)
        heapq.heappush(self._heap, (entry.key, entry))

    def next_deadline_ms(self) -> float | None:
        while self._deadlines and (self._deadlines[0][2].removed or self._deadlines[0][2].delayed):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def pop_expired(self, now_ms: float) -> list[Entry]:
        expired = []
        while (deadline := self.next_deadline_ms()) is not None and deadline <= now_ms:
            _, _, entry = heapq.heappop(self._deadlines)
            expired.append(entry)
        return expired
