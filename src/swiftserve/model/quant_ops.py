"""Weight-only quantization arithmetic: INT8 per output channel, INT4 per group.

INT8 is symmetric: ``w ≈ q * scale[n]`` with ``q`` in [-127, 127] and ``scale = max|w_n| / 127``,
so the rounding error of each weight is at most ``scale / 2``.

INT4 is asymmetric per group of ``group_size`` consecutive input features, in the convention
of PyTorch's packed int4 kernels: ``w ≈ (q - 8) * scale + zero`` with ``q`` in [0, 15],
``scale = (max - min) / 15`` and ``zero = min + 8 * scale``; the error is again at most
``scale / 2`` per weight. Quantization runs in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128)
METHODS = ("int8", "int4")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], float32 scale [N])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 weight from INT8 values and per-channel scales."""
    return q.float() * scale.float()[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int32 values in [0, 15] [N, K], float32 scale [N, G], float32 zero [N, G]); G = K / group_size."""
    n, k = weight.shape
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quant_group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of quant_group_size {group_size}")
    w = weight.float().view(n, k // group_size, group_size)
    low = w.amin(dim=-1)
    scale = ((w.amax(dim=-1) - low) / 15.0).clamp(min=1e-12)
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.view(n, k), scale, low + 8.0 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 weight from INT4 values (unpacked, [N, K]) and per-group scale and zero."""
    n, k = q.shape
    groups = scale.shape[1]
    w = (q.view(n, groups, k // groups).float() - 8.0) * scale.float()[..., None] + zero.float()[..., None]
    return w.view(n, k)


def pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """Plain nibble packing [N, K] -> uint8 [N, K/2] (even k in the low nibble)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4_pairs``: uint8 [N, K/2] -> int32 [N, K]."""
    n = packed.shape[0]
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(n, -1).to(torch.int32)
