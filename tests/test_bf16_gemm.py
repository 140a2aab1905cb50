"""Our bfloat16 GEMM kernel (PanelLinear) agrees with F.linear: same shapes, results at most
one bf16 rounding step apart and nearly always equal, for every row-tile remainder, partial
panels, bias, strided and N-d inputs; pack_linears picks it and honours the oneDNN switch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.packed_linear import (
    PackedLinear,
    PanelLinear,
    pack_linears,
    pack_panels,
    panel_kernels,
    unpack_panels,
)

OPS = cpu_kernels()
pytestmark = pytest.mark.skipif(
    OPS is None or not OPS.bf16_gemm_available(), reason="bf16 GEMM kernel needs AVX512-BF16"
)


def bf16_linear(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(torch.bfloat16)


def assert_matches_f_linear(got: torch.Tensor, linear: nn.Linear, x: torch.Tensor) -> None:
    want = F.linear(x, linear.weight, linear.bias)
    exact = F.linear(
        x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double()
    )
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # Both round an fp32 sum once: each is within one bf16 step (2^-8 relative) of the exact
    # product, and they differ only where the sums fall near a rounding boundary.
    scale = exact.abs().clamp_min(exact.abs().max() * 1e-3)
    assert ((got.double() - exact).abs() / scale).max().item() < 2**-7
    assert (got != want).double().mean().item() < 0.01


@pytest.mark.parametrize("path", ["panel", "onednn", "dual"])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 15, 64, 70, 600])
@pytest.mark.parametrize(
    ("n", "k", "bias"), [(960, 576, False), (100, 64, True), (50, 30, True), (48, 1536, False)]
)
def test_panel_linear_matches_f_linear(rows: int, n: int, k: int, bias: bool, path: str) -> None:
    """Both of PanelLinear's paths, whatever this CPU picks: our kernel, and oneDNN over the
    weight unpacked from the panels (what AMX CPUs use from 128 rows)."""
    linear = bf16_linear(n, k, bias, seed=rows + n)
    layer = PanelLinear(linear, OPS)
    layer.onednn_rows = 1 if path == "onednn" else 1 << 62
    if path == "dual":  # the oneDNN-packed copy AMX CPUs keep (used past our AMX path)
        layer.add_onednn_copy()
        layer.dual_rows = 1
    x = torch.randn(rows, k).to(torch.bfloat16)
    assert_matches_f_linear(layer(x), linear, x)


@pytest.mark.parametrize(("n", "k"), [(960, 576), (50, 30), (1, 64)])
def test_unpack_panels_round_trip(n: int, k: int) -> None:
    weight = torch.randn(n, k).to(torch.bfloat16)
    assert torch.equal(unpack_panels(pack_panels(weight, OPS.bf16_gemm_panel_width()), n), weight)


def test_strided_and_batched_inputs() -> None:
    linear = bf16_linear(200, 128, True, seed=1)
    layer = PanelLinear(linear, OPS)
    wide = torch.randn(33, 300).to(torch.bfloat16)
    x = wide[:, 10:138]  # rows strided, columns contiguous: used as is
    assert_matches_f_linear(layer(x), linear, x.contiguous())
    cube = torch.randn(3, 11, 128).to(torch.bfloat16)
    out = layer(cube)
    assert out.shape == (3, 11, 200)
    assert_matches_f_linear(out.view(33, 200), linear, cube.view(33, 128))
    transposed = torch.randn(128, 9).to(torch.bfloat16).t()  # columns strided: copied first
    assert_matches_f_linear(layer(transposed), linear, transposed.contiguous())


def test_pack_layout_and_bad_inputs() -> None:
    w = torch.arange(5 * 4, dtype=torch.float32).view(5, 4).to(torch.bfloat16)
    packed = pack_panels(w, 48)
    assert packed.shape == (1, 2, 48, 2)
    assert packed[0, 1, 3].tolist() == [w[3, 2].item(), w[3, 3].item()]  # row 3, features 2 and 3
    assert packed[0, :, 5:].abs().sum().item() == 0  # padding rows are zero
    layer = PanelLinear(bf16_linear(40, 64, False, seed=2), OPS)
    with pytest.raises(RuntimeError, match="disagree"):
        OPS.bf16_linear(torch.zeros(2, 62, dtype=torch.bfloat16), layer.packed, 40, None)
    with pytest.raises(RuntimeError, match="bf16"):
        OPS.bf16_linear(torch.zeros(2, 64), layer.packed, 40, None)


def test_pack_linears_chooses_kernel_and_honours_switch() -> None:
    def model() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 33, bias=False), nn.Linear(33, 8)).to(
            torch.bfloat16
        )

    reference = model()
    x = torch.randn(5, 64).to(torch.bfloat16)
    ours = model()
    assert pack_linears(ours, OPS) == 3
    kinds = [type(m) for m in ours]
    assert kinds == [PanelLinear, PanelLinear, PackedLinear]  # odd in_features (33): oneDNN
    torch.testing.assert_close(ours(x).float(), reference(x).float(), rtol=2e-2, atol=2e-2)
    assert panel_kernels(nn.Linear(64, 8).to(torch.bfloat16), None) is None  # bf16_gemm="onednn"
    onednn = model()
    assert pack_linears(onednn, None) == 3 and all(isinstance(m, PackedLinear) for m in onednn)
    torch.testing.assert_close(onednn(x).float(), reference(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(OPS is None or not OPS.bf16_gemm_amx_rows(576), reason="needs our AMX GEMM path")
def test_amx_path_is_batch_invariant_up_to_its_limit() -> None:
    """On AMX every step of up to bf16_gemm_amx_rows rows goes through tiles of 16 rows: a
    row's result is the same bits whatever the batch around it (speculative verification
    rows equal the one-row decode they replace), and each matches F.linear."""
    limit = OPS.bf16_gemm_amx_rows(576)
    linear = bf16_linear(960, 576, True, seed=11)
    layer = PanelLinear(linear, OPS)
    assert layer.dual_rows == limit + 1 and layer.onednn_rows == max(128, limit + 1)
    x = torch.randn(limit + 1, 576).to(torch.bfloat16)
    one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(limit)])
    for rows in (2, 4, 16, 17, 40, limit):
        got = layer(x[:rows])
        assert torch.equal(got, one_by_one[:rows]), rows
        assert_matches_f_linear(got, linear, x[:rows])
    assert_matches_f_linear(layer(x), linear, x)  # one row more: the vector path


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_warm_up_makes_the_onednn_copies_at_start_and_changes_no_output(
    tmp_path: Path, quantization: str | None
) -> None:
    """`swiftserve serve` (EngineConfig.warm_up) makes the oneDNN copies that large steps use
    at start; the offline default makes them in the first large step. Same tokens either way."""
    from swiftserve import LLM, SamplingParams
    from swiftserve.tools.demo import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "m", preset="tiny", architecture="llama", hidden_size=256)
    prompt = {"prompt_token_ids": list(range(5, 405))}  # 400 rows: past every AMX GEMM limit
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = []
    for warm in (False, True):
        llm = LLM(str(path), dtype="bfloat16", warm_up=warm, quantization=quantization, progress=False)
        model = llm.engine.executor.worker.model
        copies = [m.onednn is not None for m in model.modules() if getattr(m, "dual", False)]
        amx_copies = [m for m in model.modules() if getattr(m, "amx", None) is not None]
        if not copies and not amx_copies:
            pytest.skip("no oneDNN or AMX GEMM copies on this CPU (AMX only)")
        if copies:
            assert all(copies) is warm and any(copies) is warm
        else:  # bf16 linears whose AMX GEMM copies (made at load) serve every large step
            assert quantization is None
        outs.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]
