"""SLO-aware scheduling in the core (no torch): EDF, aging, deadlines, the budget planner.

The scheduler runs on a simulated clock against a known step-cost function, so the tests
check the control law itself, not the speed of this machine.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from swiftserve.config import EngineConfig
from swiftserve.core.block_manager import BlockManager
from swiftserve.core.deadlines import DeadlineKeeper
from swiftserve.core.messages import RunnerOutput
from swiftserve.core.request import Request, RequestStatus
from swiftserve.core.request_queue import FCFSQueue, PriorityQueue
from swiftserve.core.scheduler import Scheduler
from swiftserve.core.slo import BudgetPlanner, Decoding, Pending, SLOTargets
from swiftserve.core.step_cost import StepCostModel, attention_pairs
from swiftserve.sampling_params import SamplingParams


def req(
    rid: str,
    arrival: float = 0.0,
    deadline: float | None = None,
    priority: int = 0,
    prompt: int = 8,
    max_tokens: int = 8,
    ignore_eos: bool = True,
) -> Request:
    return Request(
        rid,
        list(range(1, prompt + 1)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        priority=priority,
        arrival_time=arrival,
        max_tokens=max_tokens,
        deadline=deadline,
    )


def true_cost(prompt_tokens: int, decode_rows: int) -> float:
    """The simulated machine: 4 ms per step, 0.1 ms per prompt token, 0.4 ms per decode row."""
    return 0.004 + 0.0001 * prompt_tokens + 0.0004 * decode_rows


def deep_cost(prompt_tokens: int, decode_rows: int, pairs: float) -> float:
    """A machine whose prompt attention costs 20 ns per (query, key) pair on top of true_cost:
    a 256-token chunk after 8k tokens costs 41 ms more, at the start of a prompt 0.7 ms."""
    return true_cost(prompt_tokens, decode_rows) + 2e-8 * pairs


class SimEngine:
    """A Scheduler on a simulated clock; each step advances the clock by true_cost (or by
    deep_cost when ``deep``)."""

    def __init__(
        self, targets: SLOTargets | None, max_budget: int = 2048, deep: bool = False, reread: float = 0.0
    ):
        self.deep = deep
        self.reread = reread  # seconds per context token a step with a prompt chunk also pays
        self.now = 0.0
        self.sched = Scheduler(
            BlockManager(4096, 16, enable_prefix_caching=False),
            max_num_seqs=64,
            max_num_batched_tokens=max_budget,
            max_model_len=4096,
            targets=targets,
            edf_slack_s=30.0,
            clock=lambda: self.now,
        )
        self.step_times: list[tuple[float, int]] = []  # (seconds, decode rows)
        self.finished: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self.sched.add_request(request)

    def step(self) -> list:  # type: ignore[type-arg]
        out = self.sched.schedule()
        rows = sum(1 for item in out.scheduled if len(item.token_ids) == 1)
        seconds = true_cost(out.num_batched_tokens - rows, rows)
        if self.deep:
            pairs = sum(
                attention_pairs(len(i.token_ids), i.start_pos) for i in out.scheduled if len(i.token_ids) > 1
            )
            seconds = deep_cost(out.num_batched_tokens - rows, rows, pairs)
        chunks = [i for i in out.scheduled if len(i.token_ids) > 1]
        seconds += self.reread * sum(i.start_pos + len(i.token_ids) for i in chunks)
        self.now += seconds
        self.step_times.append((seconds, rows))
        self.sched.observe_step(out, seconds)
        live = {r.request_id: r for r in self.sched.running}
        result = RunnerOutput(sampled_token_ids={i.request_id: 7 for i in out.scheduled if i.sample})
        outputs = self.sched.update(out, result)
        for o in outputs:
            if o.finish_reason is not None and o.request_id in live:
                self.finished[o.request_id] = live[o.request_id]
        return outputs


def tpot(r: Request) -> float:
    assert r.first_token_time is not None and r.finished_time is not None
    return (r.finished_time - r.first_token_time) / (r.num_output_tokens - 1)


# ---- ordering ----------------------------------------------------------------------------------
def test_fcfs_queue_is_edf_and_keeps_arrival_order_without_deadlines() -> None:
    q = FCFSQueue(slack_s=30.0)
    for r in (req("plain1", 0.0), req("late", 1.0, deadline=20.0), req("plain2", 2.0), req("soon", 3.0, 5.0)):
        q.add(r)
    q.prepend(req("preempted", -1.0))
    assert [r.request_id for r in q] == ["soon", "late", "preempted", "plain1", "plain2"]
    assert [q.pop().request_id for _ in range(len(q))] == ["soon", "late", "preempted", "plain1", "plain2"]


def test_priority_queue_is_edf_within_a_level() -> None:
    q = PriorityQueue(aging_interval_s=5.0, slack_s=30.0)
    for r in (
        req("p1-plain", 0.0, priority=1),
        req("p0-late", 0.0, deadline=25.0),
        req("p0-soon", 0.5, deadline=2.0),
        req("p0-plain", 0.0),
    ):
        q.add(r)
    assert [q.pop().request_id for _ in range(4)] == ["p0-soon", "p0-late", "p0-plain", "p1-plain"]


def test_aging_bounds_starvation_under_a_stream_of_deadlines() -> None:
    """A priority-3 request without a deadline is overtaken only by requests arriving within
    slack + 3 * aging seconds after it (the bound in core/request_queue.py)."""
    slack, aging = 30.0, 5.0
    q = PriorityQueue(aging_interval_s=aging, slack_s=slack)
    q.add(req("starving", 0.0, priority=3))
    bound = slack + 3 * aging
    for t in range(0, 120, 5):  # urgent priority-0 requests with 1 s deadlines keep coming
        q.add(req(f"urgent@{t}", float(t), deadline=t + 1.0))
    order = [r.request_id for r in q]
    ahead = order[: order.index("starving")]
    assert ahead and all(float(rid.split("@")[1]) < bound for rid in ahead)
    assert any(float(rid.split("@")[1]) >= bound for rid in order[order.index("starving") + 1 :])


# ---- deadlines -------------------------------------------------------------------------------
def test_expired_and_infeasible_deadlines_fail_early_with_their_error() -> None:
    sim = SimEngine(targets=None)
    for i in range(4):  # warm the cost model on real-looking steps
        sim.add(req(f"warm{i}", 0.0, prompt=64 * (i + 1), max_tokens=30))
    while sim.sched.has_unfinished():
        sim.step()
    assert sim.sched.cost.ready
    now = sim.now
    sim.add(req("past", now - 1.0, deadline=now - 0.01))
    # 400 decode steps of >= 4 ms cannot fit in 0.2 s
    sim.add(req("hopeless", now, deadline=now + 0.2, max_tokens=400))
    sim.add(req("fine", now, deadline=now + 5.0, max_tokens=10))
    outputs = sim.step()
    failed = {o.request_id: o for o in outputs if o.finish_reason == "deadline_exceeded"}
    assert set(failed) == {"past", "hopeless"}
    assert "passed" in str(failed["past"].stop_reason)
    assert "cannot finish" in str(failed["hopeless"].stop_reason)
    stats = sim.sched.slo_stats()
    assert stats["deadline_expired"] == 1 and stats["deadline_infeasible"] == 1
    assert stats["deadline_wasted_tokens"] == 0  # failed before any compute
    while sim.sched.has_unfinished():
        sim.step()
    assert sim.finished["fine"].status == RequestStatus.FINISHED_LENGTH
    assert sim.sched.bm.num_free_blocks == sim.sched.bm.num_blocks


def test_early_failure_bounds_decode_by_the_fastest_step_not_the_average() -> None:
    # decode steps alternate 10 and 30 ms (average 20): 50 tokens need >= 0.5 s, not 1.0 s
    cost = StepCostModel(refit_every=1, min_samples=4)
    for i in range(40):
        cost.observe(0, 4, 0.010 if i % 2 else 0.030)
        cost.observe(64 * (1 + i % 4), 4, 0.020 + 0.0002 * 64 * (1 + i % 4))
    assert cost.ready and cost.predict(0, 4) * 50 > 0.8  # the average would fail "feasible"
    assert cost.fastest_decode(4) == 0.010 and cost.fastest_decode(2) == cost.predict(0, 2)
    keeper = DeadlineKeeper(cost)
    keeper.track(feasible := req("feasible", 0.0, deadline=0.8, max_tokens=50), +1)
    keeper.track(hopeless := req("hopeless", 0.0, deadline=0.3, max_tokens=50), +1)
    running = [req(f"r{i}", prompt=4, max_tokens=100) for i in range(3)]
    for r in running:
        r.num_computed_tokens = r.num_tokens  # decoding
    assert keeper.due(0.0, running, [feasible, hopeless]) == [hopeless]


def test_a_running_request_past_its_deadline_frees_its_blocks() -> None:
    sim = SimEngine(targets=None)
    sim.add(req("r", 0.0, deadline=0.05, max_tokens=1000, ignore_eos=False))  # no lower bound
    sim.step()
    assert sim.sched.num_running == 1 and sim.sched.bm.num_free_blocks < sim.sched.bm.num_blocks
    while sim.now < 0.05:
        sim.step()
    outputs = sim.step()
    assert [o.finish_reason for o in outputs] == ["deadline_exceeded"]
    assert sim.sched.bm.num_free_blocks == sim.sched.bm.num_blocks
    assert sim.sched.slo_stats()["deadline_wasted_tokens"] > 0


# ---- the budget planner ------------------------------------------------------------------------
def run_burst(targets: SLOTargets | None) -> SimEngine:
    """16 long decodes start; once they run, a burst of 24 prompts of 1,024 tokens arrives."""
    sim = SimEngine(targets)
    rng = random.Random(0)
    for i in range(16):
        sim.add(req(f"steady{i}", 0.0, prompt=rng.randint(32, 96), max_tokens=120))
    for _ in range(30):
        sim.step()
    for i in range(24):
        sim.add(req(f"burst{i}", sim.now, prompt=1024, max_tokens=20))
    while sim.sched.has_unfinished():
        sim.step()
    return sim


def test_planner_keeps_tpot_inside_the_target_while_a_burst_arrives() -> None:
    target = 0.02  # 20 ms; a decode step of 16 rows costs ~10 ms, the fixed budget's ~200 ms
    adaptive = run_burst(SLOTargets(ttft_s=2.0, tpot_s=target))
    fixed = run_burst(None)
    steady = [f"steady{i}" for i in range(16)]
    assert max(tpot(adaptive.finished[r]) for r in steady) <= target
    assert max(tpot(fixed.finished[r]) for r in steady) > target  # what the planner prevents
    # every burst request was still served (no starvation), and its first token came
    burst = [adaptive.finished[f"burst{i}"] for i in range(24)]
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in burst)
    assert adaptive.sched.planner is not None and adaptive.sched.planner.last_budget <= 2048


def fitted_model() -> StepCostModel:
    model = StepCostModel(min_samples=4, refit_every=1)
    for k, rows in [(0, 8), (256, 8), (512, 4), (1024, 2), (128, 16), (0, 32)]:
        model.observe(k, rows, true_cost(k, rows))
    assert model.ready
    return model


# Requests past their first token (TPOT target 20 ms; 8 rows decode in 7.2 ms on true_cost):
FRESH = Decoding(0, 0.0, 100)  # 100 tokens to go: plenty of slack
TIGHT = Decoding(50, 1.123, 10)  # behind: 5 ms of stall left over its life, nothing to spend now
LOST = Decoding(50, 1.5, 10)  # cannot make 20 ms any more, whatever happens


def test_planner_fits_the_chunk_to_the_smallest_slack_and_ignores_the_lost() -> None:
    planner = BudgetPlanner(SLOTargets(tpot_s=0.02), 4096, fitted_model())
    prompt = [Pending(0.0, 3000, new=False)]  # a long prompt being prefilled
    assert planner.plan([FRESH] * 8, prompt) == 8 + 3000  # slack for the whole prompt
    middle = Decoding(50, 0.95, 10)  # ahead of target: ~63 ms it may spend now
    budget = planner.plan([FRESH] * 6 + [middle, LOST], prompt)
    chunk = budget - 8
    assert planner.lost == [7] and 0 < chunk < 4096 - 8
    stall = true_cost(chunk, 8) - true_cost(0, 8)
    assert stall <= planner.min_slack * 1.01 < true_cost(chunk + 16, 8) - true_cost(0, 8)
    assert planner.plan([FRESH] * 7 + [TIGHT], prompt) == 8  # no slack to spend: decode only
    starved = [Pending(planner.MAX_WAIT_S + 1, 3000, new=False)]
    assert planner.plan([FRESH] * 7 + [TIGHT], starved) > 8  # but no prompt waits forever
    assert planner.plan([LOST] * 8, prompt) == 4096  # all lost: nobody to protect
    # admitting a request makes every later decode step dearer by a row: a 64-token prompt
    # (6.4 ms) costs a request with 32+ tokens to go 6.4 + 32 x 0.4 ms of its slack
    assert planner.plan([Decoding(50, 1.2, 64)] * 8, [Pending(0.0, 64)]) == 8 + 64  # 46 ms to spend
    assert planner.plan([Decoding(50, 1.235, 64)] * 8, [Pending(0.0, 64)]) == 8  # 11 ms


def test_planner_rescues_a_late_prompt_only_when_that_saves_more_than_it_breaks() -> None:
    """A rescue must save ``RESCUE_COST`` (2) prompts per decoding request it breaks: the
    broken one has had its compute, a rescued prompt's own TPOT still has to hold."""
    planner = BudgetPlanner(SLOTargets(ttft_s=0.5, tpot_s=0.02), 4096, fitted_model())
    late = Pending(0.48, 64)  # its first token comes in time only if it goes now
    assert planner.plan([TIGHT] + [FRESH] * 7, [Pending(0.0, 64)]) == 8  # not late: waits
    assert not planner.ttft_risk
    assert planner.plan([FRESH] * 8, [late, late]) == 8 + 128  # saves two, breaks none (fits anyway)
    assert planner.plan([TIGHT] + [FRESH] * 7, [late]) == 8  # would break one to save one
    assert planner.ttft_risk
    assert planner.plan([TIGHT] + [FRESH] * 7, [late, late]) == 8 + 128  # breaks one, saves two
    assert planner.plan([TIGHT] * 2 + [FRESH] * 6, [late, late]) == 8  # breaks two, saves two
    assert planner.plan([TIGHT] + [FRESH] * 7, [Pending(0.9, 64)] * 2) == 8  # lost: not rescued
    # once rescuing (paying the step's cost anyway), whole prompts that break no one more come too
    assert planner.plan([TIGHT] + [FRESH] * 7, [late, late, Pending(0.0, 32)]) == 8 + 160


