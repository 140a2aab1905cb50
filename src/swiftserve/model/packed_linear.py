"""Prepacked linear layers for bfloat16 on CPU.

Two kinds, both packed once at load time:

- ``PanelLinear``: our AVX512-BF16 kernel (``kernels/bf16_gemm.cpp``) over a weight packed
  in 48-column panels. Chosen when the compiled kernels have it. On SmolLM-135M's layer
  shapes with weights streamed from DRAM it takes 0.65-0.7x oneDNN's time at batch 64 and
  about half at batch 1-8 (docs/benchmarks.md). Sums in another order than ``F.linear``:
  results may differ in the last bf16 bit.
- ``PackedLinear``: oneDNN's blocked layout, bit-identical to ``F.linear``; the fallback
  (no AVX512-BF16, odd in_features, or ``EngineConfig(bf16_gemm="onednn")``).

float32 is left on ``F.linear`` on purpose: the packed float32 kernels sum in another
order, and the float32 path is the one that must match transformers token for token.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)
AMX_ONEDNN_ROWS = 128  # rows from which PanelLinear hands the GEMM to oneDNN on AMX CPUs
# On AMX CPUs, models whose bf16 linears fit this keep a oneDNN-packed second copy, used from
# ``PanelLinear.dual_rows`` rows: past our kernel's AMX path (bf16_gemm_amx_rows), or from
# DUAL_PACK_ROWS where that path cannot run (in_features not a multiple of 32).
DUAL_PACK_MAX_BYTES = 2 << 30
DUAL_PACK_ROWS = 8
# Rows from which a linear with an AMX-packed copy (add_amx_copies) runs amx_linear: prompt
# chunks (below, oneDNN's copy or our kernels; at 37 rows amx_linear took 1.4-1.7x oneDNN's time)
AMX_LINEAR_ROWS = 128


class PackedLinear(nn.Module):
    """A bias-optional linear layer over a oneDNN-packed bfloat16 weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
        return out if self.bias is None else out + self.bias


class PanelLinear(nn.Module):
    """A bias-optional bfloat16 linear layer over a panel-packed weight (our GEMM kernel)."""

    packed: torch.Tensor  # a registered buffer: [ceil(N/48), K/2, 48, 2]

    def __init__(self, linear: nn.Linear, kernels: ModuleType):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kernels = kernels
        self.register_buffer("packed", pack_panels(linear.weight.detach(), kernels.bf16_gemm_panel_width()))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().contiguous(), False)
        # Our kernel runs up to ``amx_rows`` rows on AMX tiles (1.3-2x oneDNN's time there,
        # bf16_gemm.cpp); beyond, or on its vector path, oneDNN is faster from a few rows.
        amx_rows = int(kernels.bf16_gemm_amx_rows(self.in_features)) if _amx() else 0
        self.onednn_rows = max(AMX_ONEDNN_ROWS, amx_rows + 1) if _amx() else 1 << 62
        self.onednn: torch.Tensor | None = None  # a oneDNN-packed second copy (AMX, small models)
        self.dual = False  # use (and on first use make) that copy for batches of ``dual_rows``+
        self.dual_rows = amx_rows + 1 if amx_rows else DUAL_PACK_ROWS
        self.amx_silu: torch.Tensor | None = None  # an MLP's gate/up for amx_linear (add_amx_copies)
        self.amx: torch.Tensor | None = None  # the weight for amx_linear (add_amx_copies)
        self.amx_rope: torch.Tensor | None = None  # q/k/v for amx_linear_rope (add_amx_copies)
        self.amx_bias: torch.Tensor | None = None  # the bias in the order of amx / amx_rope's columns

    def add_onednn_copy(self) -> None:
        """Keep a oneDNN-packed copy beside the panels (twice the weight memory)."""
        weight = unpack_panels(self.packed, self.out_features)
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.dual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.amx is not None and rows.shape[0] >= AMX_LINEAR_ROWS:
            out = self.kernels.amx_linear(rows, self.amx, self.out_features, False, self.amx_bias)
            return out.view(*x.shape[:-1], self.out_features)  # type: ignore[no-any-return]
        if self.dual and rows.shape[0] >= self.dual_rows:
            # AMX: oneDNN's packed copy beats our vector path from 8 rows (5.6x at 64) and our
            # AMX path from a few hundred; made on first use, so single-stream users pay
            # neither its memory nor its start-up time
            if self.onednn is None:
                self.add_onednn_copy()
            assert self.onednn is not None
            out = torch.ops.mkldnn._linear_pointwise(
                rows.contiguous(), self.onednn, self.bias, "none", [], ""
            )
            return out.view(*x.shape[:-1], self.out_features)
        if rows.shape[0] >= self.onednn_rows:
            # a prompt chunk on an AMX CPU: oneDNN's AMX GEMM over the weight unpacked for this
            # call (no second copy kept) is 2-7x faster than our kernel from 128 rows up
            return F.linear(x, unpack_panels(self.packed, self.out_features), self.bias)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = self.kernels.bf16_linear(rows, self.packed, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] -> [ceil(N/width), K/2, width, 2]: for each pair of input features, the pairs
    of ``width`` output columns side by side (rows past N are zero)."""
    n, k = weight.shape
    panels = -(-n // width)
    padded = torch.zeros(panels * width, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(panels, width, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [N, K] weight back from ``pack_panels``' layout (a copy). Each pair of bf16 values
    moves as one int32, so this is a plain 2-D transpose per panel (3.4x faster than
    permuting the 4-D bf16 view)."""
    panels, half_k, width, _ = packed.shape
    pairs = packed.view(torch.int32).view(panels, half_k, width)
    return (
        pairs.transpose(1, 2)
        .contiguous()
        .view(torch.bfloat16)
        .view(panels * width, half_k * 2)[:out_features]
    )


