"""INT8 / INT4 weight-only linear layers, swapped into a loaded model at load time.

Each layer keeps only its quantized weight and picks a kernel by the number of rows:

* few rows (decode): a fused kernel that reads the small weight once per call; this is where
  quantization pays, because decode streams every weight from memory once per step. INT8
  uses our own kernels: on AVX512-VNNI CPUs, bfloat16 activations are quantized to int8 per
  64 inputs and multiplied in integers (W8A8, model/kernels/gemv_vnni.cpp, over the plain
  int8 [N, K] weight); elsewhere, and for float32 (the reference dtype, kept exact), the float
  kernel of model/kernels/gemv.cpp over a weight packed as [N/4, K/16, 4, 16], about 1.5-1.8x
  faster at batch 1 than PyTorch's ``_weight_int8pack_mm``; INT4 uses PyTorch's
  ``_weight_int4pack_mm_for_cpu``;
* many rows (prefill, big batches): those kernels redo the int-to-float conversion for every
  few rows, so the layer dequantizes the weight once into the compute dtype and runs a
  dense GEMM instead; on VNNI CPUs (bfloat16) it quantizes each activation row to int8 and
  runs oneDNN's int8 GEMM (``torch._int_mm``, AMX where there is one) on the same weight.

The crossover sizes were measured on this machine (docs/benchmarks.md). Where a fused kernel
is missing (another device, an odd shape), the dequantize-then-GEMM path serves every size:
same API, same results up to float rounding.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swiftserve.model.quant_ops import (
    INT4_GROUP_SIZES,
    METHODS,
    dequantize_int4,
    dequantize_int8,
    pack_int4_pairs,
    quantize_int4,
    quantize_int8,
    unpack_int4_pairs,
)

logger = logging.getLogger(__name__)

# Row counts up to which the fused kernels beat dequantize + dense GEMM (measured; see docstring).
INT8_FUSED_MAX_ROWS = 32
INT4_FUSED_MAX_ROWS = 128
TILE_ROWS, TILE_K = 4, 16  # the packed layout of gemv.cpp
INT8_VNNI_MAX_ROWS = 8  # W8A8 GEMV up to here, int8_mm_rows above (measured; = ops.h's constant)
# On AMX CPUs (models up to DUAL_PACK_MAX_BYTES, like packed_linear.py's bf16 copies) INT8 layers
# keep a oneDNN-prepacked copy, made on first use, for steps of this many rows and more: prompt
# chunks through AMX-INT8, measured 1.9x (512 rows) to 3x (64 rows) faster than bfloat16's GEMM.
INT8_ONEDNN_MIN_ROWS = 64
# INT4 layers of bfloat16 models on AMX CPUs (same size policy) keep a dequantized bfloat16
# oneDNN copy for steps of this many rows and more: PyTorch's fused int4 kernel re-reads the
# weight per row (its time grows linearly: 8.7x oneDNN-bf16's at 64 rows), so batches and
# prompt chunks run at bfloat16's speed instead of 0.68x of it (measured, docs/benchmarks.md).
INT4_ONEDNN_MIN_ROWS = 12
VNNI_GROUP = 64  # activation inputs per quantization group in gemv_vnni.cpp


def _fused_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def pack_rows4(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/4, K/16, 4, 16]: the 4 rows of a kernel task interleaved in 16-wide pieces."""
    n, k = w.shape
    return w.view(n // TILE_ROWS, TILE_ROWS, k // TILE_K, TILE_K).permute(0, 2, 1, 3).contiguous()


def unpack_rows4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_rows4`` (a strided view, no copy)."""
    tiles, pieces = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(tiles * TILE_ROWS, pieces * TILE_K)


def group_sums(q: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 64]: each row's sum over each activation group (gemv_vnni.cpp's shift)."""
    n, k = q.shape
    return q.view(n, k // VNNI_GROUP, VNNI_GROUP).sum(-1, dtype=torch.int32).contiguous()


def w8a8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale).T with x quantized per row (dynamic, symmetric) for oneDNN's int8 GEMM:
    the PyTorch reference of the kernels' ``int8_mm_rows``."""
    xf = x.float()
    xs = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    xq = torch.round(xf / xs).clamp_(-127, 127).to(torch.int8)
    acc = torch._int_mm(xq, q.t())
    return (acc.float() * xs * scale.float()).to(x.dtype)


class Int8Linear(nn.Module):
    """Linear layer over an INT8 weight with one scale per output channel."""

    qweight: torch.Tensor
    scale: torch.Tensor
    wsum: torch.Tensor

    def __init__(self, linear: nn.Linear, kernels: Any = None):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        dtype = linear.weight.dtype
        q, scale = quantize_int8(linear.weight.detach())
        self.kernel = _gemv_kernel(linear.weight, self.out_features, self.in_features, kernels)
        # W8A8 where the CPU multiplies bytes (bfloat16 models only: float32 stays exact)
        self.vnni = self.kernel is not None and dtype == torch.bfloat16 and _vnni_ok(self.kernel, q.shape)
        self.register_buffer("qweight", q if self.vnni or self.kernel is None else pack_rows4(q))
        self.register_buffer("wsum", group_sums(q) if self.vnni else torch.empty(0, dtype=torch.int32))
        self.dual = False  # a oneDNN copy for large steps (set by quantize_model: _onednn_duals)
        self.onednn: torch.Tensor | None = None
        self.register_buffer("scale", scale.to(dtype))
        self.bias = linear.bias

    def int8_values(self) -> torch.Tensor:
        """The INT8 weight [N, K]."""
        return unpack_rows4(self.qweight) if self.kernel is not None and not self.vnni else self.qweight

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, in the compute dtype."""
        return dequantize_int8(self.int8_values(), self.scale).to(self.scale.dtype)

    def add_onednn_copy(self) -> None:
        """Make the prepacked int8 copy large steps use (on first use, or at a server's start)."""
        self.onednn = torch.ops.onednn.qlinear_prepack(self.qweight, None)
        self._onednn_scales = (self.scale.float(), torch.zeros(self.out_features, dtype=torch.long))

    def _onednn_mm(self, x: torch.Tensor) -> torch.Tensor:
        """W8A8 through oneDNN's int8 GEMM on the prepacked copy (made here on first use), the
        activations quantized with one scale for the step (dynamic, per tensor, as PyTorch's own
        x86 int8 path does): the GEMM writes bfloat16 directly, no per-row pass after it."""
        if self.onednn is None:
            self.add_onednn_copy()
        xu, xs = self.kernel.quantize_rows_int8(x.contiguous(), True, True)  # one scale: no epilogue
        w_scale, w_zero = self._onednn_scales
        return torch.ops.onednn.qlinear_pointwise(  # type: ignore[no-any-return]
            xu, float(xs[0]), 128, self.onednn, w_scale, w_zero, None, 1.0, 0, x.dtype, "none", [], ""
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few = x.shape[0] <= INT8_FUSED_MAX_ROWS and _fused_ok(x)
        if self.vnni and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            if x.shape[0] <= INT8_VNNI_MAX_ROWS:
                out = self.kernel.int8_gemv_vnni(x.contiguous(), self.qweight, self.wsum, self.scale)
            elif self.dual and x.shape[0] >= INT8_ONEDNN_MIN_ROWS:
                out = self._onednn_mm(x)
            else:
                out = self.kernel.int8_mm_rows(x.contiguous(), self.qweight, self.scale)
        elif few and self.kernel is not None and x.dtype in (torch.float32, torch.bfloat16):
            out = self.kernel.int8_gemv(x.contiguous(), self.qweight, self.scale)
        elif few and self.kernel is None:
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self.scale)
        else:
            out = F.linear(x, torch.mul(self.int8_values(), self.scale[:, None]))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def _onednn_duals(model: nn.Module) -> int:
    """On AMX CPUs, mark the quantized layers of a bfloat16 model for a oneDNN copy (INT8:
    prepacked int8; INT4: dequantized bfloat16) when the copies fit DUAL_PACK_MAX_BYTES."""
    from swiftserve.model.ops import amx_available
    from swiftserve.model.packed_linear import DUAL_PACK_MAX_BYTES

    int8 = [m for m in model.modules() if isinstance(m, Int8Linear) and m.vnni]
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear) and m.scale.dtype == torch.bfloat16]
    total = sum(m.qweight.numel() for m in int8) + sum(2 * m.in_features * m.out_features for m in int4)
    if not (int8 or int4) or not amx_available() or total > DUAL_PACK_MAX_BYTES:
        return 0
    if int4 and not packing_supported_here():
        int4 = []
    if int8 and not _onednn_int8():
        int8 = []
    layers: list[Int8Linear | Int4Linear] = [*int8, *int4]
    for layer in layers:
        layer.dual = True
    if int8 or int4:
        logger.info(
            "AMX: oneDNN %s copies of %d layers (%.0f MB, made on first use) for steps of %d+ rows",
            "int8" if int8 else "bfloat16", len(int8) + len(int4), total / 2**20,
            INT8_ONEDNN_MIN_ROWS if int8 else INT4_ONEDNN_MIN_ROWS,
        )  # fmt: skip
    return len(int8) + len(int4)


