"""Paged attention on CPU: one call serves decode tokens and prefill chunks of many requests.

K/V live in per-layer caches ``[num_blocks, block_size, num_kv_heads, head_dim]``. Each step
first writes the new tokens' K/V into their slots (for every request of the batch), then
reads each request's context back through its slot indices. Decode queries (one token per
request) are batched into a padded ``[B, L]`` gather; prefill chunks run one SDPA each.
``index_select`` is used for gathers: on CPU it is about 10x faster than fancy indexing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    """Query rows [q_start, q_end) of one request. ``ctx_slots`` None: attend to own new K/V."""

    q_start: int
    q_end: int
    ctx_slots: torch.Tensor | None
    mask: torch.Tensor | None  # bool [1, 1, q, ctx], True = attend; None = plain causal


@dataclass
class AttentionMetadata:
    """Per-step description of the flat batch, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decode: int  # the first num_decode rows are single-token queries
    decode_slots: torch.Tensor | None  # [B * L] context slots, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] bool, True = attend
    prefills: list[PrefillSegment]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Attention for a flat batch. q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H, D]."""
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    # Write every new token first: a request may read blocks another request of the same
    # batch just wrote (they are only shared once computed, but this keeps it order-free).
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    if not meta.prefills:
        return _decode(q, k_flat, v_flat, meta)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[: meta.num_decode] = _decode(q[: meta.num_decode], k_flat, v_flat, meta)
    for seg in meta.prefills:
        out[seg.q_start : seg.q_end] = _prefill(q, k, v, k_flat, v_flat, seg)
    return out


def _decode(
    q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    assert meta.decode_slots is not None and meta.decode_mask is not None
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_flat.shape[1]
    length = meta.decode_slots.numel() // batch
    group = num_heads // num_kv_heads
    keys = _gather(k_flat, meta.decode_slots, batch, length)  # [B, KVH, L, D]
    values = _gather(v_flat, meta.decode_slots, batch, length)
    # Query head h uses KV head h // group (Hugging Face's repeat_kv order).
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * (head_dim**-0.5)
    scores.masked_fill_(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)


def _gather(flat: torch.Tensor, slots: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    rows = flat.index_select(0, slots).view(batch, length, flat.shape[1], flat.shape[2])
    return rows.transpose(1, 2).contiguous()


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    seg: PrefillSegment,
) -> torch.Tensor:
    qs = q[seg.q_start : seg.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if seg.ctx_slots is None:
        keys = k[seg.q_start : seg.q_end]
        values = v[seg.q_start : seg.q_end]
    else:
        keys = k_flat.index_select(0, seg.ctx_slots)
        values = v_flat.index_select(0, seg.ctx_slots)
    keys = keys.transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
    values = values.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        qs, keys, values, attn_mask=seg.mask, is_causal=seg.mask is None, enable_gqa=True
    )
    return out.squeeze(0).transpose(0, 1)