def test_feedback_tightens_on_a_breach_and_relaxes_with_headroom() -> None:
    planner = BudgetPlanner(SLOTargets(tpot_s=0.02), 2048, StepCostModel())
    start = planner.margin
    for _ in range(16):
        planner.observe_finished(0.1, 0.03)  # TPOT P99 30 ms > 20 ms
    tightened = planner.margin
    assert tightened > start
    for _ in range(64):
        planner.observe_finished(0.1, 0.01)
    assert planner.margin < tightened


def test_step_cost_model_recovers_the_cost_function() -> None:
    model = StepCostModel()
    rng = random.Random(1)
    for _ in range(200):
        k, rows = rng.randint(0, 2048), rng.randint(0, 64)
        model.observe(k, rows, true_cost(k, rows) * rng.uniform(0.98, 1.02))
    fixed, per_token, per_row = model.coef
    assert model.ready
    assert abs(per_token - 1e-4) < 1e-5 and abs(per_row - 4e-4) < 1e-4 and abs(fixed - 0.004) < 1e-3
    assert model.max_prompt_tokens(0.02, 16) == pytest.approx((0.02 - 0.004 - 16 * 4e-4) / 1e-4, rel=0.1)


def test_step_cost_model_keeps_chunk_costs_through_a_long_run_of_decode_steps() -> None:
    """Steps with prompt tokens have their own window: 1,000 decode-only steps in a row (a
    stream decoding while a long prompt waits) do not make the model forget what a chunk
    costs, jump and attention term included."""
    model = StepCostModel(window=256, min_samples=4, refit_every=1)
    rng = random.Random(2)

    def cost(k: int, rows: int, pairs: float) -> float:
        return deep_cost(k, rows, pairs) + (0.03 if k else 0.0)

    for _ in range(40):
        k, ctx, rows = rng.randint(16, 1024), rng.choice([0, 4000, 8000]), rng.randint(1, 8)
        model.observe(k, rows, cost(k, rows, attention_pairs(k, ctx)), attention_pairs(k, ctx))
    for _ in range(1000):
        rows = rng.randint(1, 8)
        model.observe(0, rows, cost(0, rows, 0.0))
    pairs = attention_pairs(1024, 8000)
    assert model.predict(1024, 4, pairs) == pytest.approx(cost(1024, 4, pairs), rel=0.05)
    assert model.predict(0, 4) == pytest.approx(cost(0, 4, 0.0), rel=0.05)