def packing_supported_here() -> bool:
    """Whether oneDNN's packed bfloat16 linear runs (and equals F.linear) in this build."""
    from swiftserve.model.packed_linear import packing_supported

    return packing_supported(torch.bfloat16)


_ONEDNN_INT8: list[bool] = []


def _onednn_int8() -> bool:
    """Whether this torch build has oneDNN's quantized linear (probed once)."""
    if not _ONEDNN_INT8:
        try:
            packed = torch.ops.onednn.qlinear_prepack(torch.ones(8, 64, dtype=torch.int8), None)
            x = torch.full((2, 64), 129, dtype=torch.uint8)
            torch.ops.onednn.qlinear_pointwise(
                x, 1.0, 128, packed, torch.ones(8), torch.zeros(8, dtype=torch.long), None, 1.0, 0,
                torch.float32, "none", [], "",
            )  # fmt: skip
            _ONEDNN_INT8.append(True)
        except (RuntimeError, AttributeError) as e:  # op missing from this build / CPU
            logger.info("oneDNN int8 linear unavailable: %s", e)
            _ONEDNN_INT8.append(False)
    return _ONEDNN_INT8[0]


def _why_no_vnni(model: nn.Module, kernels: Any) -> str:
    if kernels is None:
        return "no compiled CPU kernels"
    if not kernels.int8_vnni_available():
        return "this CPU has no AVX512-VNNI"
    dtype = next(model.parameters()).dtype
    return f"{dtype} model (W8A8 is for bfloat16)" if dtype != torch.bfloat16 else "shapes"


