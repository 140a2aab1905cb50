"""Ray: pipeline stages as Ray actors, and the Ray Serve app (our FastAPI app in Serve
replicas) answering through the openai client from 2 replicas, surviving a killed replica.
One local Ray cluster (2 CPUs, no dashboard) for the whole module."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from swiftserve import LLM, SamplingParams
from swiftserve.bench.launch import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "x = ["]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def test_pipeline_stages_as_ray_actors_give_the_same_tokens(cluster: None, llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([1, 2, 3], [4, 5, 6, 7], list(range(10, 40)), [3, 4])]
    want = LLM(str(llama_dir), max_model_len=128, num_threads=1).generate(prompts, params, use_tqdm=False)
    llm = LLM(
        str(llama_dir),
        max_model_len=128,
        num_threads=1,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
    )
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.max_in_flight == 2
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.fixture(scope="module")
def endpoint(cluster: None, llama_dir: Path) -> str:
    from swiftserve.integrations.ray_serve import app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # the arguments as `serve run ...:app key=value` passes them: text
    args = {"model": str(llama_dir), "num_replicas": "2", "num_cpus": "0.5"}
    args.update({"max_model_len": "256", "num_threads": "1", "served_model_name": "tiny"})
    serve.run(app(args), route_prefix="/")
    return f"http://127.0.0.1:{port}/v1"


def _complete(client: openai.OpenAI, prompt: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return raw.parse().choices[0].text, raw.headers["x-swiftserve-replica"]


def test_serve_app_answers_from_two_replicas(endpoint: str, llama_dir: Path) -> None:
    reference = LLM(str(llama_dir), max_model_len=256).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    want = {p: r.outputs[0].text for p, r in zip(PROMPTS, reference, strict=True)}
    client = openai.OpenAI(base_url=endpoint, api_key="none", max_retries=0)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: (p, *_complete(client, p)), PROMPTS * 6))
    assert all(text == want[p] for p, text, _ in answers)
    assert len({replica for _, _, replica in answers}) == 2


def test_serve_app_keeps_answering_after_a_replica_is_killed(endpoint: str) -> None:
    client = openai.OpenAI(base_url=endpoint, api_key="none", max_retries=0)
    replicas: set[str] = set()
    deadline = time.monotonic() + 30
    while len(replicas) < 2 and time.monotonic() < deadline:
        replicas.add(_complete(client, "hello")[1])
    assert len(replicas) == 2, replicas
    victim = sorted(replicas)[0]
    os.kill(int(victim.rsplit(":", 1)[1]), signal.SIGKILL)
    answered = [_complete(client, f"count {i}") for i in range(10)]  # no retries: every one answers
    assert all(text for text, _ in answered)
    assert victim not in {replica for _, replica in answered}
    # and Serve restarts it: a new replica answers beside the survivor
    deadline = time.monotonic() + 90
    alive = {replica for _, replica in answered}
    while len(alive) < 2 and time.monotonic() < deadline:
        alive.add(_complete(client, "again")[1])
    assert len(alive) == 2 and victim not in alive, alive


def test_app_arguments_are_checked_in_the_driver() -> None:
    from swiftserve.integrations.ray_serve import split_args

    args = {"max_model_len": "256", "enable_prefix_caching": "false", "api_key": "k"}
    engine, server, opts = split_args({**args, "num_replicas": "3", "cpu_affinity": "[0, 1]"})
    assert engine == {"max_model_len": 256, "enable_prefix_caching": False, "cpu_affinity": (0, 1)}
    assert server == {"api_key": "k"} and opts == {"num_replicas": 3}
    with pytest.raises(ValueError, match="unknown option 'max_model_lenght'"):
        split_args({"max_model_lenght": "256"})
    with pytest.raises(ValueError, match="max_num_seqs"):
        split_args({"max_num_seqs": "0"})
