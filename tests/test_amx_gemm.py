"""The AMX GEMM (amx_gemm.cpp): plain products equal oneDNN's bf16 GEMM; the fused epilogues
(SiLU-and-mul, rotary of q/k, residual add + RMSNorm) equal the unfused calls bit for bit for
every row remainder; a small bf16 model takes them for prompt chunks with unchanged output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from swiftserve import LLM, SamplingParams
from swiftserve.model import packed_linear
from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.packed_linear import (
    PanelLinear,
    interleave_gate_up,
    make_onednn_copies,
    pack_amx,
    rope_order,
)
from swiftserve.tools.demo import write_random_checkpoint

OPS = cpu_kernels()
pytestmark = pytest.mark.skipif(
    OPS is None or not hasattr(OPS, "amx_gemm_available") or not OPS.amx_gemm_available(),
    reason="AMX GEMM needs AMX-BF16 and AVX512-BF16",
)


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("m", [1, 31, 32, 33, 130, 300, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_plain_product_equals_onednn(m: int, bias: bool) -> None:
    w, x = weights(96, 64, 0), rows(m, 64, 1)
    b = rows(1, 96, 2)[0].contiguous() if bias else None
    got = OPS.amx_linear(x, pack_amx(w), 96, False, b)
    want = F.linear(x, w, b)
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=8e-3)  # at most a rounding step
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize(("m", "k", "inter"), [(1, 64, 16), (37, 96, 48), (128, 576, 1536), (300, 64, 80)])
def test_fused_silu_mul_equals_gemm_then_silu_and_mul(m: int, k: int, inter: int) -> None:
    w, x = weights(2 * inter, k, 2), rows(m, k, 3) * 4  # scaled: SiLU's tails matter too
    got = OPS.amx_linear(x, pack_amx(interleave_gate_up(w, inter)), 2 * inter, True)
    gate_up = F.linear(x, w)
    want = OPS.silu_and_mul(gate_up)
    assert got.shape == (m, inter)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=1.6e-2)
    assert (got == want).float().mean() > 0.99
    gate, up = gate_up.float().chunk(2, -1)
    torch.testing.assert_close(got.float(), F.silu(gate) * up, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("m", "heads", "kv_heads"), [(1, 2, 1), (45, 3, 1), (200, 9, 3)])
def test_fused_rotary_equals_gemm_then_rope(m: int, heads: int, kv_heads: int) -> None:
    k, n = 64, (heads + 2 * kv_heads) * 64
    w, x = weights(n, k, 4), rows(m, k, 5)
    b = rows(1, n, 3)[0].contiguous() if m == 45 else None  # one case with a bias (Qwen2's q/k/v)
    pos = torch.arange(m, dtype=torch.float32)[:, None] * 7 + 3
    freqs = pos * 10000.0 ** (-torch.arange(0, 32, dtype=torch.float32) / 32)
    cos = torch.cat([freqs.cos(), freqs.cos()], -1).bfloat16().view(m, 1, 64)
    sin = torch.cat([freqs.sin(), freqs.sin()], -1).bfloat16().view(m, 1, 64)
    want = OPS.amx_linear(x, pack_amx(w), n, False, b)
    OPS.rope_qk_(want, cos, sin, heads + kv_heads, 64)
    rot = heads + kv_heads
    b_rot = None if b is None else rope_order(b.view(-1, 1), rot).view(-1).contiguous()
    got = OPS.amx_linear_rope(x, pack_amx(rope_order(w, rot)), n, cos, sin, rot * 64, b_rot)
    assert torch.equal(got, want)  # q and k rotated, v as it was


@pytest.mark.parametrize("m", [1, 40, 300])
def test_fused_add_rms_norm_equals_gemm_then_add_rms_norm(m: int) -> None:
    k, n = 96, 64
    w, x = weights(n, k, 6), rows(m, k, 7)
    residual = rows(m, n, 8)
    norm_weight = (1 + 0.1 * rows(1, n, 9)[0]).contiguous()
    want_residual = residual.clone()
    want = OPS.add_rms_norm(OPS.amx_linear(x, pack_amx(w), n, False), want_residual, norm_weight, 1e-5)
    got_residual = residual.clone()
    got = OPS.amx_linear_add_rms(x, pack_amx(w), n, got_residual, norm_weight, 1e-5)
    assert torch.equal(got, want) and torch.equal(got_residual, want_residual)
    assert not torch.equal(got_residual, residual)  # updated in place


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(RuntimeError, match="multiples of 32"):
        OPS.amx_linear(rows(4, 48, 0), torch.zeros(96 * 48, dtype=torch.bfloat16), 96, False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
def test_small_model_takes_the_fused_paths(tmp_path: Path, arch: str) -> None:
    model_dir = write_random_checkpoint(
        tmp_path,
        preset="tiny",
        architecture=arch,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
    )  # head_dim 64: q/k/v take the fused rotary too
    llm = LLM(model=str(model_dir), dtype="bfloat16", enable_prefix_caching=False)
    model = llm.engine.executor.worker.model
    assert sum(isinstance(m, PanelLinear) and m.amx_silu is not None for m in model.modules()) == 2
    assert sum(isinstance(m, PanelLinear) and m.amx_rope is not None for m in model.modules()) == 2
    assert sum(isinstance(m, PanelLinear) and m.amx is not None for m in model.modules()) >= 4  # o, down
    with_amx = [
        m
        for m in model.modules()
        if isinstance(m, PanelLinear) and (m.amx, m.amx_silu, m.amx_rope) != (None,) * 3
    ]
    assert make_onednn_copies(model) == 0 and all(
        m.onednn is None and not m.dual for m in with_amx
    )  # no third copy
    prompt = {"prompt_token_ids": [(7 * i) % 290 + 5 for i in range(200)]}  # one 200-row chunk
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    fused = llm.generate([prompt], params, use_tqdm=False)[0]
    saved, packed_linear.AMX_LINEAR_ROWS = packed_linear.AMX_LINEAR_ROWS, 1 << 30
    try:
        plain = llm.generate([prompt], params, use_tqdm=False)[0]
    finally:
        packed_linear.AMX_LINEAR_ROWS = saved
    # the fused kernel gives the unfused path's bits, so the whole forward is the same
    assert fused.outputs[0].token_ids == plain.outputs[0].token_ids
    assert fused.prompt_logprobs == plain.prompt_logprobs
