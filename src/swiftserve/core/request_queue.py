"""Waiting queues: FCFS, and priority with aging; earliest deadline first within both.

Every request has a *due time* ``d``: its deadline, or ``arrival + slack_s`` when it has none
(``EngineConfig.edf_slack_s``). Without deadlines, ordering by ``d`` is ordering by arrival,
so both queues behave exactly as plain FCFS / priority-with-aging.

FCFS: earliest due time first (EDF); requests without a deadline keep their arrival order
in a deque, and a preempted one goes back to its very front.

Priority rule (lower value runs first, vLLM's convention). A waiting request's *effective*
priority improves continuously with the time it has waited::

    effective(t) = priority - (t - d) / aging_interval_s

Every waiting request ages at the same rate, so the order between two of them never
changes with ``t``: sorting by ``priority + d / aging_interval_s`` (ties by ``d``) is the
same as sorting by effective priority at any instant, and a heap suffices. Within one
priority level this is earliest-deadline-first.

Starvation bound: a request R (priority p, due d) is ahead of every request with priority q
whose due time is after ``d + (p - q) * aging_interval_s``. A due time is never before its
request's arrival, so R can be overtaken only by requests that arrive before
``d + (p - p_min) * aging_interval_s``; after that nothing new gets ahead of it. Without a
deadline ``d = arrival + slack_s``: the bound is ``slack_s + (p - p_min) * aging_interval_s``
after arrival, however many requests with deadlines keep coming.
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
    """First come, first served, earliest deadline first (see the module docstring).

    Requests without a deadline wait in a deque (a preempted one goes back to the very
    front); those with one in a heap by deadline; ``peek`` takes the earlier due time.
    """

    def __init__(self, slack_s: float = float("inf"), edf: bool = True) -> None:
        self.slack_s = slack_s
        self.edf = edf  # False: deadlines do not reorder (plain FCFS, the A/B baseline)
        self._queue: deque[Request] = deque()
        self._edf: list[tuple[float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        if request.deadline is None or not self.edf:
            self._queue.append(request)
        else:
            heapq.heappush(self._edf, (request.deadline, next(self._counter), request))

    def prepend(self, request: Request) -> None:
        if request.deadline is None or not self.edf:
            self._queue.appendleft(request)
        else:
            self.add(request)

    def peek(self) -> Request:
        if self._edf and (not self._queue or self._edf[0][0] < self._queue[0].due_time(self.slack_s)):
            return self._edf[0][2]
        return self._queue[0]

    def pop(self) -> Request:
        request = self.peek()
        if self._edf and self._edf[0][2] is request:
            heapq.heappop(self._edf)
        else:
            self._queue.popleft()
        return request

    def remove(self, request: Request) -> None:
        if request.deadline is None or not self.edf:
            self._queue.remove(request)
            return
        for i, entry in enumerate(self._edf):
            if entry[2] is request:
                self._edf[i] = self._edf[-1]
                self._edf.pop()
                heapq.heapify(self._edf)
                return
        raise ValueError(f"{request.request_id} is not queued")

    def __len__(self) -> int:
        return len(self._queue) + len(self._edf)

    def __iter__(self) -> Iterator[Request]:
        """In the order they would be popped."""
        timed = [entry[2] for entry in sorted(self._edf, key=lambda e: e[:2])]
        plain = list(self._queue)
        out: list[Request] = []
        while timed or plain:
            if timed and (not plain or timed[0].due_time(self.slack_s) < plain[0].due_time(self.slack_s)):
                out.append(timed.pop(0))
            else:
                out.append(plain.pop(0))
        return iter(out)


class PriorityQueue:
    """Lowest effective priority first (see the module docstring for the aging rule)."""

    def __init__(
        self, aging_interval_s: float = 5.0, slack_s: float = float("inf"), edf: bool = True
    ) -> None:
        if aging_interval_s <= 0:
            raise ValueError(f"aging_interval_s must be > 0, got {aging_interval_s}")
        self.aging_interval_s = aging_interval_s
        self.edf = edf
        # inf would make every request without a deadline tie: keep arrival order among them
        self.slack_s = slack_s if slack_s != float("inf") else 1e9
        self._heap: list[tuple[float, float, int, Request]] = []
        self._removed: set[int] = set()  # ids() of lazily deleted entries
        self._counter = itertools.count()
        self._size = 0

    def sort_key(self, request: Request) -> tuple[float, float]:
        due = request.due_time(self.slack_s) if self.edf else request.arrival_time + self.slack_s
        return (request.priority + due / self.aging_interval_s, due)

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


def make_queue(
    policy: str, aging_interval_s: float = 5.0, slack_s: float = float("inf"), edf: bool = True
) -> FCFSQueue | PriorityQueue:
    """The waiting queue for a scheduling policy name ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSQueue(slack_s, edf)
    if policy == "priority":
        return PriorityQueue(aging_interval_s, slack_s, edf)
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
