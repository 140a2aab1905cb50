"""Decode attention of a few long rows, its keys split across threads (kernels/split.h) and
merged, equals the PyTorch reference: bf16/float32 caches and the INT8 cache, with a sliding
window, for rows long enough to split and rows short enough not to."""

from __future__ import annotations

import pytest
import torch

from swiftserve.model.attention import AttentionMetadata
from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.kv_quant import quantize_rows
from swiftserve.model.ops import CpuOps, KernelOptions, TorchOps

OPS = cpu_kernels()
pytestmark = pytest.mark.skipif(OPS is None, reason="needs the CPU kernels")


def case(dtype: torch.dtype, window: int | None, int8: bool) -> tuple:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(11)
    kv_heads, heads, dim, bs = 2, 6, 64, 16
    positions = torch.tensor([3000, 700])  # 3001 keys: split; 701: the second row is short
    nb = 3008 // bs
    tables = torch.stack([torch.randperm(nb + 8, generator=g)[:nb] for _ in positions])
    shape = (kv_heads, nb + 8, bs, dim)
    kc, vc = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    kc, vc = (quantize_rows(kc), quantize_rows(vc)) if int8 else (kc.to(dtype), vc.to(dtype))
    q = torch.randn(2, heads, dim, generator=g).to(dtype)
    ctx = torch.arange(nb * bs)
    mask = ctx[None, :] <= positions[:, None]
    if window is not None:
        mask &= ctx[None, :] > positions[:, None] - window
    meta = AttentionMetadata(
        torch.zeros(0, dtype=torch.long), 2, tables, mask.view(1, 2, 1, -1), [], decode_positions=positions,
        window=window,
    )  # fmt: skip
    return q, kc, vc, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1500])
@pytest.mark.parametrize("int8", [False, True], ids=["cache", "int8-cache"])
def test_split_decode_equals_the_reference(dtype: torch.dtype, window: int | None, int8: bool) -> None:
    assert OPS is not None
    torch.set_num_threads(2)  # 4 work items < 2 x threads: the long row is split
    q, kc, vc, meta = case(dtype, window, int8)
    ref = TorchOps().paged_decode(q, kc, vc, meta)
    got = CpuOps(OPS, KernelOptions()).paged_decode(q, kc, vc, meta)
    tol = 3e-2 if int8 or dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
