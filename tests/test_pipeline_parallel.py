"""Pipeline parallel: stages in their own processes (gloo between them, one thread each) give
bit-identical tokens to one process, with micro-batches in flight; the same through a real
server and the openai client; two "machines" on one host; a killed stage takes the server
down; bad configurations fail at start naming the flag."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from server_utils import Server, greedy_texts_match_offline, running_server
from swiftserve import LLM, SamplingParams
from swiftserve.bench.launch import free_port
from swiftserve.config import EngineConfig
from swiftserve.tools.demo import write_random_checkpoint
from swiftserve.worker.pipeline_stage import stage_layers

PROMPTS = [
    [1, 2, 3, 4, 5],
    [7, 8, 9],
    list(range(10, 50)),  # several chunks at max_num_batched_tokens=16
    [20, 21],
    list(range(60, 83)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _run(
    model: Path, prompts: list[list[int]], params: SamplingParams, **options: object
) -> tuple[list, LLM]:
    llm = LLM(str(model), max_model_len=128, num_threads=1, progress=False, **options)  # type: ignore[arg-type]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    except BaseException:
        llm.shutdown()
        raise
    return [o.outputs[0] for o in outs], llm


def _tokens_with(model: Path, params: SamplingParams = GREEDY, **options: object) -> tuple[list, LLM]:
    outs, llm = _run(model, PROMPTS, params, **options)
    llm.shutdown()
    return outs, llm


@pytest.mark.parametrize("name", ["llama3", "llama_tied_sharded", "qwen2", "mistral"])
def test_two_stages_give_the_same_tokens_with_two_micro_batches_in_flight(
    model_dirs: dict[str, Path], name: str
) -> None:
    options = dict(max_num_batched_tokens=16)  # chunked prompts pipeline too
    want, _ = _tokens_with(model_dirs[name], **options)
    got, llm = _tokens_with(model_dirs[name], pipeline_parallel_size=2, **options)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.max_in_flight == 2


def test_bfloat16_stages_run_the_cpp_layer_stack_with_the_same_bits(tmp_path: Path) -> None:
    from swiftserve.model.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None or not kernels.bf16_gemm_available():
        pytest.skip("needs the CPU kernels with AVX512-BF16")
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    model = write_random_checkpoint(tmp_path / "bf16", preset="tiny", seed=5, **shape)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    # one request at a time: in bfloat16 the kernels depend on a step's row count, and the
    # pipeline splits a batch into micro-batches, so only equal batches give equal bits
    outs: list[list] = []
    for options in ({}, {"pipeline_parallel_size": 2}):
        llm = LLM(str(model), dtype="bfloat16", max_model_len=128, num_threads=1, progress=False, **options)
        try:
            outs.append([llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
                         for p in PROMPTS[:3]])  # fmt: skip
        finally:
            llm.shutdown()
    assert llm.engine.executor.stage_stacks == [True, True]  # type: ignore[attr-defined]
    want, got = outs
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]  # exact


def test_sampling_logprobs_and_preemption_match_one_process(llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, logprobs=2, ignore_eos=True)
    options = dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=32)  # forces preemption
    want, one = _tokens_with(llama_dir, params, **options)
    got, llm = _tokens_with(llama_dir, params, pipeline_parallel_size=2, **options)
    assert llm.engine.scheduler.num_preemptions > 0 and one.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-5 for t in la)
    assert llm.engine.block_manager.usage == 0.0  # no block leaked


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("l5"), preset="tiny", seed=3, num_hidden_layers=5)


def test_three_uneven_stages(five_layers: Path) -> None:
    model = five_layers
    assert [stage_layers(5, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    want, _ = _tokens_with(model)
    got, llm = _tokens_with(model, pipeline_parallel_size=3)  # 3 stages on 2 cores: 1 thread each
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.max_in_flight >= 2


def free_port_pair() -> int:
    """A port P with P + 1 free too (the engine listens for stages on master_port + 1): a
    single free port flaked in CI when P + 1 was taken."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no two consecutive free ports")