def _vnni_ok(kernels: Any, shape: torch.Size) -> bool:
    n, k = shape
    has = getattr(kernels, "int8_vnni_available", None)
    return bool(has is not None and has() and n % TILE_ROWS == 0 and k % VNNI_GROUP == 0)


def _gemv_kernel(weight: torch.Tensor, n: int, k: int, kernels: Any) -> Any:
    """``kernels`` (the compiled CPU module) when its INT8 GEMV can serve this layer, else None."""
    if kernels is None or weight.device.type != "cpu" or n % TILE_ROWS or k % TILE_K:
        return None
    return kernels


class Int4Linear(nn.Module):
    """Linear layer over an INT4 weight with a scale and a zero per group of input features."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, linear: nn.Linear, group_size: int):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.group_size = group_size
        dtype = linear.weight.dtype
        q, scale, zero = quantize_int4(linear.weight.detach(), group_size)
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("zero", zero.to(dtype))
        # [G, N, 2], the layout of the fused kernel; kept in sync with scale/zero above.
        both = torch.stack([self.scale, self.zero], -1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", both)
        self.fused = linear.weight.device.type == "cpu" and _int4_layout_known(self.out_features)
        packed = (
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1) if self.fused else pack_int4_pairs(q)
        )
        self.register_buffer("qweight", packed)
        self.bias = linear.bias
        self.dual = False  # a bf16 oneDNN copy for large steps (set by quantize_model: _onednn_duals)
        self.onednn: torch.Tensor | None = None

    def int4_values(self) -> torch.Tensor:
        """The unpacked INT4 values [N, K] (int32 in [0, 15])."""
        if self.fused:
            return _unpack_cpu_int4(self.qweight, self.out_features, self.in_features)
        return unpack_int4_pairs(self.qweight)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, in the compute dtype."""
        return dequantize_int4(self.int4_values(), self.scale, self.zero).to(self.scale.dtype)

    def add_onednn_copy(self) -> None:
        """Make the oneDNN-packed bf16 copy large steps use (on first use, or at a server's start)."""
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.dequantized(), 1)

    def _onednn_mm(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized weight's oneDNN-packed bfloat16 copy (made here on first use, so a
        single-stream user pays neither its memory nor its time): equal to the F.linear path."""
        if self.onednn is None:
            self.add_onednn_copy()
        return torch.ops.mkldnn._linear_pointwise(  # type: ignore[no-any-return]
            x.contiguous(), self.onednn, None, "none", [], ""
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dual and x.shape[0] >= INT4_ONEDNN_MIN_ROWS and x.dtype == torch.bfloat16:
            out = self._onednn_mm(x)
        elif self.fused and x.shape[0] <= INT4_FUSED_MAX_ROWS and _fused_ok(x):
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.qweight, self.group_size, self.scales_and_zeros
            )
        else:
            out = F.linear(x, self.dequantized())
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 g{self.group_size}"


def _unpack_cpu_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Undo PyTorch's AVX-512 int4 packing: blocks of 64 rows stored as [K, 32] bytes where
    byte d < 16 holds rows (d, d + 32) and byte 16 + d holds rows (16 + d, 48 + d)."""
    blocks = packed.view(n // 64, k, 32)
    values = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [NB, K, 64]: rows 0..63 in order
    return values.permute(0, 2, 1).reshape(n, k).to(torch.int32)


_LAYOUT_CHECKED: dict[str, bool] = {}


def _int4_layout_known(out_features: int) -> bool:
    """True when the fused int4 kernel exists and its packing is the one we can undo.

    The packing depends on the CPU's vector width, so it is verified once on a probe.
    """
    if out_features % 64:
        return False
    if "cpu" not in _LAYOUT_CHECKED:
        try:
            probe = torch.randint(
                0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0)
            )
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
            _LAYOUT_CHECKED["cpu"] = torch.equal(_unpack_cpu_int4(packed, 128, 64), probe)
        except (RuntimeError, AttributeError) as e:  # op missing from this build
            logger.info("fused int4 kernel unavailable: %s", e)
            _LAYOUT_CHECKED["cpu"] = False
    return _LAYOUT_CHECKED["cpu"]


