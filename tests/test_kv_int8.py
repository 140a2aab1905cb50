"""INT8 KV cache (``kv_cache_dtype="int8"``, issue 21): the C++ write and decode kernels equal
the PyTorch reference (model/kv_quant.py), the engine with an INT8 cache stays close to the
bfloat16-cache engine on the parity models (and to transformers in float32), the layer stack
stays bit-identical, the prefix cache and preemption still work, and bad settings are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swiftserve import LLM, SamplingParams
from swiftserve.config import EngineConfig
from swiftserve.model.attention import AttentionMetadata
from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.kv_quant import dequantize_rows, quantize_rows
from swiftserve.model.ops import CpuOps, KernelOptions, TorchOps

OPS = cpu_kernels()
needs_kernels = pytest.mark.skipif(OPS is None, reason="needs the CPU kernels")


def test_rows_round_trip_within_half_a_step() -> None:
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    back = dequantize_rows(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 + 1e-6 * step)
    assert torch.equal(dequantize_rows(quantize_rows(torch.zeros(2, 64)), torch.float32), torch.zeros(2, 64))


def _case(dtype: torch.dtype, window: int | None) -> tuple:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(7)
    kv_heads, heads, dim, bs, nb = 2, 6, 64, 16, 12
    positions = torch.tensor([0, 5, 16, 37, 70])
    tables = torch.stack([torch.randperm(nb, generator=g)[:5] for _ in positions])
    slots = tables[torch.arange(5), positions // bs] * bs + positions % bs
    k = torch.randn(5, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(5, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(5, heads, dim, generator=g).to(dtype)
    base = quantize_rows(torch.randn(kv_heads, nb, bs, dim, generator=g))
    ctx = torch.arange(5 * bs)
    mask = ctx[None, :] <= positions[:, None]
    if window is not None:
        mask &= ctx[None, :] > positions[:, None] - window
    meta = AttentionMetadata(
        slots, 5, tables, mask.view(1, 5, 1, -1), [], decode_positions=positions, window=window
    )  # fmt: skip
    return q, k, v, base, meta


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_kernels_equal_the_reference(dtype: torch.dtype, window: int | None) -> None:
    assert OPS is not None
    q, k, v, base, meta = _case(dtype, window)
    ref, cpu = TorchOps(), CpuOps(OPS, KernelOptions())
    caches = {}
    for name, ops in (("ref", ref), ("cpu", cpu)):
        kc, vc = base.clone(), base.clone()
        ops.write_kv_(k, v, kc, vc, meta.slot_mapping)
        caches[name] = (kc, vc, ops.paged_decode(q, kc, vc, meta))
    (kr, vr, out_r), (kc, vc, out_c) = caches["ref"], caches["cpu"]
    # the same bytes, up to a value on a rounding boundary (the kernel is built with -ffast-math)
    assert (kc.int() - kr.int()).abs().max() <= 1 and (vc.int() - vr.int()).abs().max() <= 1
    # On VNNI CPUs the kernel also rounds each query head to int8 for its integer dot products
    # (kernels/kv_int8.cpp): about the keys' own rounding error again, on outputs of size ~1.
    tol = 3e-2 if OPS.int8_vnni_available() else (1e-5 if dtype == torch.float32 else 2e-2)
    torch.testing.assert_close(out_c.float(), out_r.float(), atol=tol, rtol=tol)


def _generate(model_dir: Path, **options: object) -> tuple[list, LLM]:  # type: ignore[type-arg]
    llm = LLM(str(model_dir), progress=False, max_model_len=256, **options)  # type: ignore[arg-type]
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 9 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)  # prompts now hit the prefix cache
    assert llm.engine.block_manager.prefix_hits > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    return first, llm


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_engine_with_int8_cache_stays_close_to_the_exact_one(
    model_dirs: dict[str, Path], backend: str
) -> None:
    if backend == "cpu" and OPS is None:
        pytest.skip("needs the CPU kernels")
    path = model_dirs["qwen2"]
    exact, _ = _generate(path, dtype="float32", kernel_backend=backend)
    got, llm = _generate(
        path, dtype="float32", kernel_backend=backend, kv_cache_dtype="int8", num_kv_blocks=40
    )
    assert llm.engine.executor.worker.runner.kv_caches[0][0].dtype == torch.int8
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got, exact, strict=True))
    assert same >= len(got) - 2, "int8 KV changed the greedy output of most prompts"
    for a, b in zip(got, exact, strict=True):  # the first token comes from the exact prompt K/V
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        first_a = a.outputs[0].logprobs[0][a.outputs[0].token_ids[0]].logprob
        first_b = b.outputs[0].logprobs[0][b.outputs[0].token_ids[0]].logprob
        assert first_a == pytest.approx(first_b, abs=1e-4)


@needs_kernels
def test_int8_cache_in_the_layer_stack_is_bit_identical(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama3"]
    outs = {}
    for stack in (True, False):
        got, llm = _generate(
            path, dtype="bfloat16", kv_cache_dtype="int8", layer_stack=stack, num_kv_blocks=10
        )
        assert bool(llm.engine.executor.worker.model.stack) is stack
        assert llm.engine.scheduler.num_preemptions > 0  # 10 blocks for 4 requests: preemption too
        outs[stack] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
    assert outs[True] == outs[False]


def test_bad_kv_cache_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="fp8 KV caches are for GPUs"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


def test_demo_model_perplexity_within_half_a_percent() -> None:
    """The trained demo model on held-out text, each 128-token window fed 16 tokens a step so
    every chunk attends to its context through the cache: INT8 within +0.5% of bfloat16's."""
    from swiftserve.engine.model_source import resolve_model
    from swiftserve.engine.tokenizer import load_tokenizer
    from swiftserve.tools.evaluate import engine_nll, load_text, windows_of

    model = str(resolve_model(None))
    windows = windows_of(
        load_tokenizer(model).encode(load_text("held-out"), add_special_tokens=False), 128, 1024
    )
    ppl = {}
    for kv in ("auto", "int8"):
        llm = LLM(model, dtype="bfloat16", kv_cache_dtype=kv, max_num_batched_tokens=16, progress=False)
        nll, count = engine_nll(llm, windows, progress=False)
        ppl[kv] = nll / count
    assert ppl["int8"] <= ppl["auto"] + 0.005  # log-perplexity: +0.5% perplexity