def test_two_machines_on_one_host(llama_dir: Path) -> None:
    """Node 0 (the engine, stage 0) and a headless node 1 (stage 1) meet at master addr:port."""
    port = free_port_pair()
    common = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    common += ["--master-port", str(port), "--num-threads", "1"]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "swiftserve.cli", "serve", *common, "--node-rank", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        want, _ = _tokens_with(llama_dir)
        got, _ = _tokens_with(llama_dir, pipeline_parallel_size=2, nnodes=2, node_rank=0, master_port=port)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert node1.wait(timeout=30) == 0  # its stage ends with the engine
    finally:
        node1.kill()


def test_unreachable_master_fails_with_a_timeout_not_a_hang() -> None:
    port = free_port()  # nobody listens there
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "swiftserve.cli", "serve", "--pipeline-parallel-size", "2", "--nnodes", "2",
         "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--distributed-timeout-s", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "could not reach the engine at --master-addr 127.0.0.1" in done.stdout + done.stderr
    assert time.monotonic() - start < 30


# ---- through the server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--max-model-len", "256", "--pipeline-parallel-size", "2", "--num-threads", "1")
    with running_server(llama_dir, *args, log_dir=tmp_path_factory.mktemp("pp")) as s:
        yield s


def test_server_with_two_stages_gives_the_offline_greedy_text(llama_dir: Path, server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    greedy_texts_match_offline(llama_dir, client, ["def add(a, b):", "import os\n", "class Stack:", "x = ["])
    assert server.metrics()["swiftserve:pipeline_max_micro_batches_in_flight"] == 2


def test_killed_stage_takes_the_server_down(llama_dir: Path, tmp_path: Path) -> None:
    args = ("--max-model-len", "256", "--pipeline-parallel-size", "2", "--num-threads", "1")
    with running_server(llama_dir, *args, log_dir=tmp_path) as s:
        stages = _stage_pids(s.proc.pid)
        assert len(stages) == 2, stages
        os.kill(stages[-1], signal.SIGKILL)
        try:
            code = s.proc.wait(timeout=30)  # noticed while idle, not only at the next request
        except subprocess.TimeoutExpired:
            code = None
        assert code not in (None, 0), "a dead stage must take the server down, exit code non-zero"


def _stage_pids(server_pid: int) -> list[int]:
    """Processes running a stage whose ancestry reaches the server."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            grand = int((Path("/proc") / str(ppid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if b"swiftserve.worker.stage_process" in cmdline and server_pid in (ppid, grand):
            found.append(int(entry.name))
    return sorted(found)


# ---- configuration errors, named by flag -----------------------------------------------------
@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"pipeline_parallel_size": 0}, "--pipeline-parallel-size"),
        ({"pipeline_parallel_size": 3, "nnodes": 2, "master_port": 5000}, "--nnodes"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 5000}, "--node-rank"),
        ({"pipeline_parallel_size": 2, "nnodes": 2}, "--master-port"),
        ({"distributed_executor_backend": "slurm"}, "--distributed-executor-backend"),
        ({"pipeline_parallel_size": 2, "async_scheduling": True}, "async_scheduling"),
        ({"pipeline_parallel_size": 2, "data_parallel_size": 2}, "data_parallel_size"),
    ],
)
def test_bad_pipeline_options_name_the_flag(options: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**options)  # type: ignore[arg-type]


def test_more_stages_than_layers_fails_at_start(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="larger than the model's 2 layers"):
        LLM(str(llama_dir), pipeline_parallel_size=3, num_threads=1)


def test_more_stages_than_cores_needs_num_threads(five_layers: Path) -> None:
    too_many = len(os.sched_getaffinity(0)) + 1
    if too_many > 5:
        pytest.skip("a machine with more cores than the model has layers")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size .* needs at least one core"):
        LLM(str(five_layers), pipeline_parallel_size=too_many)


def test_ray_backend_without_ray_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from swiftserve import config

    monkeypatch.setattr(config, "_ray_installed", lambda: False)
    with pytest.raises(ValueError, match=r"--distributed-executor-backend.*pip install 'swiftserve\[ray\]'"):
        EngineConfig(pipeline_parallel_size=2, distributed_executor_backend="ray")