def test_targets_and_timeouts_are_validated() -> None:
    with pytest.raises(ValueError, match="tpot_s"):
        SLOTargets(tpot_s=0.0)
    with pytest.raises(ValueError, match="target_ttft_ms"):
        EngineConfig(target_ttft_ms=-5)
    with pytest.raises(ValueError, match="edf_slack_s"):
        EngineConfig(edf_slack_s=0)
    assert EngineConfig(target_tpot_ms=30).target_tpot_ms == 30


def test_without_deadline_scheduling_deadlines_only_count_waste() -> None:
    """The A/B baseline: no EDF, no early failure; an abort past the deadline counts as waste."""
    sim = SimEngine(targets=None)
    sim.sched = Scheduler(
        BlockManager(512, 16, enable_prefix_caching=False),
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        deadline_scheduling=False,
        clock=lambda: sim.now,
    )
    sim.add(req("plain", 0.0))
    sim.add(req("urgent", 0.0, deadline=0.001, max_tokens=50))
    assert [r.request_id for r in sim.sched.waiting] == ["plain", "urgent"]  # arrival order
    for _ in range(3):
        assert not [o for o in sim.step() if o.finish_reason == "deadline_exceeded"]
    assert sim.now > 0.001 and sim.sched.num_running == 2
    sim.sched.finish_requests(["urgent"], RequestStatus.FINISHED_ABORTED)  # the frontend's timer
    stats = sim.sched.slo_stats()
    assert stats["deadline_expired"] == 0 and stats["deadline_wasted_tokens"] > 0


