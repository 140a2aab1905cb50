"""The one-call C++ decoder stack gives bit-identical results to the Python layer loop (same
kernels, same order), for decode and fused prompt steps, with and without qkv bias; and it
is used exactly when it applies."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from swiftserve import LLM, SamplingParams
from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.packed_linear import PanelLinear
from swiftserve.tools.demo import write_random_checkpoint

OPS = cpu_kernels()
pytestmark = pytest.mark.skipif(
    OPS is None or not OPS.bf16_gemm_available(), reason="needs the CPU kernels with AVX512-BF16"
)
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    return write_random_checkpoint(out, preset="tiny", architecture=request.param, **SHAPE)


def generate(model_dir: Path, stack: bool) -> tuple[list, int]:  # type: ignore[type-arg]
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        max_num_batched_tokens=40,
        block_size=16,
        layer_stack=stack,
        prompt_tiles=False,  # tiled prompt runs never take the stack (steps of 8+ rows on AMX)
    )
    worker = llm.engine.executor.worker
    model = worker.model
    # On AMX CPUs batches of 8+ rows leave the stack for oneDNN's copies (packed_linear.py):
    # turn that off here, so both runs compare the stack and the loop on every kind of step.
    worker.ops.stack_max_rows = 1 << 30
    for module in model.modules():
        if isinstance(module, PanelLinear):
            module.onednn, module.dual, module.onednn_rows = None, False, 1 << 62
    calls = 0
    original = OPS.decoder_stack

    class Counting:  # counts calls into the stack without changing what it computes
        def __getattr__(self, name: str) -> object:
            return getattr(OPS, name)

        def decoder_stack(self, *args: object) -> object:
            nonlocal calls
            calls += 1
            return original(*args)

    worker.ops.cpp = Counting()  # type: ignore[attr-defined]
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(n)]} for n in (3, 50, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert bool(model.stack) is stack
    return outs, calls


def test_stack_is_bit_identical_to_python_loop(model_dir: Path) -> None:
    (fast, calls), (slow, none) = (
        generate(model_dir, True),
        generate(model_dir, False),
    )
    assert calls > 8 and none == 0  # prompt chunks and decode steps went through it
    for a, b in zip(fast, slow, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # exact, not approximate
        assert a.prompt_logprobs == b.prompt_logprobs
