"""INT8 KV cache rows (``kv_cache_dtype="int8"``): the PyTorch reference of kernels/kv_int8.cpp.

A cache row, one token of one KV head, is ``head_dim`` int8 values followed by their float32
scale in 4 bytes, so a cache is int8 ``[kv_heads, blocks, block_size, head_dim + 4]`` and
everything that passes caches around (block tables, slots, the prefix cache, preemption) is
unchanged. Symmetric, per row: scale = max|x| / 127. At head_dim 64 a row takes 68 bytes
instead of bfloat16's 128.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Last dimension of a cache of ``dtype`` for this head_dim."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def bytes_per_row(head_dim: int, dtype: torch.dtype) -> int:
    return row_width(head_dim, dtype) * dtype.itemsize


def head_dim_of(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> int8 [..., D + 4]: the values, then the scale's bytes."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf * (1 / scale)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D + 4] -> [..., D] in ``dtype`` (values x scale in float32, then rounded)."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)
