"""Waiting queues: FCFS order, priority order, and the aging bound."""

from __future__ import annotations

import pytest

from swiftserve.core.request import Request
from swiftserve.core.request_queue import FCFSQueue, PriorityQueue, make_queue
from swiftserve.sampling_params import SamplingParams


def req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1], SamplingParams(), priority=priority, arrival_time=arrival)


def drain(q: FCFSQueue | PriorityQueue) -> list[str]:
    return [q.pop().request_id for _ in range(len(q))]


def test_fcfs_order_and_prepend() -> None:
    q = FCFSQueue()
    for i in range(3):
        q.add(req(str(i), arrival=i))
    q.prepend(req("back"))
    assert drain(q) == ["back", "0", "1", "2"]


def test_priority_lower_value_first_ties_by_arrival() -> None:
    q = PriorityQueue(aging_interval_s=1e9)
    q.add(req("low", priority=5, arrival=0.0))
    q.add(req("high-late", priority=0, arrival=2.0))
    q.add(req("high-early", priority=0, arrival=1.0))
    assert drain(q) == ["high-early", "high-late", "low"]


def test_aging_bound() -> None:
    """A priority-p request is ahead of any priority-q request arriving later than
    arrival + (p - q) * aging_interval_s, and behind those arriving earlier than that."""
    interval = 2.0
    q = PriorityQueue(aging_interval_s=interval)
    old = req("old", priority=10, arrival=0.0)
    q.add(old)
    bound = (10 - 0) * interval
    q.add(req("before-bound", priority=0, arrival=bound - 0.5))
    q.add(req("after-bound", priority=0, arrival=bound + 0.5))
    assert drain(q) == ["before-bound", "old", "after-bound"]


def test_remove_and_iter() -> None:
    q = PriorityQueue()
    a, b, c = req("a", 1, 0.0), req("b", 0, 0.1), req("c", 2, 0.2)
    for r in (a, b, c):
        q.add(r)
    q.remove(b)
    assert [r.request_id for r in q] == ["a", "c"]
    assert len(q) == 2
    assert drain(q) == ["a", "c"]
    with pytest.raises(ValueError):
        q.remove(b)


def test_make_queue_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_queue("lifo")