def _amx() -> bool:
    from swiftserve.model.ops import amx_available

    return amx_available()


def panel_kernels(linear: nn.Linear, kernels: ModuleType | None) -> ModuleType | None:
    """``kernels`` when ``linear`` can use PanelLinear with them here, else None."""
    if kernels is None or linear.weight.dtype != torch.bfloat16 or linear.in_features % 2:
        return None
    return kernels if kernels.bf16_gemm_available() else None


def packing_supported(dtype: torch.dtype) -> bool:
    """True when packed linears are available and exact here (checked on a probe)."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = nn.Linear(64, 48, bias=False).to(dtype)
        x = torch.randn(3, 64, dtype=dtype)
        return bool(torch.equal(PackedLinear(probe)(x), F.linear(x, probe.weight)))
    except (RuntimeError, AttributeError) as e:  # op missing from this torch build
        logger.info("packed linear unavailable: %s", e)
        return False


def pack_linears(model: nn.Module, kernels: ModuleType | None) -> int:
    """Swap every nn.Linear of a bfloat16 CPU model for a PanelLinear (our GEMM in ``kernels``)
    or, where that is unavailable (or ``kernels`` is None), a oneDNN PackedLinear; returns how
    many were swapped."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if (
        not targets
        or targets[0][1].weight.dtype != torch.bfloat16
        or targets[0][1].weight.device.type != "cpu"
    ):
        return 0
    onednn = packing_supported(torch.bfloat16)
    swapped = 0
    for name, linear in targets:
        panel = panel_kernels(linear, kernels)
        if panel is None and not onednn:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PanelLinear(linear, panel) if panel else PackedLinear(linear))
        swapped += 1
    _dual_pack(model, onednn)
    return swapped


def _dual_pack(model: nn.Module, onednn: bool) -> int:
    """On AMX CPUs, give every PanelLinear a oneDNN copy when the model is small enough."""
    panels = [m for m in model.modules() if isinstance(m, PanelLinear)]
    total = sum(m.packed.numel() * m.packed.element_size() for m in panels)
    if not panels or not onednn or not _amx() or total > DUAL_PACK_MAX_BYTES:
        return 0
    for layer in panels:
        layer.dual = True
    logger.info(
        "AMX: oneDNN copies of %d linears (%.0f MB, made on first use) for steps of %d+ rows",
        len(panels),
        total / 2**20,
        min(layer.dual_rows for layer in panels),
    )
    return len(panels)


