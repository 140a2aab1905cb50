"""BlockManager: ref counts, prefix hits with chained hashes, LRU reuse, no leaks."""

from __future__ import annotations

import pytest

from swiftserve.core.block_manager import BlockManager
from swiftserve.core.request import Request
from swiftserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), max_tokens=8, cache_salt=salt)


def admit(bm: BlockManager, req: Request) -> int:
    """Allocate like the scheduler does; returns the number of prefix-hit tokens."""
    hits = bm.get_computed_blocks(req)
    computed = len(hits) * bm.block_size
    assert bm.allocate_slots(req, req.num_tokens - computed, hits)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return computed


def test_allocate_and_free_returns_every_block() -> None:
    bm = BlockManager(10, 4)
    reqs = [make_request(str(i), list(range(i, i + 9))) for i in range(3)]
    for r in reqs:
        admit(bm, r)
    assert bm.num_free_blocks == 10 - 9
    for r in reqs:
        bm.free(r)
    assert bm.num_free_blocks == 10
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hit_shares_blocks_and_counts_refs() -> None:
    bm = BlockManager(16, 4)
    a = make_request("a", [*list(range(12)), 100])
    b = make_request("b", [*list(range(12)), 200])
    assert admit(bm, a) == 0
    assert admit(bm, b) == 12  # three full shared blocks
    assert bm.block_table("a")[:3] == bm.block_table("b")[:3]
    assert [bm.blocks[i].ref_count for i in bm.block_table("a")[:3]] == [2, 2, 2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_last_token_is_always_computed() -> None:
    bm = BlockManager(16, 4)
    a = make_request("a", list(range(8)))
    admit(bm, a)
    b = make_request("b", list(range(8)))  # identical prompt, exactly two blocks
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 1  # the second block is recomputed so the last token yields logits


def test_hash_chain_depends_on_parent() -> None:
    bm = BlockManager(16, 4)
    admit(bm, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])  # same 2nd block, other parent
    assert bm.get_computed_blocks(other) == []


def test_salt_isolates_tenants() -> None:
    bm = BlockManager(16, 4)
    admit(bm, make_request("a", list(range(9)), salt="tenant-a"))
    assert bm.get_computed_blocks(make_request("b", list(range(9)), salt="tenant-b")) == []
    assert len(bm.get_computed_blocks(make_request("c", list(range(9)), salt="tenant-a"))) == 2


def test_freed_cached_blocks_are_reused_in_lru_order() -> None:
    bm = BlockManager(4, 2)
    first = make_request("first", [1, 2, 3])  # blocks: [1,2] full, [3] partial
    admit(bm, first)
    bm.free(first)
    second = make_request("second", [7, 8, 9])
    admit(bm, second)
    bm.free(second)
    # 'first' freed earlier, so its cached block is evicted before 'second''s.
    third = make_request("third", [4, 4, 4, 4, 4])
    admit(bm, third)
    assert bm.get_computed_blocks(make_request("x", [1, 2, 0])) == []
    assert len(bm.get_computed_blocks(make_request("y", [7, 8, 0]))) == 1
    bm.free(third)
    assert bm.num_free_blocks == 4


def test_blocks_without_a_hash_are_reused_first_and_last_freed_first() -> None:
    """Empty blocks go out before cached ones, the warmest first: their pages are mapped."""
    bm = BlockManager(8, 2)
    cached = make_request("cached", [1, 2, 3, 4])  # two full blocks, both cached
    admit(bm, cached)
    bm.free(cached)
    plain = BlockManager(8, 2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(plain, a)
    first_table = list(plain.block_table("a"))
    plain.free(a)
    b = make_request("b", [6, 7, 8])
    admit(plain, b)
    assert plain.block_table("b") == first_table[:2]  # the same memory again, not blocks 3-4
    # with caching on, a new prompt takes never-used blocks, and the cached prefix survives
    c = make_request("c", [9, 9, 9, 9, 9, 9, 9])
    admit(bm, c)
    assert len(bm.get_computed_blocks(make_request("d", [1, 2, 3, 4, 0]))) == 2
    bm.reset_prefix_cache()
    bm.free(c)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(2, 4)
    big = make_request("big", list(range(12)))
    assert not bm.allocate_slots(big, 12)
    assert bm.num_free_blocks == 2 and bm.block_table("big") == []


def test_collision_is_detected_by_key_recheck() -> None:
    bm = BlockManager(8, 2)
    a = make_request("a", [1, 2, 3])
    admit(bm, a)
    b = make_request("b", [5, 6, 3])
    # Force b's first block hash to equal a's (a simulated collision).
    b.block_hashes.append(a.block_hashes[0])
    assert bm.get_computed_blocks(b) == []


def test_invalid_sizes_raise() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 16)
