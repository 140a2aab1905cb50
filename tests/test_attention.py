"""Paged decode attention: the fused C++ kernel and the PyTorch path agree (with windows)."""

from __future__ import annotations

import pytest
import torch

from swiftserve.model.attention import AttentionMetadata, masked_decode
from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.ops import CpuOps, KernelOptions

KERNEL = cpu_kernels()
CPU_OPS = CpuOps(KERNEL, KernelOptions()) if KERNEL is not None else None


def make_case(dtype: torch.dtype, window: int | None, seed: int = 0, shape=(6, 2, 32)):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    heads, kv_heads, dim = shape
    batch, bs, num_blocks = 5, 4, 64
    k_cache = torch.randn(kv_heads, num_blocks, bs, dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    positions = torch.tensor([0, 3, 17, 30, 9])
    nb = int(positions.max()) // bs + 1
    tables = torch.stack([torch.randperm(num_blocks)[:nb] for _ in range(batch)])
    q = torch.randn(batch, heads, dim, dtype=dtype)
    ctx = torch.arange(nb * bs)
    mask = ctx[None, :] <= positions[:, None]
    if window is not None:
        mask &= ctx[None, :] > positions[:, None] - window
    meta = AttentionMetadata(
        torch.zeros(1, dtype=torch.long),
        batch,
        tables,
        mask.view(1, batch, 1, nb * bs),
        [],
        decode_positions=positions,
        window=window,
    )
    return q, k_cache, v_cache, meta


def reference(q, k_cache, v_cache, meta):  # type: ignore[no-untyped-def]
    """Plain per-request softmax attention in float64."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    flat_k = k_cache.double().reshape(kv_heads, -1, dim)
    flat_v = v_cache.double().reshape(kv_heads, -1, dim)
    bs = k_cache.shape[2]
    for b in range(batch):
        pos = int(meta.decode_positions[b])
        first = 0 if meta.window is None else max(0, pos - meta.window + 1)
        slots = torch.tensor(
            [int(meta.decode_tables[b, t // bs]) * bs + t % bs for t in range(first, pos + 1)]
        )
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = flat_k[kv, slots] @ q[b, h].double() * dim**-0.5
            out[b, h] = torch.softmax(scores, 0) @ flat_v[kv, slots]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_torch_path_matches_reference(dtype: torch.dtype, window: int | None) -> None:
    q, kc, vc, meta = make_case(dtype, window)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        masked_decode(q, kc, vc, meta).double(), reference(q, kc, vc, meta), atol=tol, rtol=tol
    )


# (heads, kv_heads, head_dim): head_dim 64 with 1-4 query heads per KV head takes the
# register-resident AVX-512 path; the others the generic loops.
SHAPES = [(6, 2, 32), (9, 3, 64), (4, 4, 64), (8, 2, 64), (10, 2, 64)]


@pytest.mark.skipif(KERNEL is None, reason="C++ kernel could not be built here")
@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{h}-kv{k}-d{d}" for h, k, d in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_reference(
    dtype: torch.dtype, window: int | None, shape: tuple[int, int, int]
) -> None:
    q, kc, vc, meta = make_case(dtype, window, seed=1, shape=shape)
    assert CPU_OPS is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        CPU_OPS.paged_decode(q, kc, vc, meta).double(), reference(q, kc, vc, meta), atol=tol, rtol=tol
    )


def test_kernel_is_built_on_this_machine() -> None:
    """CI machines have g++ and ninja: the fast path must not silently disappear."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("no compiler")
    assert KERNEL is not None


@pytest.mark.skipif(KERNEL is None, reason="C++ kernel could not be built here")
@pytest.mark.parametrize("shape", [(9, 3, 64), (8, 2, 64)], ids=["h9-kv3", "h8-kv2"])
def test_kernel_long_contexts_bf16(shape: tuple[int, int, int]) -> None:
    """Several 16-token chunks plus odd tails (the bf16 dot-product path reduces 16 at once)."""
    q, kc, vc, meta = make_case(torch.bfloat16, None, seed=2, shape=shape)
    meta.decode_positions = torch.tensor([47, 63, 64, 100, 149])
    nb = int(meta.decode_positions.max()) // kc.shape[2] + 1
    meta.decode_tables = torch.stack([torch.randperm(kc.shape[1])[:nb] for _ in range(5)])
    assert CPU_OPS is not None
    torch.testing.assert_close(
        CPU_OPS.paged_decode(q, kc, vc, meta).double(), reference(q, kc, vc, meta), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (9, 3)])
@pytest.mark.parametrize(("cached", "n"), [(1, 5), (16, 16), (37, 11)])
def test_chunk_after_context_equals_masked_sdpa(
    dtype: torch.dtype, heads: int, kv_heads: int, cached: int, n: int
) -> None:
    """A prompt chunk after cached context: two flash calls merged by log-sum-exp (CPU) give
    what one SDPA with the [q, ctx] causal-offset mask gives."""
    from swiftserve.model.attention import _after_context

    torch.manual_seed(cached + n + heads)
    q = torch.randn(1, heads, n, 64).to(dtype)
    keys = torch.randn(kv_heads, cached + n, 64).to(dtype)
    values = torch.randn(kv_heads, cached + n, 64).to(dtype)
    mask = torch.ones(n, cached + n, dtype=torch.bool).tril(cached).view(1, 1, n, cached + n)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), keys.float().unsqueeze(0), values.float().unsqueeze(0), attn_mask=mask, enable_gqa=True
    )
    got = _after_context(q, keys, values, cached)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tol