def test_step_log_records_plan_prediction_and_measurement(tmp_path: Path, llama_dir: Path) -> None:
    import json

    from swiftserve import LLM, SamplingParams

    log = tmp_path / "steps.jsonl"
    llm = LLM(model=str(llama_dir), step_log=str(log), target_tpot_ms=50.0, max_num_batched_tokens=16)
    llm.generate([{"prompt_token_ids": list(range(5, 45))}] * 2, SamplingParams(max_tokens=8), use_tqdm=False)
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(entries) == llm.engine.scheduler.num_steps
    assert all(e["measured_s"] > 0 and e["budget"] >= 1 and "margin" in e for e in entries)
    assert any(e["prompt_tokens"] > 0 for e in entries) and any(e["decode_rows"] > 0 for e in entries)


def test_cost_model_fits_the_prefill_jump_and_the_planner_takes_big_chunks() -> None:
    """Where any prompt token makes a step cost a fixed amount more (AMX CPUs: 17 -> 56 ms),
    the model fits that jump once both kinds of step are seen, and a late prompt gets one
    big chunk instead of many small ones that would each pay it."""
    jump = 0.03

    def cost(k: int, rows: int) -> float:
        return true_cost(k, rows) + (jump if k else 0.0)

    model = StepCostModel(min_samples=4, refit_every=1)
    rng = random.Random(3)
    for i in range(64):
        k, rows = (0 if i % 2 else rng.randint(1, 2048)), rng.randint(1, 32)
        model.observe(k, rows, cost(k, rows))
    assert model.jump == pytest.approx(jump, rel=0.2)
    assert model.predict(0, 16) == pytest.approx(cost(0, 16), rel=0.1)
    assert model.predict(100, 16) == pytest.approx(cost(100, 16), rel=0.1)
    big = model.efficient_chunk()
    assert big == pytest.approx(4 * jump / 1e-4, rel=0.2)  # prompt work >= 4x the jump it pays
    # 16 rows decode in ~10 ms (target 40 ms); with 80 ms to spend a chunk of a long prompt
    # would be ~500 tokens, below the efficient one: decode alone (requests with less slack
    # finish first); a short prompt that fits whole goes; with 200 ms, an efficient chunk
    planner = BudgetPlanner(SLOTargets(tpot_s=0.04), 4096, model)
    some, more = [Decoding(50, 1.976, 10)] * 16, [Decoding(50, 1.856, 10)] * 16
    long_prompt = [Pending(0.0, 4000, new=False)]
    assert 0.07 < planner.plan(some, long_prompt) * 0 + planner.min_slack < 0.09
    assert planner.plan(some, long_prompt) == 16
    assert planner.plan(some, [Pending(0.0, 64)]) == 16 + 64
    chunk = planner.plan(more, long_prompt) - 16
    assert chunk >= big * 0.95 and cost(chunk, 16) - cost(0, 16) <= 0.2 * 1.01


