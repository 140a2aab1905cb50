"""Structured output inside the engine (offline LLM): the grammar holds through preemption by
recompute, chunked prefill, n > 1 and seeded sampling; logprobs stay those of the raw model;
a spec that cannot compile is refused before anything is queued."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from structured_schemas import SCHEMAS
from swiftserve import LLM, SamplingParams
from swiftserve.engine.inputs import InvalidRequestError
from swiftserve.sampling_params import StructuredOutputsParams

ARRAY = SCHEMAS[7]  # up to three {"id", "ok"} objects: long enough outputs to be preempted


def _valid(text: str, schema: dict) -> bool:  # type: ignore[type-arg]
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_grammar_survives_preemption_and_chunked_prefill(llama_dir: Path) -> None:
    # 16 blocks of 16 tokens for 8 requests of ~60 prompt + ~40-60 output tokens: the scheduler
    # must preempt (recompute); 32-token steps chunk every prompt
    llm = LLM(model=str(llama_dir), num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=8)
    prompts = [f"Records, please ({i}): " * 3 for i in range(8)]  # distinct: no shared prefix blocks
    params = [
        SamplingParams(
            max_tokens=100, temperature=1.0, seed=i, structured_outputs=StructuredOutputsParams(json=ARRAY)
        )
        for i in range(8)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs if o.metrics) > 0, "the test must preempt"
    for o in outputs:
        assert o.outputs[0].finish_reason == "stop"
        assert _valid(o.outputs[0].text, ARRAY), o.outputs[0].text


def test_n_sequences_and_seeds(llama_dir: Path) -> None:
    llm = LLM(model=str(llama_dir))
    spec = StructuredOutputsParams(json=SCHEMAS[0])
    out = llm.generate(
        "person:",
        SamplingParams(n=4, max_tokens=200, temperature=1.0, seed=7, structured_outputs=spec),
        use_tqdm=False,
    )
    texts = [c.text for c in out[0].outputs]
    assert len(texts) == 4 and all(_valid(t, SCHEMAS[0]) for t in texts)
    again = llm.generate(
        "person:",
        SamplingParams(n=4, max_tokens=200, temperature=1.0, seed=7, structured_outputs=spec),
        use_tqdm=False,
    )
    assert [c.text for c in again[0].outputs] == texts  # seeded: reproducible under the grammar


def test_logprobs_are_the_raw_models(llama_dir: Path) -> None:
    """Masking changes which token is picked, not the reported logprobs (vLLM's default)."""
    llm = LLM(model=str(llama_dir))
    choice = StructuredOutputsParams(choice=("yes", "no"))
    guided = llm.generate(
        "a",
        SamplingParams(max_tokens=4, temperature=0, logprobs=3, structured_outputs=choice),
        use_tqdm=False,
    )
    free = llm.generate("a", SamplingParams(max_tokens=1, temperature=0, logprobs=3), use_tqdm=False)
    first_guided, first_free = guided[0].outputs[0].logprobs[0], free[0].outputs[0].logprobs[0]  # type: ignore[index]
    top_guided = sorted(first_guided.values(), key=lambda x: x.rank)
    top_free = sorted(first_free.values(), key=lambda x: x.rank)
    # the same top-3 of the raw distribution is reported in both runs
    assert {t.decoded_token for t in top_free[:3]} <= {t.decoded_token for t in top_guided}
    assert guided[0].outputs[0].text in ("yes", "no")


def test_bad_spec_refused_before_queueing(llama_dir: Path) -> None:
    llm = LLM(model=str(llama_dir))
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a{3"))
    good = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["x", "y"], [good, bad], use_tqdm=False)
    assert info.value.param == "structured_outputs.regex"
    assert not llm.loop.core.has_unfinished()  # all or nothing: the good one was not queued either
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("a",))
