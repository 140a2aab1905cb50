"""Data parallel through a real server: two engine processes behind one API server give the
same greedy tokens as one engine, both receive work, an abort reaches the replica that owns
the request, a killed replica takes the server down (non-zero exit) as a dead engine does.
Placement and configuration errors are checked without a model."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from server_utils import Server, greedy_texts_match_offline, leave_stream_early, running_server
from swiftserve import LLM
from swiftserve.config import EngineConfig
from swiftserve.engine.placement import numa_order, parse_cpulist, replica_cores

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(", "x = [", "while True:"]


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # a slow step keeps a request in flight long enough to abort it mid-way
    env = {"SWIFTSERVE_INJECT_STEP_DELAY_S": "0.01"}
    args = ("--max-model-len", "256", "--data-parallel-size", "2")
    with running_server(llama_dir, *args, env=env, log_dir=tmp_path_factory.mktemp("dp")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _per_engine(server: Server, name: str) -> list[float]:
    metrics = server.metrics()
    return [metrics[f'swiftserve:engine_{name}{{engine="{i}"}}'] for i in range(2)]


def test_same_greedy_tokens_as_one_engine_and_both_replicas_work(
    llama_dir: Path, server: Server, client: openai.OpenAI
) -> None:
    greedy_texts_match_offline(llama_dir, client, PROMPTS)
    routed = _per_engine(server, "routed_requests")
    assert all(n > 0 for n in routed), routed
    assert all(n > 0 for n in _per_engine(server, "num_steps"))


def test_abort_reaches_the_owning_replica(server: Server) -> None:
    leave_stream_early(server)
    running = [1.0, 1.0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = _per_engine(server, "num_requests_running")
        if running == [0.0, 0.0]:
            break
        time.sleep(0.1)
    assert running == [0.0, 0.0]  # 200 tokens at >= 10 ms a step would still be running
    assert _per_engine(server, "kv_cache_usage_perc") == [0.0, 0.0]


def test_killed_replica_takes_the_server_down(llama_dir: Path, tmp_path: Path) -> None:
    args = ("--max-model-len", "256", "--data-parallel-size", "2")
    with running_server(llama_dir, *args, log_dir=tmp_path) as s:
        children = _children(s.proc.pid)
        assert len(children) >= 2, children
        os.kill(children[-1], signal.SIGKILL)
        try:
            code = s.proc.wait(timeout=20)
        except Exception:
            code = None
        assert code not in (None, 0), "a dead replica must take the server down, exit code non-zero"


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return sorted(out)


# ---- placement and configuration, no model --------------------------------------------------
def test_cpulist_and_shares(tmp_path: Path) -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert replica_cores(2, (0, 1, 2, 3, 4)) == [(0, 1, 2), (3, 4)]
    assert replica_cores(1, (5,)) == [(5,)]
    with pytest.raises(ValueError, match="data_parallel_size=3"):
        replica_cores(3, (0, 1))
    for node, cpus in (("node0", "0,2"), ("node1", "1,3")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus)
    assert numa_order([0, 1, 2, 3], root=tmp_path) == [0, 2, 1, 3]  # node by node


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"data_parallel_backend": "ray"}, "data_parallel_backend"),
        ({"data_parallel_backend": "slurm"}, "data_parallel_backend"),
        ({"data_parallel_size": 0}, "data_parallel_size"),
    ],
)
def test_bad_parallel_options_name_the_field(options: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**options)  # type: ignore[arg-type]


def test_offline_llm_refuses_data_parallel(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(model=str(llama_dir), data_parallel_size=2)


def test_more_replicas_than_cores_fails_at_start(llama_dir: Path, tmp_path: Path) -> None:
    too_many = str(len(os.sched_getaffinity(0)) + 1)
    start = running_server(llama_dir, "--data-parallel-size", too_many, log_dir=tmp_path, startup_s=60)
    with pytest.raises(RuntimeError, match="data_parallel_size"), start:
        pass