def test_cost_model_fits_the_attention_context_term() -> None:
    """Chunks deep in a long prompt cost more per token (their attention reaches back over the
    whole context): the model fits a per-pair term once it has seen such steps, and the
    largest chunk it allows after a long context fits the time asked for."""
    model = StepCostModel(min_samples=4, refit_every=1)
    rng = random.Random(5)
    for _ in range(200):
        k, rows, ctx = rng.randint(0, 1024), rng.randint(1, 32), rng.choice([0, 0, 2000, 8000])
        pairs = attention_pairs(k, ctx) if k else 0.0
        model.observe(k, rows, deep_cost(k, rows, pairs), pairs)
    assert model.per_pair == pytest.approx(2e-8, rel=0.1)
    for ctx in (0, 1000, 8000):
        c = model.max_prompt_tokens(0.03, 8, context=ctx)
        assert deep_cost(c, 8, attention_pairs(c, ctx)) <= 0.03 * 1.02
        assert deep_cost(c + 8, 8, attention_pairs(c + 8, ctx)) > 0.03 * 0.98  # the largest, near enough
    assert model.max_prompt_tokens(0.03, 8, context=8000) < model.max_prompt_tokens(0.03, 8) / 2


def test_planner_keeps_tpot_while_a_long_prompt_is_prefilled() -> None:
    """8 requests decode; a 6,000-token prompt arrives. With a TPOT target the decoding
    requests' TPOT stays within it (the prompt's chunks spend their slack, no more); the
    default (sqrt cap only) lets steps deep in the prompt cost several times the target."""

    def run(targets: SLOTargets | None, max_tokens: int) -> SimEngine:
        sim = SimEngine(targets, deep=True)
        for i in range(8):
            sim.add(req(f"steady{i}", 0.0, prompt=64, max_tokens=max_tokens))
        for _ in range(40):
            sim.step()
        sim.add(req("long", sim.now, prompt=6000, max_tokens=2))
        while sim.sched.has_unfinished():
            sim.step()
        return sim

    target = 0.03
    for max_tokens in (120, 400):  # little slack left when the prompt comes, and plenty
        adaptive = run(SLOTargets(tpot_s=target), max_tokens)
        assert max(tpot(adaptive.finished[f"steady{i}"]) for i in range(8)) <= target
        assert adaptive.finished["long"].status == RequestStatus.FINISHED_LENGTH
    fixed = run(None, 400)
    assert max(seconds for seconds, rows in fixed.step_times if rows) > 3 * target


