"""One C++ call for the whole decoder stack (``kernels/layer_stack.cpp``), when it applies.

It applies to bfloat16 models whose linears are all ``PanelLinear`` (our GEMM), INT8 layers
on the W8A8 VNNI kernels (``Int8Linear.vnni``) or INT4 layers on PyTorch's fused kernel, and
to steps
whose every row goes through the fused attention kernel (decode rows, and prompt rows when
the runner sends them there). It computes exactly what the Python layer loop computes with
the kernels on (same functions, same order: bit-identical), without ~20 interpreter-level
calls per layer. ``EngineConfig(layer_stack=False)`` turns it off (model/ops.py: CpuOps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swiftserve.model import quant_linear
from swiftserve.model.attention import AttentionMetadata
from swiftserve.model.packed_linear import PanelLinear
from swiftserve.model.quant_linear import Int4Linear, Int8Linear

if TYPE_CHECKING:
    from swiftserve.model.llama import LlamaForCausalLM

_NONE = torch.empty(0, dtype=torch.bfloat16)  # no bias; no scale (a bf16 weight)


def _linear(module: Any) -> list[torch.Tensor] | None:
    """[weight, scale, group sums] of a linear the stack can run (empty tensors for a bf16
    one), or None."""
    if isinstance(module, PanelLinear):
        return [module.packed, _NONE, _NONE]
    if isinstance(module, Int8Linear) and module.vnni:
        return [module.qweight, module.scale, module.wsum]
    if isinstance(module, Int4Linear) and module.fused:
        return [module.qweight, module.scales_and_zeros, _NONE]
    return None


def stack_weights(model: LlamaForCausalLM) -> list[torch.Tensor] | None:
    """The per-layer tensors ``decoder_stack`` takes, or None when the model does not qualify."""
    if model.dtype != torch.bfloat16:
        return None
    weights: list[torch.Tensor] = []
    for layer in model.model.layers:
        block: Any = layer  # a DecoderLayer (ModuleList items are typed as plain Modules)
        linears = [
            block.self_attn.qkv_proj,
            block.self_attn.o_proj,
            block.mlp.gate_up_proj,
            block.mlp.down_proj,
        ]
        runnable = [_linear(m) for m in linears]
        if any(r is None for r in runnable) or any(m.bias is not None for m in linears[1:]):
            return None
        qkv, o, gate_up, down = runnable
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        bias = linears[0].bias if linears[0].bias is not None else _NONE
        weights += [block.input_layernorm.weight, *qkv, bias, *o]
        weights += [block.post_attention_layernorm.weight, *gate_up, *down]
    return weights


def max_rows(model: nn.Module, weights: list[torch.Tensor]) -> int | None:
    """The row count from which a quantized stack must leave steps to the layer loop (where
    the layers switch kernels), or None when it may take any step. INT8 (W8A8) switches inside
    the stack exactly where Int8Linear does, except for steps of INT8_ONEDNN_MIN_ROWS+ when the
    layers have oneDNN copies (``Int8Linear.dual``); INT4 layers dequantize above
    INT4_FUSED_MAX_ROWS, or use their bfloat16 oneDNN copies from INT4_ONEDNN_MIN_ROWS."""
    if any(w.dtype == torch.uint8 for w in weights):
        if any(isinstance(m, Int4Linear) and m.dual for m in model.modules()):
            return quant_linear.INT4_ONEDNN_MIN_ROWS
        return quant_linear.INT4_FUSED_MAX_ROWS + 1
    if any(isinstance(m, Int8Linear) and m.dual for m in model.modules()):  # large steps: oneDNN copies
        return quant_linear.INT8_ONEDNN_MIN_ROWS
    return None


def applies(meta: AttentionMetadata, num_tokens: int) -> bool:
    """Whether every row of this step is answered by the fused attention kernel."""
    return (
        not meta.prefills
        and meta.tiles is None
        and meta.num_decode == num_tokens
        and meta.decode_tables is not None
        and meta.decode_positions is not None
    )


def _stack_args(
    model: LlamaForCausalLM,
    weights: list[torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> list[Any]:
    """The arguments both C++ stack calls take after the hidden states."""
    cfg = model.config
    assert meta.decode_tables is not None and meta.decode_positions is not None
    return [
        weights,
        [k for k, _ in kv_caches],
        [v for _, v in kv_caches],
        model.model.norm.weight,
        rope[0],
        rope[1],
        meta.decode_tables,
        meta.decode_positions,
        meta.slot_mapping,
        [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size],
        model.model.norm.eps,
        cfg.head_dim**-0.5,
        meta.window or -1,
    ]


def run_stack(
    kernels: Any,
    model: LlamaForCausalLM,
    weights: list[torch.Tensor],
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Final-normed hidden states of the step, from the embeddings ``h``."""
    return kernels.decoder_stack(h, *_stack_args(model, weights, rope, kv_caches, meta))  # type: ignore[no-any-return]


def run_stage_stack(
    kernels: Any,
    model: LlamaForCausalLM,
    weights: list[torch.Tensor],
    h: torch.Tensor,
    residual: torch.Tensor | None,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
    last: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pipeline stage's layers (model/llama.py ``forward_stage``): (output, residual) for
    the next stage, or (final-normed hidden states, None) on the last."""
    args = _stack_args(model, weights, rope, kv_caches, meta)
    out, res = kernels.decoder_stack_stage(h, residual if residual is not None else _NONE, *args, last)
    return out, None if last else res
