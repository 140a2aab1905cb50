"""Waiting queues: FCFS, and priority with aging.

Priority rule (lower value runs first, vLLM's convention). A waiting request's *effective*
priority improves continuously with the time it has waited::

    effective(t) = priority - (t - arrival_time) / aging_interval_s

Every waiting request ages at the same rate, so the order between two of them never
changes with ``t``: sorting by ``priority + arrival_time / aging_interval_s`` (ties by
arrival) is the same as sorting by effective priority at any instant, and a heap suffices.

Starvation bound: a request R (priority p, arrival a) is ahead of every request with
priority q that arrives after ``a + (p - q) * aging_interval_s``. So R can be overtaken
only by requests that arrive within ``(p - p_min) * aging_interval_s`` seconds after it;
once that window has passed, nothing new gets ahead of it and it runs as soon as the
requests already ahead of it have been admitted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from swiftserve.core.request import Request


class RequestQueue(Protocol):
    """The interface the scheduler uses for its waiting requests."""

    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served; a preempted request goes back to the very front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest effective priority first (see the module docstring for the aging rule)."""

    def __init__(self, aging_interval_s: float = 5.0) -> None:
        if aging_interval_s <= 0:
            raise ValueError(f"aging_interval_s must be > 0, got {aging_interval_s}")
        self.aging_interval_s = aging_interval_s
        self._heap: list[tuple[float, float, int, Request]] = []
        self._removed: set[int] = set()  # ids() of lazily deleted entries
        self._counter = itertools.count()
        self._size = 0

    def sort_key(self, request: Request) -> tuple[float, float]:
        return (
            request.priority + request.arrival_time / self.aging_interval_s,
            request.arrival_time,
        )

    def add(self, request: Request) -> None:
        key = self.sort_key(request)
        heapq.heappush(self._heap, (key[0], key[1], next(self._counter), request))
        self._size += 1

    # A preempted request keeps its original arrival time, so it is already at the head of
    # its class relative to everything that arrived after it.
    prepend = add

    def _drop_removed(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self) -> Request:
        self._drop_removed()
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def pop(self) -> Request:
        request = self.peek()
        heapq.heappop(self._heap)
        self._size -= 1
        return request

    def remove(self, request: Request) -> None:
        if not any(entry[3] is request for entry in self._heap if id(entry[3]) not in self._removed):
            raise ValueError(f"{request.request_id} is not queued")
        self._removed.add(id(request))
        self._size -= 1

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        live = [e for e in self._heap if id(e[3]) not in self._removed]
        return iter(entry[3] for entry in sorted(live, key=lambda e: e[:3]))


def make_queue(policy: str, aging_interval_s: float = 5.0) -> FCFSQueue | PriorityQueue:
    """The waiting queue for a scheduling policy name ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(aging_interval_s)
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
