"""bfloat16 prompt rows through the fused attention kernel (one query per row at its position)
give the same prompt logprobs and greedy tokens as the per-prompt SDPA path, with chunked
prefill, prefix-cache hits, mixed prefill/decode batches and a sliding window."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from swiftserve import LLM, SamplingParams
from swiftserve.model.kernels import cpu_kernels
from swiftserve.tools.demo import write_random_checkpoint

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels could not be built here")
# head_dim 64 and 2 query heads per KV head: the shapes the fused path takes.
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)


@pytest.fixture(scope="module", params=[None, 40], ids=["full", "window40"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = "llama" if request.param is None else "mistral"
    extra = {} if request.param is None else {"sliding_window": request.param}
    return write_random_checkpoint(
        tmp_path_factory.mktemp("fused"), preset="tiny", architecture=arch, **SHAPE, **extra
    )


def run(model_dir: Path, fused: bool, limit: int | None = None) -> list:  # type: ignore[type-arg]
    llm = LLM(
        model=str(model_dir),
        fused_prefill=fused,
        prompt_tiles=False,  # this file compares the row kernel with SDPA (tiles: test_prompt_tiles.py)
        dtype="bfloat16",
        max_num_batched_tokens=37,  # prompts split into chunks, decode rows mixed in
        block_size=16,
        enable_prefix_caching=True,
    )
    assert llm.engine.executor.worker.runner.fused_prefill is fused
    if limit is not None:  # steps with more prompt tokens than this take SDPA (as on AMX CPUs)
        llm.engine.executor.worker.runner.fused_rows_limit = limit
    rng = random.Random(0)
    shared = [rng.randrange(5, 500) for _ in range(40)]  # a prefix-cache hit for later prompts
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 70, 17, 33)]
    prompts += [[*shared, 7, 8, 9], [*shared, *(rng.randrange(5, 500) for _ in range(25))]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts[4:]], params, use_tqdm=False)
    return first + second


@pytest.mark.parametrize("limit", [None, 8], ids=["always_fused", "switching"])
def test_fused_prefill_matches_sdpa(model_dir: Path, limit: int | None) -> None:
    fused, sdpa = run(model_dir, True, limit), run(model_dir, False)
    for a, b in zip(fused, sdpa, strict=True):
        ids = a.prompt_token_ids
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(a.prompt_logprobs) == len(ids)
        for pos in range(1, len(ids)):
            got = a.prompt_logprobs[pos][ids[pos]].logprob
            want = b.prompt_logprobs[pos][ids[pos]].logprob
            assert got == pytest.approx(want, abs=0.05), (len(ids), pos)  # bf16 rounding only
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
