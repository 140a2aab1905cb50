"""Triton kernels (TritonOps) against the PyTorch reference (TorchOps).

Without CUDA they run on the CPU under TRITON_INTERPRET=1 (set here before triton is
imported); with CUDA (the device check) on the GPU. Block sizes that do not divide the
context, GQA groups 3 and 4, sliding windows, float32 and bfloat16.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from swiftserve.model.attention import AttentionMetadata  # noqa: E402
from swiftserve.model.ops import TorchOps  # noqa: E402
from swiftserve.model.rotary import RotaryEmbedding  # noqa: E402
from swiftserve.model.triton_ops import TritonOps  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
REF, TRI = TorchOps(), TritonOps()
DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, exact: bool = False) -> None:
    """Within rounding; bit for bit when ``exact`` where the rounding steps pin the result:
    bfloat16 on the GPU (the CPU interpreter's bfloat16 conversions do not round to nearest)
    and float32 on the CPU (the GPU compiler fuses float32 multiply-adds)."""
    if exact and not CUDA and dtype == torch.float32:
        assert torch.equal(a, b), (a - b).abs().max()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_silu_match_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 72, generator=g).to(dtype).to(DEVICE)  # 72: not a power of two
    res = torch.randn(5, 72, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(72, generator=g).to(dtype).to(DEVICE)
    # sums reduce in another order: equal up to rounding, not bit for bit
    close(TRI.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6), dtype)
    res_tri = res.clone()
    out_tri, res_tri = TRI.add_rms_norm(x, res_tri, w, 1e-6)
    out_ref, res_ref = REF.add_rms_norm(x, res.clone(), w, 1e-6)
    close(res_tri, res_ref, dtype, exact=True)  # an elementwise add: exact
    close(out_tri, out_ref, dtype)
    gate_up = torch.randn(3, 2 * 100, generator=g).to(dtype).to(DEVICE)
    close(TRI.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference(dtype: torch.dtype) -> None:
    heads, kv_heads, dim, tokens = 6, 2, 16, 7
    rope = RotaryEmbedding(dim, 64, 10000.0, {})
    positions = torch.tensor([0, 3, 9, 10, 31, 50, 63])
    cos, sin = (t.to(DEVICE) for t in rope.tables(positions, dtype))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(1))
    qkv = qkv.to(dtype).to(DEVICE)
    ours, ref = qkv.clone(), qkv.clone()
    TRI.rotary_qk_(ours, cos, sin, heads, kv_heads)
    REF.rotary_qk_(ref, cos, sin, heads, kv_heads)
    close(ours, ref, dtype, exact=True)


def paged_case(dtype: torch.dtype, heads: int, kv_heads: int, window: int | None, seed: int):  # type: ignore[no-untyped-def]
    """Random cache, rows at positions that do not align with blocks, shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    dim, block_size, num_blocks = 32, 16, 24
    kc = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g).to(dtype)
    vc = torch.randn(kv_heads, num_blocks, block_size, dim, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 16, 37, 70])
    nb = 5
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:nb] for _ in positions])
    q = torch.randn(len(positions), heads, dim, generator=g).to(dtype)
    ctx = torch.arange(nb * block_size)
    mask = ctx[None, :] <= positions[:, None]
    if window is not None:
        mask &= ctx[None, :] > positions[:, None] - window
    meta = AttentionMetadata(
        torch.zeros(0, dtype=torch.long), len(positions), tables, mask.view(1, len(positions), 1, -1), [],
        decode_positions=positions, window=window,
    )  # fmt: skip
    return q, kc, vc, meta


def to(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    assert (
        meta.decode_tables is not None and meta.decode_mask is not None and meta.decode_positions is not None
    )
    return AttentionMetadata(
        meta.slot_mapping.to(device), meta.num_decode, meta.decode_tables.to(device),
        meta.decode_mask.to(device), [], decode_positions=meta.decode_positions.to(device),
        window=meta.window,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 2), (8, 2), (4, 4), (9, 3)], ids=["g3", "g4", "g1", "g3-9"])
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_matches_reference(
    dtype: torch.dtype, shape: tuple[int, int], window: int | None
) -> None:
    q, kc, vc, meta = paged_case(dtype, *shape, window, seed=shape[0] + (window or 0))
    ref = REF.paged_decode(q, kc, vc, meta)
    ours = TRI.paged_decode(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), to(meta, DEVICE))
    close(ours.cpu(), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("window", [None, 7])
def test_split_kv_decode_matches_reference(dtype: torch.dtype, splits: int, window: int | None) -> None:
    """The keys split across programs (3 splits of 5 blocks: 2 + 2 + 1; rows at position 0
    and windows leave whole splits without a key) and merged give the one-pass answer."""
    from swiftserve.model.triton_kernels import paged_rows

    q, kc, vc, meta = paged_case(dtype, 6, 2, window, seed=11 + splits)
    ref = REF.paged_decode(q, kc, vc, meta)
    assert meta.decode_tables is not None and meta.decode_positions is not None
    d = to(meta, DEVICE)
    assert d.decode_tables is not None and d.decode_positions is not None
    ours = paged_rows(
        q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), d.decode_tables, d.decode_positions,
        q.shape[-1] ** -0.5, window, num_splits=splits,
    )  # fmt: skip
    close(ours.cpu(), ref, dtype)


def test_split_plan_fills_the_device_only_at_small_batch() -> None:
    from swiftserve.model.triton_kernels import plan_splits

    assert plan_splits(3, 64, 132) == (4, 16)  # batch 1, 3 KV heads, 1024 tokens: 16 splits
    assert plan_splits(3, 66, 132) == (5, 14)  # splits cover every block, none empty by shape
    assert plan_splits(192, 64, 132) == (64, 1)  # a full grid already
    assert plan_splits(3, 6, 132) == (6, 1)  # too short to split
    per_split, splits = plan_splits(9, 200, 132)
    assert per_split >= 4 and (splits - 1) * per_split < 200 <= splits * per_split


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    kv_heads, dim = 2, 32
    qkv = torch.randn(4, (4 + 2 * kv_heads) * dim, generator=g).to(dtype).to(DEVICE)
    k = qkv[:, 4 * dim : 6 * dim].view(4, kv_heads, dim)  # strided views, as the model passes them
    v = qkv[:, 6 * dim :].view(4, kv_heads, dim)
    slots = torch.tensor([5, 17, 40, -1], device=DEVICE)  # the last row is padding
    kc = torch.full((kv_heads, 4, 16, dim), 7.0, dtype=dtype, device=DEVICE)
    vc = kc.clone()
    TRI.write_kv_(k, v, kc, vc, slots)
    kr, vr = torch.full_like(kc, 7.0), torch.full_like(vc, 7.0)
    REF.write_kv_(k[:3], v[:3], kr, vr, slots[:3])
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
