"""The fused CPU layer ops (RMSNorm, residual-add + RMSNorm, rotary, SiLU-and-mul) agree with
the PyTorch path they replace, in float32 and bfloat16; so does the K/V cache write."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.llama import RMSNorm
from swiftserve.model.ops import CpuOps, KernelOptions, TorchOps
from swiftserve.model.rotary import RotaryEmbedding, apply_rotary

OPS = cpu_kernels()
REF = TorchOps()
CPU = CpuOps(OPS, KernelOptions()) if OPS is not None else REF
pytestmark = pytest.mark.skipif(OPS is None, reason="CPU kernels could not be built here")
DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # at most one bf16 rounding step apart, and nearly always equal
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
        assert (got != want).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_and_residual_add(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(rows, 576).to(dtype)
    residual = torch.randn(rows, 576).to(dtype)
    close(norm(x, CPU), norm(x, REF))
    want, want_res = norm.add_forward(x, residual.clone(), REF)
    fused_res = residual.clone()
    got, got_res = norm.add_forward(x, fused_res, CPU)
    assert got_res is fused_res  # updated in place
    close(got_res, want_res)
    close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_the_fused_qkv_output(dtype: torch.dtype) -> None:
    heads, kv_heads, dim, tokens = 9, 3, 64, 11
    rotary = RotaryEmbedding(dim, 256, 10000.0, {})
    cos, sin = rotary.tables(torch.arange(100, 100 + tokens), dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q = apply_rotary(q.reshape(tokens, heads, dim), cos, sin)
    want_k = apply_rotary(k.reshape(tokens, kv_heads, dim), cos, sin)
    want_v = v.clone()
    fused = qkv.clone()
    OPS.rope_qk_(fused, cos, sin, heads + kv_heads, dim)
    got_q, got_k, got_v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    close(got_q.reshape(tokens, heads, dim), want_q)
    close(got_k.reshape(tokens, kv_heads, dim), want_k)
    assert torch.equal(got_v, want_v)  # v is not rotated


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate_up = (torch.randn(5, 2 * 1536) * 3).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    close(OPS.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_extremes_and_odd_widths(dtype: torch.dtype) -> None:
    # the vector path's exp and reciprocal at overflow (e^89 is inf in float32), underflow,
    # zero and NaN; 40 columns leave a scalar tail after two vectors
    edge = torch.tensor([-1e4, -100.0, -89.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 89.0, 1e4])
    gate = torch.cat([edge, torch.randn(28) * 5]).repeat(3, 1)
    up = torch.randn(3, 40)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    g, u = gate_up.split(40, dim=-1)
    got, want = OPS.silu_and_mul(gate_up), F.silu(g) * u
    # past x = -88 ours gives ~1e-35 where PyTorch gives -0: equal within any tolerance
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-30)
    close(got[:, 3:], want[:, 3:])
    nan = gate_up.clone()
    nan[0, 3] = float("nan")
    assert OPS.silu_and_mul(nan)[0, 3].isnan()


def test_bad_inputs_raise_instead_of_corrupting() -> None:
    with pytest.raises(RuntimeError, match="contiguous"):
        OPS.silu_and_mul(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="dtype"):
        OPS.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_kernel_matches_index_copy(dtype: torch.dtype) -> None:
    """K/V views into a fused qkv output land at their slots exactly as index_copy_ puts them."""
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim, blocks, bs = 37, 6, 2, 16, 12, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * bs)[:tokens]
    caches = [torch.zeros(kv_heads, blocks, bs, dim, dtype=dtype) for _ in range(4)]
    REF.write_kv_(k, v, caches[0], caches[1], slots)
    CPU.write_kv_(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="slot out of range"):
        OPS.write_kv_(k, v, caches[2], caches[3], slots + blocks * bs)
