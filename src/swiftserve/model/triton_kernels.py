"""Triton kernels behind TritonOps (model/triton_ops.py): norms, SiLU-and-mul, rotary, KV write,
paged attention.

Every kernel loads in float32, computes in float32 and rounds where the PyTorch reference
rounds (``.to(dtype)`` between steps), so bfloat16 results match the reference and CI can run
them on the CPU under ``TRITON_INTERPRET=1`` (whose bfloat16 arithmetic is unreliable).

Paged attention answers one query row per program and KV head (its ``GROUP`` query heads
together), walking the row's block table up to its position, which it reads on the device:
the grid is fixed by the shapes, so a step can be captured in a CUDA graph. At small batch
a long table is split across programs too (split-KV decode, merged by a second kernel).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # residual += x (rounded to the stream's dtype), then normalize the sum
        r = tl.load(res_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(res_ptr.dtype.element_ty).to(tl.float32)
        tl.store(res_ptr + row * n + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / n
    normed = (x * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMS norm of each row of ``x`` [T, n]; with ``residual``, of ``residual += x`` (in place)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    rows = x.numel() // n
    if rows:
        res = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](x, res, weight, out, n, eps, HAS_RES=residual is not None, BLOCK=_block(n))
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused [T, 2n] projection."""
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * n)
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _block(n))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, row_stride, HALF: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HALF)
    base = qkv_ptr + token * row_stride + head * 2 * HALF
    x1 = tl.load(base + dims).to(tl.float32)
    x2 = tl.load(base + HALF + dims).to(tl.float32)
    c1 = tl.load(cos_ptr + token * 2 * HALF + dims).to(tl.float32)
    c2 = tl.load(cos_ptr + token * 2 * HALF + HALF + dims).to(tl.float32)
    s1 = tl.load(sin_ptr + token * 2 * HALF + dims).to(tl.float32)
    s2 = tl.load(sin_ptr + token * 2 * HALF + HALF + dims).to(tl.float32)
    ty = qkv_ptr.dtype.element_ty
    # x * cos + rotate_half(x) * sin, each product rounded as the reference rounds it
    out1 = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
    out2 = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    tl.store(base + dims, out1.to(ty))
    tl.store(base + HALF + dims, out2.to(ty))


