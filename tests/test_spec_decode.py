"""Speculative decoding (n-gram): greedy output identical with and without it on every parity
model and scheduler setting; the verifier keeps the sampled distribution (chi-square); no
KV block is leaked; stops, max_tokens, logprobs and seeds hold; counters reach /metrics."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from scipy.stats import chisquare

from server_utils import running_server
from swiftserve import LLM, SamplingParams
from swiftserve.core.ngram import NgramProposer
from swiftserve.core.request import Request
from swiftserve.worker.sampler import SamplingState
from swiftserve.worker.spec_verify import verify

# adaptive off: these tests want every proposal verified, whatever the step cost says
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "adaptive": False,
}
# copy-heavy prompts (a pattern repeated) so drafts are proposed and often accepted
PROMPTS: list[Any] = [
    {"prompt_token_ids": list(range(20, 36)) * 4},
    {"prompt_token_ids": [7, 8, 9, 7, 8, 9, 100, 101, 7, 8, 9, 7, 8]},
    {"prompt_token_ids": list(range(40, 50)) + list(range(40, 45))},
]
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 24},
    "preemption": {"num_kv_blocks": 10, "max_num_batched_tokens": 32},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "priority": {"scheduling_policy": "priority"},
}


def _run(
    model: Path, spec: dict[str, Any] | None, params: SamplingParams, **engine: Any
) -> tuple[list[Any], LLM]:
    llm = LLM(model=str(model), speculative_config=spec, **engine)
    return llm.generate(PROMPTS, params, use_tqdm=False), llm


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("name", ["llama3", "llama_tied_sharded", "qwen2", "mistral"])
def test_greedy_identical_with_speculation(model_dirs: dict[str, Path], name: str, setting: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _ = _run(model_dirs[name], None, params, **SETTINGS[setting])
    spec, llm = _run(model_dirs[name], NGRAM, params, **SETTINGS[setting])
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.scheduler.spec.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert llm.engine.block_manager.usage == 0.0  # every block came back (rejected drafts too)
    if setting == "preemption":
        assert sum(o.metrics.num_preemptions for o in spec if o.metrics) > 0


def test_prefix_cache_after_rollbacks_stays_exact(llama_dir: Path) -> None:
    """Rejected drafts leave stale KV in their slots; a block is registered in the prefix
    cache only when its tokens are accepted, so a second pass that hits the cache is exact."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain, _ = _run(llama_dir, None, params)
    llm = LLM(model=str(llama_dir), speculative_config=NGRAM)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    # the same prompts plus their outputs: long prefixes that the cache now holds
    again = [
        {"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids}
        for p, o in zip(PROMPTS, first, strict=True)
    ]
    cached = llm.generate(
        again, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    reference = LLM(model=str(llama_dir), enable_prefix_caching=False).generate(
        again, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in reference]
    assert any(o.num_cached_tokens for o in cached)


@pytest.mark.parametrize(
    "rules",
    [
        {"repetition_penalty": 1.05},
        {"min_tokens": 20, "logit_bias": {35: 3.0, 399: -2.0}},
        {"bad_words": ["ab"], "presence_penalty": 0.3},
    ],
    ids=["penalties", "min_tokens_bias", "bad_words"],
)
def test_greedy_identical_with_rules_that_read_the_output(llama_dir: Path, rules: dict[str, Any]) -> None:
    """Penalties, min_tokens and token rules are applied at each draft position as if the
    drafts before it had been emitted: still token-for-token identical."""
    params = SamplingParams(temperature=0.0, max_tokens=40, **rules)
    plain, _ = _run(llama_dir, None, params)
    spec, llm = _run(llama_dir, NGRAM, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.scheduler.spec.stats()["spec_decode_num_draft_tokens"] > 0


def test_stops_max_tokens_and_logprobs(llama_dir: Path) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    plain, _ = _run(llama_dir, None, base)
    spec, _ = _run(llama_dir, NGRAM, base)
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(b.outputs[0].token_ids) == 30
        for lp_a, lp_b, tok in zip(
            a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True
        ):
            assert lp_b[tok].logprob == pytest.approx(lp_a[tok].logprob, abs=1e-4)
    # a stop token inside an accepted run of drafts ends the output right there
    stop = plain[0].outputs[0].token_ids[12]
    first = plain[0].outputs[0].token_ids.index(stop)
    stopped, _ = _run(llama_dir, NGRAM, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]))
    assert stopped[0].outputs[0].token_ids == plain[0].outputs[0].token_ids[: first + 1]
    assert stopped[0].outputs[0].finish_reason == "stop"


def test_sampled_with_seeds_and_n(llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=30, seed=11, n=3, ignore_eos=True)
    out1, llm = _run(llama_dir, NGRAM, params)
    out2, _ = _run(llama_dir, NGRAM, params)
    assert [[c.token_ids for c in o.outputs] for o in out1] == [
        [c.token_ids for c in o.outputs] for o in out2
    ]
    assert all(len(c.token_ids) == 30 for o in out1 for c in o.outputs)
    assert llm.engine.scheduler.spec.stats()["spec_decode_num_draft_tokens"] > 0


def _state(**params: Any) -> SamplingState:
    return SamplingState(SamplingParams(**params), [1])


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 1.3, "top_k": 4, "top_p": 0.9},
        {"temperature": 1.0, "repetition_penalty": 1.8, "frequency_penalty": 0.5},
    ],
)
def test_verifier_keeps_the_target_distribution(params: dict[str, Any]) -> None:
    """Chi-square over a 6-token vocabulary: the first emitted token follows row 0's processed
    distribution; after an accepted first draft, the second follows row 1's."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    drafts = [2, 4]
    state = _state(**params)
    gen = torch.Generator().manual_seed(1)
    firsts: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    n = 6000
    for _ in range(n):
        emitted, _ = verify(logits, [drafts], [state], gen)
        firsts[emitted[0][0]] += 1
        if emitted[0][0] == drafts[0]:
            seconds[emitted[0][1]] += 1
    from swiftserve.worker.sampler import Sampler
    from swiftserve.worker.spec_verify import _processed_probs, _row_states

    # row j's target: as the one-token sampler would process it after drafts[:j] were emitted
    target = _processed_probs(Sampler.apply_rules(logits, _row_states([drafts], [state])), [state], [3])
    for counts, row in ((firsts, target[0]), (seconds, target[1])):
        total = sum(counts.values())
        support = [t for t in range(6) if row[t] > 0]
        assert all(counts[t] == 0 for t in range(6) if t not in support)  # filtered tokens never appear
        assert len(support) >= 2  # a real test of proportions, not of one certain token
        observed = [counts[t] for t in support]
        mass = sum(float(row[t]) for t in support)
        expected = [float(row[t]) / mass * total for t in support]
        assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


def test_greedy_verifier_accepts_the_argmax_run() -> None:
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 5, 1, 6]):
        logits[row, best] = 5.0
    emitted, _ = verify(logits, [[3, 5, 2]], [_state(temperature=0.0)], torch.Generator())
    assert emitted == [[3, 5, 1]]  # two accepted, the third corrected
    emitted, _ = verify(logits, [[3, 5, 1]], [_state(temperature=0.0)], torch.Generator())
    assert emitted == [[3, 5, 1, 6]]  # all accepted plus the bonus token


def test_ngram_proposer_longest_latest_match() -> None:
    proposer = NgramProposer(k=3, min_n=1, max_n=3)
    req = Request("r", [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3], SamplingParams(), max_tokens=50)
    # "1 2 3" matched at the start; a new request proposes cautiously (2 of k: its acceptance
    # average starts at 0.25, and as many drafts are proposed as it says will survive)
    assert proposer.propose(req, limit=10) == [4, 9]
    proposer.observe("r", 2, 2)  # both accepted: up to k from now on
    req.output_token_ids += [4]
    assert proposer.propose(req, limit=10) == [9, 2, 3]  # incremental index: "2 3 4" -> 9 ...
    assert proposer.propose(req, limit=1) == [9]
    assert proposer.propose(Request("s", [1, 2, 3], SamplingParams()), limit=5) == []
    asks_prompt_lps = Request("g", [1, 2, 1, 2], SamplingParams(prompt_logprobs=1), max_tokens=9)
    assert proposer.propose(asks_prompt_lps, limit=5) == []  # not eligible: one token a step
    penalised = Request("p", [1, 2, 1, 2], SamplingParams(repetition_penalty=1.2), max_tokens=9)
    proposer.propose(penalised, limit=5)
    proposer.observe("p", 2, 2)
    # penalties are applied per draft position; a loop shorter than k goes round again
    assert proposer.propose(penalised, limit=5) == [1, 2, 1]
    drifted = Request("d", [5, 1, 7, 5, 1, 8, 5, 1], SamplingParams(), max_tokens=9)
    assert proposer.propose(drifted, limit=5) == [8, 5]  # the latest "5 1", not the first


def test_ngram_backs_off_only_where_drafts_keep_failing() -> None:
    """A request whose drafts are never accepted stops proposing (a probe one step in
    max_cooldown + 1); one accepted about a third of the time keeps verifying every step,
    misses and all (a miss costs a few rows, an accepted draft a whole step)."""

    def proposing_steps(accepted_of_3: list[int], steps: int) -> int:
        proposer = NgramProposer(k=3, min_n=1, max_n=2)
        req = Request("r", [1, 2, 1, 2, 1, 2], SamplingParams(), max_tokens=10_000)
        proposed = 0
        for step in range(steps):
            if proposer.propose(req, limit=8):
                proposed += 1
                proposer.observe("r", 3, accepted_of_3[step % len(accepted_of_3)])
        return proposed

    never = proposing_steps([0], 400)
    assert never < 400 / (NgramProposer.max_cooldown + 1) + 20  # backed off: probes only
    assert proposing_steps([0, 0, 3], 400) == 400  # a third accepted (all-or-nothing): always
    assert proposing_steps([1], 400) == 400


@pytest.mark.parametrize(
    "bad",
    [
        {"method": "eagle"},
        {"model": "/some/draft"},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "ngram", "num_speculative_tokens": 1000},
        {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2},
        {"method": "ngram", "unknown": 1},
        "not json",
    ],
)
def test_bad_speculative_config_is_a_clear_error(llama_dir: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"speculative_config|SpeculativeConfig"):
        LLM(model=str(llama_dir), speculative_config=bad)


def test_server_flag_and_metrics(llama_dir: Path, tmp_path: Path) -> None:
    args = (
        "--max-model-len",
        "256",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3}',
    )
    with running_server(llama_dir, *args, log_dir=tmp_path) as server:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={
                "prompt": PROMPTS[1]["prompt_token_ids"],
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        metrics = server.metrics()
        assert metrics["swiftserve:spec_decode_num_draft_tokens"] > 0
        assert (
            0
            < metrics["swiftserve:spec_decode_num_accepted_tokens"]
            <= metrics["swiftserve:spec_decode_num_draft_tokens"]
        )


def test_structured_output_with_speculation(llama_dir: Path) -> None:
    """Drafts are checked against the grammar at every position (worker/guided.py:
    draft_masks): greedy output is identical, sampled output still validates, and the
    repetitive JSON gets drafts accepted."""
    import json

    import jsonschema

    from structured_schemas import SCHEMAS

    schema = SCHEMAS[7]  # up to three {"id": .., "ok": ..} records: repetitive keys
    prompts: list[Any] = [{"prompt_token_ids": list(range(20, 40))}, {"prompt_token_ids": [7, 8, 9] * 5}]
    greedy = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs={"json": schema})
    llm = LLM(model=str(llama_dir), speculative_config=NGRAM)
    spec = llm.generate(prompts, greedy, use_tqdm=False)
    plain = LLM(model=str(llama_dir)).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    sampled = llm.generate(
        prompts * 3,
        [
            SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs={"json": schema})
            for s in range(6)
        ],
        use_tqdm=False,
    )
    for out in [*spec, *sampled]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    stats = llm.engine.scheduler.spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
