"""Scheduler without a model: budget, chunking, preemption, priority, no leaks, no livelock."""

from __future__ import annotations

import pytest

from swiftserve.core.block_manager import BlockManager
from swiftserve.core.messages import RunnerOutput, SchedulerOutput
from swiftserve.core.request import Request, RequestStatus
from swiftserve.core.scheduler import Scheduler
from swiftserve.sampling_params import SamplingParams

EOS = 99


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_seqs: int = 8,
    policy: str = "fcfs",
    chunked: bool = True,
    max_len: int = 256,
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(
        bm,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_chunked_prefill=chunked,
        policy=policy,
        aging_interval_s=1000.0,
    )


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    priority: int = 0,
    arrival: float = 0.0,
    first_token: int = 1,
) -> Request:
    prompt = [first_token + (i % 7) for i in range(prompt_len)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens),
        eos_token_ids=(EOS,),
        priority=priority,
        arrival_time=arrival,
        max_tokens=max_tokens,
    )


def fake_run(sched: SchedulerOutput, token: int = 5) -> RunnerOutput:
    out = RunnerOutput()
    for item in sched.scheduled:
        if item.sample:
            out.sampled_token_ids[item.request_id] = token
    return out


def run_to_end(s: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    steps = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return steps
        sched = s.schedule()
        assert sched.num_batched_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        steps.append(sched)
        s.update(sched, fake_run(sched))
    raise AssertionError("scheduler did not finish: livelock")


def test_budget_never_exceeded_and_no_block_leaked() -> None:
    s = make_scheduler(budget=16)
    for i in range(6):
        s.add_request(make_request(str(i), 10 + 7 * i, max_tokens=5, arrival=i))
    steps = run_to_end(s)
    assert all(st.num_batched_tokens <= 16 for st in steps)
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decode() -> None:
    s = make_scheduler(budget=7)
    s.add_request(make_request("short", 3, max_tokens=10))
    s.add_request(make_request("long", 20, max_tokens=2, arrival=1.0))
    first = s.schedule()
    assert {i.request_id: len(i.token_ids) for i in first.scheduled} == {"short": 3, "long": 4}
    s.update(first, fake_run(first))
    second = s.schedule()
    sizes = {i.request_id: len(i.token_ids) for i in second.scheduled}
    assert sizes == {"short": 1, "long": 6}  # decode token + prefill chunk in one step
    assert not next(i for i in second.scheduled if i.request_id == "long").sample


def test_a_prompt_chunk_leaves_room_for_the_decode_rows_behind_it() -> None:
    """A running prompt ahead of decoding requests in the running list (it arrived first)
    takes only what the budget leaves after their rows: a chunk never starves a decode row."""
    s = make_scheduler(budget=8)
    for i in range(3):
        s.add_request(make_request(f"d{i}", 2, max_tokens=20, arrival=1.0 + i))
    first = s.schedule()  # the three short prompts
    s.update(first, fake_run(first))
    s.add_request(make_request("long", 40, max_tokens=2, arrival=0.0))  # arrived first, admitted last
    second = s.schedule()
    assert {i.request_id: len(i.token_ids) for i in second.scheduled} == {
        "d0": 1,
        "d1": 1,
        "d2": 1,
        "long": 5,
    }
    s.update(second, fake_run(second))
    third = s.schedule()  # "long" now sorts first in the running list
    assert third.scheduled[0].request_id == "long"
    assert {i.request_id: len(i.token_ids) for i in third.scheduled} == {"long": 5, "d0": 1, "d1": 1, "d2": 1}


def test_no_chunking_waits_for_whole_prompt() -> None:
    s = make_scheduler(budget=16, chunked=False, max_len=16)
    s.add_request(make_request("a", 10, max_tokens=2))
    s.add_request(make_request("b", 10, max_tokens=2, arrival=1.0))
    first = s.schedule()
    assert [i.request_id for i in first.scheduled] == ["a"]
    assert len(first.scheduled[0].token_ids) == 10


def test_preemption_picks_latest_arrival_and_recomputes() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    s.add_request(make_request("old", 8, max_tokens=8, arrival=0.0))
    s.add_request(make_request("new", 8, max_tokens=8, arrival=1.0))
    preempted: list[str] = []
    for _ in range(100):
        if not s.has_unfinished():
            break
        sched = s.schedule()
        preempted.extend(sched.preempted_request_ids)
        s.update(sched, fake_run(sched))
    assert preempted and set(preempted) == {"new"}
    assert s.num_preemptions == len(preempted)
    assert s.bm.num_free_blocks == 6


def test_preemption_victim_is_worst_priority() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, policy="priority")
    s.add_request(make_request("vip-late", 8, max_tokens=8, priority=0, arrival=1.0))
    s.add_request(make_request("bulk-early", 8, max_tokens=8, priority=5, arrival=0.0))
    preempted: list[str] = []
    finish_order: list[str] = []
    for _ in range(100):
        if not s.has_unfinished():
            break
        sched = s.schedule()
        preempted.extend(sched.preempted_request_ids)
        for out in s.update(sched, fake_run(sched)):
            if out.finish_reason:
                finish_order.append(out.request_id)
    assert set(preempted) == {"bulk-early"}
    assert finish_order == ["vip-late", "bulk-early"]