def rotary_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_rotated_heads: int) -> None:
    """Rotate the first ``num_rotated_heads`` heads (q then k) of each row of ``qkv`` in place.

    cos, sin: [T, 1, D] (or [T, D]) in qkv's dtype; head_dim D must be a power of two.
    """
    tokens = qkv.shape[0]
    dim = cos.shape[-1]
    assert qkv.stride(-1) == 1 and dim & (dim - 1) == 0, "contiguous rows and a power-of-two head_dim"
    if tokens:
        cos2, sin2 = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
        _rotary_kernel[(tokens, num_rotated_heads)](qkv, cos2, sin2, qkv.stride(0), HALF=dim // 2)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_tokens, total_slots, kv_stride,
                     D: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    mask = dims < D
    slot = tl.load(slot_ptr + token)
    if slot >= 0:  # padding rows (CUDA-graph buckets) carry slot -1 and write nothing
        src = token * kv_stride + head * D + dims
        dst = (head * total_slots + slot) * D + dims
        k = tl.load(k_ptr + src, mask=mask)
        v = tl.load(v_ptr + src, mask=mask)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store k, v [T, KVH, D] (rows of a fused projection) at their slots of the head-major cache."""
    tokens, heads, dim = k.shape
    assert k.stride(-1) == 1 and k.stride(1) == dim and v.stride() == k.stride()
    total = k_cache.shape[1] * k_cache.shape[2]
    if tokens:
        _write_kv_kernel[(tokens, heads)](
            k, v, k_cache, v_cache, slots, tokens, total, k.stride(0), D=dim, BLOCK_D=_block(dim)
        )


@triton.jit
def _paged_rows_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, pos_ptr, out_ptr, part_ptr, scale, window,
                       num_heads, table_row_stride, total_slots, q_row_stride, blocks_per_split,
                       table_width, num_splits,
                       GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, LOOP: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """One program: a query row, a KV head (its GROUP query heads), and one split of the row's
    blocks. Without SPLIT it writes the output; with it, the split's running max, denominator
    and weighted sum (in float32) for _merge_splits_kernel."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    heads = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    hmask = heads < GROUP
    dmask = dims < D
    q_off = row * q_row_stride + (kv_head * GROUP + heads)[:, None] * D + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * scale
    pos = tl.load(pos_ptr + row)
    first = tl.maximum(pos - window + 1, 0)  # window is huge when there is none
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    base = split * blocks_per_split
    if LOOP > 0:  # the CPU interpreter cannot loop to a bound read at run time
        lo, hi = 0, LOOP
    else:  # only the blocks of this split that hold keys in range (none past the position)
        lo = tl.maximum(first // BLOCK_SIZE - base, 0)
        hi = tl.minimum(pos // BLOCK_SIZE + 1 - base, blocks_per_split)
    for i in range(lo, hi):
        b = base + i
        inside = b < table_width  # (the interpreter's fixed loop runs past the table)
        block = tl.load(table_ptr + row * table_row_stride + b, mask=inside, other=0)
        key_pos = b * BLOCK_SIZE + offs
        valid = (key_pos <= pos) & (key_pos >= first) & inside
        kv_off = (kv_head * total_slots + block * BLOCK_SIZE + offs)[:, None] * D + dims[None, :]
        kvmask = valid[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + kv_off, mask=kvmask, other=0.0).to(tl.float32)
        v = tl.load(vc_ptr + kv_off, mask=kvmask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, BLOCK_SIZE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no key in range
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    head_ids = kv_head * GROUP + heads
    if SPLIT:  # partials at [row, head, split]: max, denominator, then D weighted sums
        slot = ((row * num_heads + head_ids) * num_splits + split) * (D + 2)
        tl.store(part_ptr + slot, m, mask=hmask)
        tl.store(part_ptr + slot + 1, denom, mask=hmask)
        tl.store(part_ptr + slot[:, None] + 2 + dims[None, :], acc, mask=hmask[:, None] & dmask[None, :])
    else:
        out = acc / denom[:, None]
        out_off = row * num_heads * D + head_ids[:, None] * D + dims[None, :]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _merge_splits_kernel(part_ptr, out_ptr, num_heads, num_splits, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """out[row, head] from the splits' partials, each rescaled to the overall max."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    smask = splits < num_splits
    slot = ((row * num_heads + head) * num_splits + splits) * (D + 2)
    m = tl.load(part_ptr + slot, mask=smask, other=float("-inf"))
    denom = tl.load(part_ptr + slot + 1, mask=smask, other=0.0)
    acc = tl.load(
        part_ptr + slot[:, None] + 2 + dims[None, :], mask=smask[:, None] & (dims < D)[None, :], other=0.0
    )
    top = tl.max(m, axis=0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))  # a split with no key adds nothing
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * denom, axis=0)
    tl.store(out_ptr + (row * num_heads + head) * D + dims, out.to(out_ptr.dtype.element_ty), mask=dims < D)


MIN_BLOCKS_PER_SPLIT = 4  # below this a split's fixed cost outweighs its share of the keys


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Programs that keep the device busy: one per multiprocessor (128 for the interpreter)."""
    if device.type != "cuda":
        return 128
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def plan_splits(programs: int, table_width: int, target: int) -> tuple[int, int]:
    """(blocks per split, splits) for ``programs`` row x KV-head pairs over ``table_width``
    blocks: split the keys only while the grid is too small to fill the device (decode at small
    batch), never below MIN_BLOCKS_PER_SPLIT blocks a split. Fixed by the shapes alone, so a
    captured graph keeps its grid; splits past a row's position return at once."""
    if programs >= target or table_width < 2 * MIN_BLOCKS_PER_SPLIT:
        return max(table_width, 1), 1
    splits = min(-(-target // programs), table_width // MIN_BLOCKS_PER_SPLIT)
    per_split = -(-table_width // splits)
    return per_split, -(-table_width // per_split)


def paged_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of each query row q[r] [H, D] over its request's keys 0..positions[r]
    (the last ``window`` of them with a sliding window), read through block table tables[r].
    Long tables at small batch are split across programs (``plan_splits``; ``num_splits``
    forces a count) and merged in a second kernel (split-KV decode)."""
    rows, num_heads, dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    assert tables.stride(-1) == 1 and positions.is_contiguous()
    group = num_heads // kv_heads
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    out = torch.empty(rows, num_heads, dim, dtype=q.dtype, device=q.device)
    if not rows:
        return out
    width = tables.shape[1]
    if num_splits is None:
        per_split, splits = plan_splits(rows * kv_heads, width, _target_programs(q.device))
    else:
        per_split = -(-width // num_splits)
        splits = -(-width // per_split)
    parts = (
        torch.empty(rows, num_heads, splits, dim + 2, dtype=torch.float32, device=q.device)
        if splits > 1
        else out
    )
    _paged_rows_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, tables, positions, out, parts, scale, window or 2**30,
        num_heads, tables.stride(0), num_blocks * block_size, q.stride(0), per_split, width, splits,
        GROUP=group, BLOCK_G=max(2, triton.next_power_of_2(group)), D=dim, BLOCK_D=_block(dim),
        BLOCK_SIZE=block_size, LOOP=per_split if INTERPRET else 0, SPLIT=splits > 1,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(rows, num_heads)](
            parts, out, num_heads, splits,
            D=dim, BLOCK_D=_block(dim), BLOCK_S=max(2, triton.next_power_of_2(splits)),
        )  # fmt: skip
    return out