def test_slack_holds_tpot_where_the_cost_model_misses_a_cost() -> None:
    """A machine where a step with a prompt chunk also re-reads that prompt's whole context
    (2 us a token, ~12 ms at 6k: a cost the model has no term for, as on CPUs with a paged
    cache). Slack is measured (time since each request's first token), not predicted: the
    decoding requests' TPOT holds, their mean gap over the prefill stays within the target
    plus what they may spend at once, and the prompt still advances in efficient chunks."""
    target = 0.03
    sim = SimEngine(SLOTargets(tpot_s=target), deep=True, reread=2e-6)
    for i in range(8):
        sim.add(req(f"steady{i}", 0.0, prompt=64, max_tokens=2000))
    for _ in range(40):
        sim.step()
    first = len(sim.step_times)
    long = req("long", sim.now, prompt=6000, max_tokens=2)
    sim.add(long)
    while long.first_token_time is None:
        sim.step()
    last = len(sim.step_times)
    while sim.sched.has_unfinished():
        sim.step()
    assert max(tpot(sim.finished[f"steady{i}"]) for i in range(8)) <= target
    during = [seconds for seconds, rows in sim.step_times[first:last] if rows]
    planner = sim.sched.planner
    assert planner is not None
    at_once = planner.BANK_STEPS * target + planner.HORIZON_STEPS * target  # bank + horizon, at most
    assert sum(during) <= target * len(during) + at_once
    assert sum(seconds for seconds, _ in sim.step_times[first:last]) < 60 * target * 6000 / 2048  # no crawl


def test_triage_defers_prompts_that_will_miss_ttft_behind_those_that_can_make_it() -> None:
    """Goodput counts only requests meeting every target: a prompt that will miss its TTFT
    whatever happens waits behind one that can still make it, unless it has waited so long
    (``LOST_WAIT_TARGETS`` targets) that deferring it more would starve it."""
    sim = SimEngine(SLOTargets(ttft_s=0.5, tpot_s=0.02), max_budget=256)
    for k, rows in [(0, 8), (256, 8), (512, 4), (1024, 2), (128, 16), (0, 32)] * 4:
        sim.sched.cost.observe(k, rows, true_cost(k, rows))
    sim.now = 10.0
    ancient, late, fresh = (
        req(n, a, prompt=200) for n, a in [("ancient", 0.0), ("late", 9.0), ("fresh", 9.9)]
    )
    for r in (ancient, late, fresh):
        sim.add(r)
    out = sim.sched.schedule()
    assert [i.request_id for i in out.scheduled] == ["ancient", "fresh"]  # 200 + a 56-token chunk
    assert late.slo_lost and not fresh.slo_lost and not ancient.slo_lost
