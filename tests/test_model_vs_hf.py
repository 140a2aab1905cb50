"""Greedy output token-for-token equal to Hugging Face transformers (float32), under every
scheduling regime: prefix caching on/off, tiny chunked-prefill budget, forced preemption,
block sizes 1/16/32, the priority policy, async scheduling, an INT8 KV cache; and logprobs
within 1e-4 (2e-2 with the INT8 KV cache)."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftserve import LLM, SamplingParams

MAX_TOKENS = 10


def make_prompts() -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 33, 70)]
    prompts += [shared + [rng.randrange(3, 512) for _ in range(k)] for k in (3, 9)]
    return prompts


PROMPTS = make_prompts()


@cache
def hf_reference(path: str) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], ...]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[0, len(prompt) :].tolist()
        lps = [
            torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new, strict=True)
        ]
        tokens.append(tuple(new))
        logprobs.append(tuple(lps))
    return tuple(tokens), tuple(logprobs)


ENGINE_VARIANTS = {
    "default": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunk-7": {"max_num_batched_tokens": 7},
    "preempt": {"num_kv_blocks": 24, "block_size": 4},
    "block-1": {"block_size": 1},
    "block-32": {"block_size": 32},
    "priority": {"scheduling_policy": "priority"},
    # async scheduling: step N+1 scheduled while step N runs, placeholders filled by the runner
    "async": {"async_scheduling": True},
    "async-chunk-7": {"async_scheduling": True, "max_num_batched_tokens": 7},
    "async-preempt": {"async_scheduling": True, "num_kv_blocks": 24, "block_size": 4},
    "async-priority-busy-poll": {
        "async_scheduling": True,
        "busy_poll": True,
        "scheduling_policy": "priority",
    },
    # INT8 KV cache: the same tokens; logprobs within the cache's rounding (LOGPROB_TOL)
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-int8-preempt": {"kv_cache_dtype": "int8", "num_kv_blocks": 24, "block_size": 4},
}
LOGPROB_TOL = {"kv-int8": 2e-2, "kv-int8-preempt": 2e-2}


def generate(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    priority = [i % 3 for i in range(len(PROMPTS))]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, priority=priority, use_tqdm=False)


def check(outs: list, ref_tokens: tuple, ref_logprobs: tuple, tol: float = 1e-4) -> None:
    for i, out in enumerate(outs):
        assert tuple(out.outputs[0].token_ids) == ref_tokens[i], f"prompt {i}"
        got = [out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(out.outputs[0].token_ids)]
        assert got == pytest.approx(ref_logprobs[i], abs=tol)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
@pytest.mark.parametrize("model_name", ["llama3", "qwen2", "mistral", "llama_tied_sharded"])
def test_greedy_matches_transformers(model_dirs: dict[str, Path], model_name: str, variant: str) -> None:
    path = model_dirs[model_name]
    ref_tokens, ref_logprobs = hf_reference(str(path))
    llm = LLM(str(path), progress=False, max_model_len=256, **ENGINE_VARIANTS[variant])  # type: ignore[arg-type]
    tol = LOGPROB_TOL.get(variant, 1e-4)
    check(generate(llm), ref_tokens, ref_logprobs, tol)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    if variant.endswith("preempt"):
        assert llm.engine.scheduler.num_preemptions > 0
    if llm.config.async_scheduling:  # results really came back from the step thread
        assert llm.engine.wakeups_us
    # Second pass: prompts now hit the prefix cache (when on) and must give the same tokens.
    check(generate(llm), ref_tokens, ref_logprobs, tol)
    assert (bm.prefix_hits > 0) == llm.config.enable_prefix_caching
    assert bm.num_free_blocks == bm.num_blocks
