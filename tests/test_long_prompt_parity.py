"""Long prompts (4-6k tokens, float32) equal to transformers, greedy token for token, with
chunked prefill so that later chunks attend to thousands of cached tokens (the two-call
flash path of model/attention.py on CPU): Llama-3 rope scaling, Qwen2, Mistral's sliding
window. Issue 24's correctness at long positions."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import LLAMA3_ROPE
from swiftserve import LLM, SamplingParams
from swiftserve.tools.demo import write_random_checkpoint

LONG = dict(max_position_embeddings=8192)
SPECS = {
    "llama3": dict(
        architecture="llama", rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 1024}
    ),
    "qwen2": dict(architecture="qwen2"),
    "mistral": dict(architecture="mistral", sliding_window=512),
}
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(SPECS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp(f"long-{request.param}"),
        preset="tiny",
        seed=3,
        **LONG,
        **SPECS[request.param],
    )


def test_long_prompt_greedy_equals_transformers(model_dir: Path) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (4100, 5000)]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    want = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        want.append(out[0, len(prompt) :].tolist())
    # 1,024-token chunks: the later ones see 1-4k tokens of cached context
    llm = LLM(model=str(model_dir), max_model_len=8192, max_num_batched_tokens=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
