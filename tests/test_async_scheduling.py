"""Async scheduling: step N+1 scheduled before step N's result is applied.

The scheduler runs here against a deterministic fake runner that keeps its own record of
sampled tokens (as worker/model_runner.py does) and fills in placeholders from it. Every
regime (chunked prefill, preemption under a small pool, EOS and length stops, the prefix
cache, the priority policy) must give exactly the tokens of the one-step-at-a-time loop.
The engine-level twin is tests/test_model_vs_hf.py's ``async-*`` variants (real model,
transformers as the reference).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from server_utils import Server, greedy_texts_match_offline, leave_stream_early, running_server
from swiftserve import LLM, SamplingParams
from swiftserve.config import EngineConfig
from swiftserve.core.block_manager import BlockManager
from swiftserve.core.messages import PLACEHOLDER, RunnerOutput, SchedulerOutput
from swiftserve.core.request import Request, RequestStatus
from swiftserve.core.scheduler import Scheduler

EOS = 7


def next_token(tokens: list[int]) -> int:
    """The fake model: a function of the whole sequence, so any wrong input token shows."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 2654435761 >> 7) % 97 + 3


class FakeRunner:
    """Keeps per-request token records like the model runner: placeholders read from them."""

    def __init__(self) -> None:
        self.seqs: dict[str, list[int]] = {}  # prompt + sampled, as this runner knows it
        self.placeholders_seen = 0

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for rid in sched.finished_request_ids:
            self.seqs.pop(rid, None)
        for new in sched.new_requests:
            self.seqs[new.request_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
        out = RunnerOutput()
        for item in sched.scheduled:
            seq = self.seqs[item.request_id]
            for i, token in enumerate(item.token_ids):
                pos = item.start_pos + i
                if token == PLACEHOLDER:
                    self.placeholders_seen += 1
                else:  # a known token must be exactly the one this runner holds
                    assert seq[pos] == token, (item.request_id, pos)
            end = item.start_pos + len(item.token_ids)
            if item.sample:
                assert end == len(seq), "sampling must continue the sequence"
                token = next_token(seq[:end])
                seq.append(token)
                out.sampled_token_ids[item.request_id] = token
        return out


def make(policy: str = "fcfs", num_blocks: int = 64, budget: int = 16, async_mode: bool = False) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, 4),
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=128,
        policy=policy,
        aging_interval_s=1000.0,
        async_scheduling=async_mode,
    )


def requests() -> list[Request]:
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    out = []
    for i, (n, max_tokens) in enumerate([(5, 12), (19, 30), (9, 1), (30, 20), (3, 40), (11, 25)]):
        prompt = (
            shared + [20 + (i * 13 + j) % 50 for j in range(n)] if i % 2 else [30 + i + j for j in range(n)]
        )
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=i == 4)
        out.append(
            Request(
                f"r{i}",
                prompt,
                params,
                eos_token_ids=(EOS,),
                priority=i % 3,
                arrival_time=i,
                max_tokens=max_tokens,
            )
        )
    return out


def run(s: Scheduler, pipelined: bool) -> tuple[dict[str, tuple[list[int], str]], FakeRunner]:
    """Drive the scheduler: one step at a time, or schedule N+1 before applying N."""
    runner = FakeRunner()
    done: dict[str, tuple[list[int], str]] = {}
    tokens: dict[str, list[int]] = {}
    in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None
    for _ in range(2000):
        if not s.has_unfinished() and in_flight is None:
            return done, runner
        launched = None
        if s.has_unfinished():
            sched = s.schedule()
            launched = (sched, runner.execute(sched))  # the runner runs steps in order
        if not pipelined:
            in_flight, launched = launched, None
        if in_flight is not None:
            for out in s.update(*in_flight):
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    done[out.request_id] = (tokens.pop(out.request_id), out.finish_reason)
        in_flight = launched
    raise AssertionError("livelock")


@pytest.mark.parametrize(
    "setup",
    [
        {},
        {"budget": 5},
        {"num_blocks": 18},
        {"num_blocks": 18, "policy": "priority"},
    ],
    ids=["default", "chunk-5", "preempt", "preempt-priority"],
)
def test_pipelined_equals_step_by_step(setup: dict) -> None:
    results = {}
    for pipelined in (False, True):
        s = make(**setup, async_mode=pipelined)
        for request in requests():
            s.add_request(request)
        results[pipelined], runner = run(s, pipelined)
        assert s.bm.num_free_blocks == s.bm.num_blocks, "KV blocks leaked"
        assert (runner.placeholders_seen > 0) == pipelined
        if "num_blocks" in setup:
            assert s.num_preemptions > 0
    assert results[True] == results[False]
    assert len(results[True]) == len(requests())
    assert {reason for _, reason in results[True].values()} == {"stop", "length"}