def quantize_model(
    model: nn.Module, method: str, group_size: int = 128, lm_head: bool = False, kernels: Any = None
) -> int:
    """Swap the model's linear layers for quantized ones in place; returns how many.

    ``lm_head`` stays in the compute dtype unless asked (embeddings always do). ``kernels``:
    the compiled CPU module of the chosen backend (None: PyTorch's own int8 kernels).
    """
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS} or None, got {method!r}")
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and (lm_head or not name.endswith("lm_head"))
    ]
    count = 0
    regrouped: dict[int, int] = {}  # in_features -> group used instead of the requested one
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if method == "int8":
            layer: nn.Module = Int8Linear(linear, kernels)
        else:
            group = int4_group_for(linear.in_features, group_size)
            if group is None:
                logger.warning(
                    "%s: in_features %d fits no int4 group; left unquantized", name, linear.in_features
                )
                continue
            if group != group_size:
                regrouped[linear.in_features] = group
            layer = Int4Linear(linear, group)
        setattr(parent, child, layer)
        count += 1
    _onednn_duals(model)
    if method == "int8" and count and not any(getattr(m, "vnni", False) for m in model.modules()):
        # (the float kernels are exact and never wrong, only slower: one line, not an error)
        logger.info(
            "int8: W8A8 kernels not used (%s); weight-only float kernels", _why_no_vnni(model, kernels)
        )
    for features, group in regrouped.items():
        logger.warning(
            "layers with %d input features use int4 groups of %d (not %d)", features, group, group_size
        )
    return count


def int4_group_for(in_features: int, requested: int) -> int | None:
    """The requested group size, or the largest smaller one dividing ``in_features``
    (e.g. 576 features with groups of 128 use groups of 64); None when none does."""
    for group in sorted((g for g in INT4_GROUP_SIZES if g <= requested), reverse=True):
        if in_features % group == 0:
            return group
    return None


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers, each storage counted once (tied weights)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_mkldnn:  # oneDNN-packed weight: opaque storage, size from its shape
            total += tensor.numel() * tensor.element_size()
            continue
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total