def test_priority_arrival_preempts_when_seats_are_full() -> None:
    s = make_scheduler(max_seqs=1, policy="priority")
    s.add_request(make_request("bulk", 4, max_tokens=20, priority=5, arrival=0.0))
    sched = s.schedule()
    s.update(sched, fake_run(sched))
    s.add_request(make_request("urgent", 4, max_tokens=2, priority=0, arrival=1.0))
    sched = s.schedule()
    assert sched.preempted_request_ids == ("bulk",)
    assert [i.request_id for i in sched.scheduled] == ["urgent"]
    s.update(sched, fake_run(sched))  # every scheduled step's result comes back
    run_to_end(s)
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_fcfs_does_not_preempt_for_new_arrivals() -> None:
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request("first", 4, max_tokens=5, arrival=0.0))
    s.update(sched := s.schedule(), fake_run(sched))
    s.add_request(make_request("second", 4, max_tokens=5, priority=-10, arrival=1.0))
    sched = s.schedule()
    assert [i.request_id for i in sched.scheduled] == ["first"] and not sched.preempted_request_ids


def test_request_that_can_never_fit_is_rejected() -> None:
    s = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("huge", 20, max_tokens=4))


def test_stop_conditions_eos_length_and_min_tokens() -> None:
    s = make_scheduler()
    s.add_request(make_request("eos", 4, max_tokens=10))
    sched = s.schedule()
    outs = s.update(sched, fake_run(sched, token=EOS))
    assert outs[0].finish_reason == "stop" and outs[0].new_token_ids == [EOS]
    s.add_request(make_request("len", 4, max_tokens=2))
    steps = run_to_end(s)
    assert len(steps) == 2
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_abort_waiting_and_running_frees_blocks() -> None:
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request("run", 6, max_tokens=10))
    s.add_request(make_request("wait", 6, max_tokens=10, arrival=1.0))
    s.update(sched := s.schedule(), fake_run(sched))
    s.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished()
    assert s.bm.num_free_blocks == s.bm.num_blocks
    assert s.schedule().finished_request_ids == {"run", "wait"}


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", 13, max_tokens=1))
    run_to_end(s)
    s.add_request(make_request("b", 13, max_tokens=1))
    sched = s.schedule()
    item = sched.scheduled[0]
    assert item.start_pos == 12 and len(item.token_ids) == 1
    assert s.bm.prefix_hits == 12


def test_many_requests_tiny_pool_no_livelock() -> None:
    s = make_scheduler(num_blocks=8, block_size=2, budget=5, max_seqs=4, policy="priority")
    for i in range(20):
        s.add_request(make_request(str(i), 3 + i % 5, max_tokens=6, priority=i % 3, arrival=i * 0.01))
    run_to_end(s, max_steps=5000)
    assert s.bm.num_free_blocks == 8


def test_long_context_chunks_shrink_while_others_decode() -> None:
    """A prompt chunk deep into a long prompt costs its attention over the whole context: while
    other requests decode, it is capped to a full chunk's attention from scratch."""
    from swiftserve.core.step_cost import MIN_LONG_CHUNK, long_context_chunk

    assert long_context_chunk(0, 256) == 256
    assert long_context_chunk(1000, 256) == MIN_LONG_CHUNK  # sqrt(1000^2 + 256^2) - 1000 = 32
    assert long_context_chunk(100, 256) == 174  # isqrt(100^2 + 256^2) - 100
    s = make_scheduler(num_blocks=1200, budget=256, max_len=8192)
    s.add_request(make_request("chat", 3, max_tokens=40))
    s.update(first := s.schedule(), fake_run(first))  # "chat" decodes from now on
    s.add_request(make_request("doc", 3000, max_tokens=1, arrival=1.0))
    sizes = []
    for _ in range(6):
        sched = s.schedule()
        sizes.append({i.request_id: len(i.token_ids) for i in sched.scheduled})
        s.update(sched, fake_run(sched))
    assert [x["chat"] for x in sizes] == [1] * 6  # the decode row is never squeezed out
    doc = [x["doc"] for x in sizes]
    assert doc[0] == 255 and all(n < 255 for n in doc[1:])  # the first chunk takes the budget
    assert doc[-1] == MIN_LONG_CHUNK  # deep into the prompt: the floor


def test_long_prompt_alone_takes_full_chunks() -> None:
    s = make_scheduler(num_blocks=1200, budget=256, max_len=8192)
    s.add_request(make_request("doc", 3000, max_tokens=1))
    sizes = []
    for _ in range(4):
        sched = s.schedule()
        sizes.append(sched.num_batched_tokens)
        s.update(sched, fake_run(sched))
    assert sizes == [256] * 4  # nobody decoding: nothing to protect