def test_request_at_its_limit_is_not_scheduled_again() -> None:
    """A placeholder in flight that reaches max_tokens: the next step leaves the request out."""
    s = make(async_mode=True)
    s.add_request(Request("one", [30, 31, 32], SamplingParams(max_tokens=1), max_tokens=1))
    first = s.schedule()
    assert [i.sample for i in first.scheduled] == [True]
    second = s.schedule()  # before the first step's result: nothing left to compute
    assert second.scheduled == []
    outs = s.update(first, FakeRunner().execute(first))
    assert outs[0].finish_reason == "length" and not s.has_unfinished()
    s.update(second, RunnerOutput())
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_result_of_a_finished_request_never_reaches_a_new_one_with_its_id() -> None:
    s = make(async_mode=True)
    runner = FakeRunner()
    s.add_request(Request("x", [40, 41, 42, 43], SamplingParams(max_tokens=8), max_tokens=8))
    step1 = s.schedule()
    out1 = runner.execute(step1)
    step2 = s.schedule()  # "x" decodes its placeholder
    out2 = runner.execute(step2)
    s.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    s.update(step1, out1)
    s.add_request(Request("x", [50, 51], SamplingParams(max_tokens=3), max_tokens=3))
    step3 = s.schedule()  # the new "x" is running before the old one's last step is back
    assert s.requests["x"].status == RequestStatus.RUNNING
    assert s.update(step2, out2) == []  # the old "x"'s token is dropped
    assert s.requests["x"].output_token_ids == []
    assert [o.new_token_ids for o in s.update(step3, runner.execute(step3))] == [[next_token([50, 51])]]


def test_config_refuses_what_async_scheduling_cannot_do() -> None:
    with pytest.raises(ValueError, match="busy_poll needs async_scheduling"):
        EngineConfig(busy_poll=True)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(async_scheduling=True, speculative_config={"method": "ngram"})


# ---- through a real server ----------------------------------------------------------------
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range("]


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"SWIFTSERVE_INJECT_STEP_DELAY_S": "0.01"}  # keeps a stream in flight to abort it
    args = ("--max-model-len", "256", "--async-scheduling", "--busy-poll")
    with running_server(llama_dir, *args, env=env, log_dir=tmp_path_factory.mktemp("async")) as s:
        yield s


def test_server_with_async_scheduling_matches_the_offline_engine(llama_dir: Path, server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    reference = greedy_texts_match_offline(llama_dir, client, PROMPTS)
    stream = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == reference[0]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=None, prompt="x", max_tokens=-1)  # type: ignore[arg-type]


def test_abort_mid_stream_frees_the_kv_blocks(server: Server) -> None:
    leave_stream_early(server)
    metrics: dict[str, float] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics.get("swiftserve:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metrics["swiftserve:num_requests_running"] == 0  # 200 tokens at >= 10 ms would still run
    assert metrics["swiftserve:kv_cache_usage_perc"] == 0


def test_sampled_outputs_equal_sync_with_seeds_n_stops_and_a_schema() -> None:
    """Seeded sampling, n > 1, stop strings and a JSON schema (the grammar advances in the
    runner as it samples): the overlapped loop gives exactly the one-step-at-a-time outputs."""
    from swiftserve.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    guided = SamplingParams(
        temperature=0.8, seed=3, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)
    )
    several = SamplingParams(temperature=0.9, seed=5, max_tokens=30, n=3, stop=["e"])
    results = []
    for overlap in (False, True):
        llm = LLM(progress=False, async_scheduling=overlap)  # the demo model
        texts = [o.outputs[0].text for o in llm.generate(["{", "x", "hello", "y"], guided, use_tqdm=False)]
        texts += [
            c.text for o in llm.generate(["hello world", "abc"], several, use_tqdm=False) for c in o.outputs
        ]
        results.append(texts)
    assert results[0] == results[1]
    assert all("a" in json.loads(t) for t in results[1][:4])
