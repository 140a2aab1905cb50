"""INT8 W8A8 on AVX512-VNNI CPUs (bfloat16 models): the decode GEMV and the batch path
(torch._int_mm) equal a reference that quantizes the activations the same way; the layer stack
stays bit-identical to the layer loop; an INT8 engine stays close to the engine built from the
dequantized weights (issue 21)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swiftserve import LLM, SamplingParams
from swiftserve.model import quant_linear
from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.quant_linear import Int8Linear, group_sums, w8a8_mm
from swiftserve.model.quant_ops import quantize_int8
from swiftserve.tools.demo import write_random_checkpoint

OPS = cpu_kernels()
pytestmark = pytest.mark.skipif(
    OPS is None or not OPS.int8_vnni_available(), reason="needs the CPU kernels with AVX512-VNNI"
)


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Activations rounded to int8 per ``group`` inputs (symmetric; float32 steps as the kernel
    takes them: amax / 127, times 1 / scale), then a float64 product with q * scale."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    s = xg.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    xq = torch.round(xg * (1 / s)).clamp(-127, 127)
    return ((xq.double() * s.double()).view(m, k) @ q.double().T) * scale.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(4, 64), (12, 128), (200, 576), (576, 1536)])
def test_gemv_equals_the_w8a8_reference(dtype: torch.dtype, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    q, scale = quantize_int8(torch.randn(n, k, generator=g))
    scale = scale.to(dtype)
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, k, generator=g).to(dtype)
        x[0, :64] *= 40  # an outlier group: its scale must not flatten the other groups
        out = OPS.int8_gemv_vnni(x, q, group_sums(q), scale)
        ref = w8a8_reference(x, q, scale, quant_linear.VNNI_GROUP)
        # integer dot products are exact: what is left is float32 summation, output rounding,
        # and now and then an activation on a rounding boundary landing one step over (the
        # kernel is built with -ffast-math)
        tol = 2e-4 if dtype == torch.float32 else 8e-3
        assert ((out.double() - ref).abs() / ref.abs().amax(-1, keepdim=True)).max() < tol, m


def test_gemv_refuses_shapes_it_cannot_run() -> None:
    q = torch.zeros(6, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="N % 4"):
        OPS.int8_gemv_vnni(torch.zeros(1, 64), q, group_sums(q), torch.ones(6))


def test_batch_path_equals_a_per_row_reference() -> None:
    g = torch.Generator().manual_seed(5)
    q, scale = quantize_int8(torch.randn(96, 320, generator=g))
    x = torch.randn(40, 320, generator=g).to(torch.bfloat16)
    ref = w8a8_reference(x, q, scale.to(torch.bfloat16), 320)  # one group per row
    for out in (w8a8_mm(x, q, scale.to(torch.bfloat16)), OPS.int8_mm_rows(x, q, scale.to(torch.bfloat16))):
        assert ((out.double() - ref).abs() / ref.abs().amax(-1, keepdim=True)).max() < 8e-3
    assert (
        OPS.INT8_VNNI_MAX_ROWS == quant_linear.INT8_VNNI_MAX_ROWS
    )  # the stack switches where the layer does


def test_layer_takes_the_vnni_path_for_bfloat16_only() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 192, bias=True)
    assert not Int8Linear(linear, OPS).vnni  # float32: the exact float kernel
    layer = Int8Linear(linear.to(torch.bfloat16), OPS)
    assert layer.vnni and layer.qweight.shape == (192, 576) and layer.wsum.shape == (192, 9)
    weight = layer.dequantized().float()
    for rows in (1, 3, 8, 9, 40):  # the GEMV up to INT8_VNNI_MAX_ROWS, torch._int_mm above
        x = torch.randn(rows, 576).to(torch.bfloat16)
        want = F.linear(x.float(), weight, linear.bias.float())
        got = layer(x).float()
        assert (got - want).abs().max() < 0.02 * want.abs().max(), rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    return write_random_checkpoint(
        tmp_path_factory.mktemp("qwen2"), preset="tiny", architecture="qwen2", **shape
    )


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_layer_stack_is_bit_identical_to_the_layer_loop(model_dir: Path, quantization: str) -> None:
    rng = random.Random(0)
    # 12 requests: decode steps above INT8_VNNI_MAX_ROWS rows take int8_mm_rows inside the stack too
    prompts = [
        {"prompt_token_ids": [rng.randrange(5, 500) for _ in range(n)]} for n in (3, 50, 21, *range(4, 13))
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = {}
    for stack in (True, False):
        llm = LLM(
            str(model_dir),
            dtype="bfloat16",
            quantization=quantization,
            quant_group_size=64,
            layer_stack=stack,
            progress=False,
        )
        model = llm.engine.executor.worker.model
        assert bool(model.stack) is stack
        outs[stack] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_onednn_copy_for_large_steps_equals_a_per_tensor_reference() -> None:
    """On AMX CPUs large steps (prompt chunks) go through a oneDNN-prepacked copy with one
    activation scale for the step; smaller ones never touch it."""
    if not quant_linear._onednn_int8():
        pytest.skip("this torch build has no oneDNN int8 linear")
    torch.manual_seed(1)
    layer = Int8Linear(nn.Linear(576, 192, bias=False).to(torch.bfloat16), OPS)
    layer.dual = True
    x = torch.randn(quant_linear.INT8_VNNI_MAX_ROWS + 1, 576).to(torch.bfloat16)
    layer(x)
    assert layer.onednn is None  # below INT8_ONEDNN_MIN_ROWS: int8_mm_rows
    x = torch.randn(quant_linear.INT8_ONEDNN_MIN_ROWS + 3, 576).to(torch.bfloat16)
    got = layer(x)
    assert layer.onednn is not None and got.dtype == torch.bfloat16
    xs = x.float().abs().max() / 127  # one scale for the whole step
    xq = torch.round(x.float() * (1 / xs)).clamp(-127, 127).double() * xs.double()
    ref = xq @ (layer.qweight.double() * layer.scale.double()[:, None]).T
    assert ((got.double() - ref).abs() / ref.abs().max()).max() < 8e-3