def add_amx_copies(model: nn.Module, kernels: ModuleType) -> int:
    """On AMX CPUs, small models (the oneDNN copies' size rule): give each PanelLinear (biases
    too, e.g. Qwen2's q/k/v) a copy packed for ``kernels.amx_linear``, taken from
    AMX_LINEAR_ROWS rows (prompt chunks).
    An MLP's gate/up gets it as ``amx_silu``, interleaved for the fused SiLU-and-mul
    (ops.gate_up_silu); an attention's q/k/v with head_dim 64 as ``amx_rope``, ordered for the
    fused rotary (ops.qkv_rope). Their oneDNN copies are dropped (the AMX copy takes every step
    they would have served), so a model keeps two copies, not three. Returns how many linears
    got one."""
    if not dual_packed(model) or not kernels.amx_gemm_available():
        return 0
    gate_ups = {id(getattr(m, "gate_up_proj", None)) for m in model.modules()}
    rope_heads = {
        id(m.qkv_proj): int(m.num_heads) + int(m.num_kv_heads)  # type: ignore[arg-type]
        for m in model.modules()
        if hasattr(m, "qkv_proj") and getattr(m, "head_dim", 0) == 64
    }
    count = 0
    for linear in model.modules():
        if not isinstance(linear, PanelLinear) or linear.in_features % 32 or linear.out_features % 32:
            continue
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16).reshape(-1, 1)
        if id(linear) in gate_ups and bias is not None:
            continue  # no biased gate/up in the supported families: SiLU-and-mul takes none
        weight = unpack_panels(linear.packed, linear.out_features)
        if id(linear) in gate_ups:
            linear.amx_silu = pack_amx(interleave_gate_up(weight, linear.out_features // 2))
        elif id(linear) in rope_heads:
            linear.amx_rope = pack_amx(rope_order(weight, rope_heads[id(linear)]))
            bias = None if bias is None else rope_order(bias, rope_heads[id(linear)])
        else:
            linear.amx = pack_amx(weight)
        linear.amx_bias = None if bias is None else bias.reshape(-1).contiguous()
        # its oneDNN copy would serve only steps the AMX copy takes first: never made
        linear.dual = linear.dual and linear.dual_rows < AMX_LINEAR_ROWS
        count += 1
    if count:
        logger.info("AMX: copies for our GEMM replace those oneDNN copies for %d linears (steps of %d+ rows)",
                    count, AMX_LINEAR_ROWS)  # fmt: skip
    return count


def rope_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k/v rows [N, K] with the first ``heads`` heads of 64 reordered so that each 32-row
    block holds 16 dims and the 16 dims 32 further on (rotary pairs) for amx_linear_rope: per
    head, dims 0-15 + 32-47, then 16-31 + 48-63; the rows after them (v) unchanged."""
    rot = weight[: heads * 64].reshape(heads, 2, 2, 16, -1)  # [head][half][s][16][K]
    return torch.cat([rot.transpose(1, 2).reshape(heads * 64, -1), weight[heads * 64 :]])


def interleave_gate_up(weight: torch.Tensor, inter: int) -> torch.Tensor:
    """[2I, K] (gate rows, then up rows) -> blocks of 16 gate rows each followed by their 16
    up rows: every 32-column block of the product holds matching gate and up columns."""
    gate, up = weight[:inter].reshape(inter // 16, 16, -1), weight[inter:].reshape(inter // 16, 16, -1)
    return torch.stack([gate, up], 1).reshape(2 * inter, -1)


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> amx_gemm.cpp's layout [N/32][K/32][2][16][16][2]: per 32-column block and 32-deep
    k step, two AMX B tiles (16 pairs of k x 16 columns, pairs adjacent), 1 KB each."""
    n, k = weight.shape
    return weight.reshape(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def make_onednn_copies(model: nn.Module) -> int:
    """Make now the oneDNN copies that dual linears (PanelLinear, Int8Linear, Int4Linear) would
    make on first use: a server's first large step would pay it (~0.15 s for SmolLM-135M)."""
    made = 0
    for layer in model.modules():
        make = getattr(layer, "add_onednn_copy", None)
        if make is not None and getattr(layer, "dual", False) and getattr(layer, "onednn", 0) is None:
            make()
            made += 1
    return made


def dual_packed(model: nn.Module) -> bool:
    """Whether the model's linears carry oneDNN copies (see ``_dual_pack``)."""
    return any(isinstance(m, PanelLinear) and m.dual for m in model.modules())


def dual_rows(model: nn.Module) -> int:
    """The fewest rows from which some linear of the model takes its oneDNN copy."""
    return min(
        (m.dual_rows for m in model.modules() if isinstance(m, PanelLinear) and m.dual), default=1 << 30
    )
