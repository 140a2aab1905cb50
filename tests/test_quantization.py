"""INT8 / INT4 weight-only quantization: round-trip bounds, both kernel paths, and a quantized
engine giving the same greedy output as an unquantized one built from the dequantized weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from swiftserve import LLM, SamplingParams
from swiftserve.model import quant_linear
from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.quant_linear import Int4Linear, Int8Linear, int4_group_for, quantize_model, weight_bytes
from swiftserve.model.quant_ops import (
    dequantize_int4,
    dequantize_int8,
    pack_int4_pairs,
    quantize_int4,
    quantize_int8,
    unpack_int4_pairs,
)

LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight")  # fmt: skip


def test_int8_round_trip_error_is_at_most_half_a_step() -> None:
    w = torch.randn(96, 200) * torch.linspace(0.01, 3.0, 96)[:, None]  # very different row ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (dequantize_int8(q, scale) - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-6)
    # The largest weight of each row is represented exactly (up to float rounding).
    assert torch.allclose(dequantize_int8(q, scale).abs().amax(1), w.abs().amax(1), rtol=1e-6)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_error_is_at_most_half_a_step(group: int) -> None:
    w = torch.randn(64, 256) + torch.linspace(-2, 2, 256)  # groups with offsets: needs the zero point
    q, scale, zero = quantize_int4(w, group)
    assert q.min() >= 0 and q.max() <= 15
    assert scale.shape == (64, 256 // group) == zero.shape
    err = (dequantize_int4(q, scale, zero) - w).abs().view(64, -1, group)
    assert torch.all(err <= scale[..., None] / 2 + 1e-5)
    assert torch.equal(unpack_int4_pairs(pack_int4_pairs(q)), q)


def test_int4_rejects_bad_group_sizes() -> None:
    with pytest.raises(ValueError, match="quant_group_size"):
        quantize_int4(torch.randn(8, 64), 48)
    with pytest.raises(ValueError, match="multiple"):
        quantize_int4(torch.randn(8, 96), 64)
    assert int4_group_for(576, 128) == 64
    assert int4_group_for(40, 32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_both_kernel_paths_compute_with_the_dequantized_weight(kind: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 192, bias=True).to(dtype)
    layer = Int8Linear(linear, cpu_kernels()) if kind == "int8" else Int4Linear(linear, 32)
    weight = layer.dequantized().float()
    tol = 1e-4 if dtype == torch.float32 else 0.03  # bf16 output rounding on values of size ~2
    for rows in (1, 2, 3, 5, 40):  # fused kernel for few rows, dequantize + GEMM for many
        x = torch.randn(rows, 256).to(dtype)
        expected = F.linear(x.float(), weight, linear.bias.float())
        assert (layer(x).float() - expected).abs().max().item() < tol, rows


def test_int8_kernel_layout_round_trips_and_is_used_here() -> None:
    w = torch.randint(-127, 128, (64, 96), dtype=torch.int8)
    assert torch.equal(quant_linear.unpack_rows4(quant_linear.pack_rows4(w)), w)
    layer = Int8Linear(nn.Linear(96, 64, bias=False), cpu_kernels())
    if layer.kernel is None:
        pytest.skip("CPU kernels not built here")
    assert layer.qweight.shape == (16, 6, 4, 16)  # packed for the GEMV kernel
    assert torch.equal(layer.int8_values(), quantize_int8(layer.dequantized().float())[0])


def test_int4_unpacks_the_fused_kernel_layout() -> None:
    linear = nn.Linear(128, 192, bias=False)
    layer = Int4Linear(linear, 64)
    if not layer.fused:
        pytest.skip("fused int4 kernel not available on this CPU")
    q, _, _ = quantize_int4(linear.weight.detach(), 64)
    assert torch.equal(layer.int4_values(), q)


def test_int4_onednn_copy_for_large_steps_equals_the_dequantized_gemm() -> None:
    """bfloat16 INT4 layers on AMX CPUs keep a dequantized oneDNN copy for steps of
    INT4_ONEDNN_MIN_ROWS+ rows (made on first use): the same products as F.linear over the
    dequantized weight; smaller steps never make it."""
    if not quant_linear.packing_supported_here():
        pytest.skip("oneDNN packed linears unavailable")
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(128, 192, bias=True)).to(torch.bfloat16)
    quantize_model(model, "int4", group_size=64, lm_head=True)
    layer = model[0]
    assert isinstance(layer, Int4Linear)
    layer.dual = True  # what quantize_model sets on AMX CPUs (asserted below where there is AMX)
    x = torch.randn(quant_linear.INT4_ONEDNN_MIN_ROWS - 1, 128).to(torch.bfloat16)
    layer(x)
    assert layer.onednn is None
    x = torch.randn(quant_linear.INT4_ONEDNN_MIN_ROWS + 5, 128).to(torch.bfloat16)
    got = layer(x)
    assert layer.onednn is not None
    assert torch.equal(got, F.linear(x, layer.dequantized()) + layer.bias)  # as the layer adds it


def test_quantize_model_marks_int4_copies_on_amx_only() -> None:
    from swiftserve.model.ops import amx_available

    for dtype in (torch.bfloat16, torch.float32):
        model = nn.Sequential(nn.Linear(128, 192, bias=False)).to(dtype)
        quantize_model(model, "int4", group_size=64, lm_head=True)
        want = dtype == torch.bfloat16 and amx_available() and quant_linear.packing_supported_here()
        assert model[0].dual is want, dtype


def test_quantize_model_leaves_lm_head_and_reports_smaller_weights() -> None:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(128, 256, bias=False))
    model.add_module("lm_head", nn.Linear(256, 64, bias=False))
    before = weight_bytes(model)
    assert quantize_model(model, "int8") == 1
    assert isinstance(model.proj, Int8Linear) and isinstance(model.lm_head, nn.Linear)
    assert weight_bytes(model) == before - 128 * 256 * 4 + 128 * 256 + 256 * 4
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(model, "int3")


def _dequantized_checkpoint(src: Path, dst: Path, kind: str, group: int) -> Path:
    """A float32 copy of ``src`` whose linear weights are replaced by dequantize(quantize(w))."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, w in tensors.items():
            if name.endswith(LINEAR_SUFFIXES):
                if kind == "int8":
                    tensors[name] = dequantize_int8(*quantize_int8(w))
                else:
                    tensors[name] = dequantize_int4(*quantize_int4(w, group))
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("fused_rows", [0, 1 << 20], ids=["dense-path", "fused-path"])
@pytest.mark.parametrize(("kind", "group"), [("int8", 128), ("int4", 32)])
def test_quantized_engine_equals_engine_on_dequantized_weights(
    model_dirs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    group: int,
    fused_rows: int,
) -> None:
    # Force one kernel path for every batch size, so both are compared end to end.
    monkeypatch.setattr(quant_linear, "INT8_FUSED_MAX_ROWS", fused_rows)
    monkeypatch.setattr(quant_linear, "INT4_FUSED_MAX_ROWS", fused_rows)
    src = model_dirs["qwen2"]  # has qkv bias: biases stay unquantized
    ref_dir = _dequantized_checkpoint(src, tmp_path / "dequantized", kind, group)
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 7 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    common = dict(progress=False, dtype="float32", max_model_len=256)
    quantized = LLM(str(src), quantization=kind, quant_group_size=group, **common)  # type: ignore[arg-type]
    reference = LLM(str(ref_dir), **common)  # type: ignore[arg-type]
    got = quantized.generate(prompts, params, use_tqdm=False)
    want = reference.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp_a = [a.outputs[0].logprobs[j][t].logprob for j, t in enumerate(a.outputs[0].token_ids)]
        lp_b = [b.outputs[0].logprobs[j][t].logprob for j, t in enumerate(b.outputs[0].token_ids)]
        assert lp_a == pytest.approx(lp_b, abs=1e-4)
    assert quantized.engine.model_info.weight_bytes < reference.engine.model_info.weight_bytes


def test_serve_and_generate_take_quantization_flags(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import openai

    from server_utils import running_server
    from swiftserve.cli import main

    offline = LLM(str(llama_dir), progress=False, max_model_len=256, quantization="int8")
    want = offline.generate("def f(x):", SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    args = ("--max-model-len", "256", "--quantization", "int8", "--served-model-name", "q")
    with running_server(llama_dir, *args, log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        got = client.completions.create(model="q", prompt="def f(x):", max_tokens=8, temperature=0.0)
    assert got.choices[0].text == want[0].outputs[0].text
    argv = ["generate", "--model", str(llama_dir), "--quantization", "int4", "--quant-group-size", "32",
            "--prompt", "def f(x):", "--max-tokens", "4"]  # fmt: skip
    assert main(argv) == 0
    assert "finish_reason: length, tokens: 4" in capsys.readouterr().out
