"""Speculative decoding with a draft model (worker/draft_runner.py, core/draft.py): greedy
output identical with and without it on every parity model and scheduler setting, with the
target as its own draft (nearly every draft accepted) and with a random one-layer draft (most
rejected); no KV block leaked; prefix-cache hits after rollbacks exact; the draft never
writes outside the request's blocks; clear errors for drafts that cannot propose."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest

from server_utils import greedy_texts_match_offline, running_server
from swiftserve import LLM, SamplingParams
from swiftserve.tools.demo import write_random_checkpoint

PROMPTS: list[Any] = [
    {"prompt_token_ids": list(range(20, 36)) * 4},
    {"prompt_token_ids": [7, 8, 9, 7, 8, 9, 100, 101, 7, 8, 9, 7, 8]},
    {"prompt_token_ids": list(range(40, 50)) + list(range(40, 45))},
    {"prompt_token_ids": [300, 5, 77]},
]
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 24, "max_num_seqs": 4},  # draft backlogs split too
    "preemption": {"num_kv_blocks": 12, "max_num_batched_tokens": 32},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "priority": {"scheduling_policy": "priority"},
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def spec(draft: Path, k: int = 3) -> dict[str, Any]:
    # adaptive off: every proposal verified, whatever the fitted step cost says
    return {"model": str(draft), "num_speculative_tokens": k, "adaptive": False}


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer, another seed, the tiny preset's tokenizer: a draft that is mostly wrong."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("draft"), preset="tiny", seed=11, num_hidden_layers=1
    )


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _check(model: Path, draft: Path, engine: dict[str, Any], min_acceptance: float) -> LLM:
    plain = _tokens(LLM(model=str(model), **engine).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = LLM(model=str(model), speculative_config=spec(draft), **engine)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == plain
    spec_stats = llm.engine.scheduler.spec
    assert spec_stats.num_draft_tokens > 0
    assert spec_stats.acceptance_rate >= min_acceptance
    assert llm.engine.block_manager.usage == 0.0  # every block came back (lookahead too)
    if "num_kv_blocks" in engine:
        assert sum(o.metrics.num_preemptions for o in outputs if o.metrics) > 0
    return llm


@pytest.mark.parametrize("setting", ["default", "chunked", "preemption"])
@pytest.mark.parametrize("name", ["llama3", "llama_tied_sharded", "qwen2", "mistral"])
def test_target_as_its_own_draft_is_exact_and_accepted(
    model_dirs: dict[str, Path], name: str, setting: str
) -> None:
    """The same weights propose: the draft's KV (catch-up over the same block ids) must be
    the target's, so nearly every draft is accepted (float32: a rare near-tie may differ)."""
    _check(model_dirs[name], model_dirs[name], SETTINGS[setting], min_acceptance=0.9)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_random_draft_is_exact_whatever_it_proposes(
    llama_dir: Path, random_draft: Path, setting: str
) -> None:
    _check(llama_dir, random_draft, SETTINGS[setting], min_acceptance=0.0)


def test_prefix_cache_hits_after_rollbacks_stay_exact(llama_dir: Path) -> None:
    """A prompt that hits blocks computed (by target and draft) in an earlier request."""
    llm = LLM(model=str(llama_dir), speculative_config=spec(llama_dir))
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = [
        {"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids}
        for p, o in zip(PROMPTS, first, strict=True)
    ]
    cached = llm.generate(again, GREEDY, use_tqdm=False)
    plain = LLM(model=str(llama_dir)).generate(again, GREEDY, use_tqdm=False)
    assert _tokens(cached) == _tokens(plain)
    assert sum(o.num_cached_tokens for o in cached) > 0
    assert llm.engine.scheduler.spec.acceptance_rate > 0.9


def test_sampled_output_is_reproducible_and_logprobs_match(llama_dir: Path) -> None:
    """Seeded sampling through the verifier; logprobs equal the plain engine's under greedy."""
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)
    llm = LLM(model=str(llama_dir), speculative_config=spec(llama_dir))
    a = _tokens(llm.generate(PROMPTS, sampled, use_tqdm=False))
    b = _tokens(llm.generate(PROMPTS, sampled, use_tqdm=False))
    assert a == b and all(len(t) == 30 for t in a)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    with_spec = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    plain = LLM(model=str(llama_dir)).generate(PROMPTS[:2], params, use_tqdm=False)
    for s, p in zip(with_spec, plain, strict=True):
        assert s.outputs[0].token_ids == p.outputs[0].token_ids
        for ls, lp in zip(s.outputs[0].logprobs, p.outputs[0].logprobs, strict=True):
            for token, entry in lp.items():
                assert abs(ls[token].logprob - entry.logprob) < 1e-4


def test_draft_stays_inside_its_blocks_at_the_context_end(llama_dir: Path) -> None:
    """Requests that run into max_model_len: the draft's proposals stop at the last position
    (no rope position or slot past it), and the engine stays exact."""
    engine = {"max_model_len": 72, "num_kv_blocks": 40}
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)  # to the context end
    plain = LLM(model=str(llama_dir), **engine).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model=str(llama_dir), speculative_config=spec(llama_dir, k=5), **engine)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(plain)
    assert all(
        len(p["prompt_token_ids"]) + len(o.outputs[0].token_ids) == 72
        for p, o in zip(PROMPTS, outputs, strict=True)
    )
    assert llm.engine.block_manager.usage == 0.0


def _copy_with(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_drafts_that_cannot_propose_are_clear_errors(llama_dir: Path, tmp_path: Path) -> None:
    other_vocab = write_random_checkpoint(tmp_path / "v", preset="tiny", vocab_size=640, num_hidden_layers=1)
    short = _copy_with(llama_dir, tmp_path / "short", max_position_embeddings=32)
    tokenizer = _copy_with(llama_dir, tmp_path / "tok")
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped: another tokenizer
    (tokenizer / "tokenizer.json").write_text(json.dumps(data))
    cases = [
        ({"model": str(other_vocab)}, "vocab_size"),
        ({"model": str(short)}, "max_position_embeddings"),
        ({"model": str(tokenizer)}, "tokenizer"),
        ({"model": str(tmp_path / "missing")}, "not a checkpoint"),
        ({"method": "draft_model"}, "needs 'model'"),
        ({"method": "ngram", "model": str(llama_dir)}, "draft_model"),
        ({"model": str(llama_dir), "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(model=str(llama_dir), speculative_config=bad, max_model_len=128)


def test_server_with_a_draft_model(llama_dir: Path, tmp_path: Path) -> None:
    """Through the openai client: greedy text equals the offline engine's; counters in /metrics."""
    args = ("--max-model-len", "256", "--speculative-config", json.dumps(spec(llama_dir)))
    prompts = ["def main():\n    return", "import os\nimport sys\n\nclass"]
    with running_server(llama_dir, *args, log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        greedy_texts_match_offline(llama_dir, client, prompts)
        metrics = server.metrics()
        assert metrics["swiftserve:spec_decode_num_draft_tokens"] > 0
        assert metrics["swiftserve:spec_decode_num_accepted_tokens"] > 0
