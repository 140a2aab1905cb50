"""The tiled prompt attention kernel (AMX CPUs, model/kernels/prompt_tiles.cpp): equal to the
exact attention on runs that straddle blocks, follow cached context (prefix hits), use GQA
groups 1-8, a sliding window or 32-token blocks; and end to end, the same prompt logprobs and
greedy tokens as the SDPA path with chunked prefill, prefix-cache hits and mixed batches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from swiftserve import LLM, SamplingParams
from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.ops import amx_available
from swiftserve.tools.demo import write_random_checkpoint

KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(
    KERNELS is None or not amx_available() or not KERNELS.prompt_tiles_available(),
    reason="the tiled prompt kernel needs the CPU kernels and AMX",
)
D = 64


def make_cache(kv_heads: int, block_size: int, runs: list[tuple[int, int, int]], seed: int = 0):  # type: ignore[no-untyped-def]
    """Random bf16 caches and a shuffled block table per run (first row, rows, first position)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [pos + n for _, n, pos in runs]
    blocks = [-(-length // block_size) for length in lengths]
    num_blocks = sum(blocks) + 3
    k_cache = torch.randn(kv_heads, num_blocks, block_size, D, generator=gen).bfloat16()
    v_cache = torch.randn(kv_heads, num_blocks, block_size, D, generator=gen).bfloat16()
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(runs), max(blocks), dtype=torch.long)
    used = 0
    for r, nb in enumerate(blocks):
        tables[r, :nb] = order[used : used + nb]
        used += nb
    return k_cache, v_cache, tables, torch.tensor(runs, dtype=torch.long)


def reference(q, k_cache, v_cache, tables, runs, window):  # type: ignore[no-untyped-def]
    """Exact attention in float32 over each run's gathered context."""
    kv_heads, _, block_size, _ = k_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    for r, (row, n, pos) in enumerate(runs.tolist()):
        length = pos + n
        blocks = tables[r, : -(-length // block_size)]
        keys = k_cache[:, blocks].reshape(kv_heads, -1, D)[:, :length].float()
        values = v_cache[:, blocks].reshape(kv_heads, -1, D)[:, :length].float()
        queries = q[row : row + n].float().view(n, kv_heads, group, D)
        scores = torch.einsum("nhgd,hkd->hgnk", queries, keys) * D**-0.5
        qpos = torch.arange(pos, length)[:, None]
        kpos = torch.arange(length)[None]
        ok = kpos <= qpos
        if window > 0:
            ok &= kpos > qpos - window
        probs = torch.softmax(scores.masked_fill(~ok, float("-inf")), -1)
        out[row : row + n] = torch.einsum("hgnk,hkd->nhgd", probs, values).reshape(n, heads, D)
    return out


CASES = {
    "fresh_straddling_blocks": (2, 2, 16, [(0, 40, 0)], -1),
    "one_tile_exactly": (2, 2, 16, [(0, 16, 0)], -1),
    "a_single_row": (2, 2, 16, [(0, 1, 0)], -1),
    "after_cached_context": (3, 3, 16, [(3, 100, 517)], -1),
    "two_runs_one_deep": (3, 3, 16, [(0, 33, 0), (33, 70, 1000)], -1),
    "gqa_1": (4, 1, 16, [(0, 50, 77)], -1),
    "gqa_4": (2, 4, 16, [(0, 50, 77)], -1),
    "gqa_8": (1, 8, 16, [(0, 21, 5)], -1),
    "window": (3, 3, 16, [(0, 300, 0), (300, 64, 700)], 100),
    "window_smaller_than_a_tile": (2, 2, 16, [(0, 90, 13)], 7),
    "block_size_32": (2, 3, 32, [(0, 90, 45)], -1),
    # enough query tiles that an item takes 8 of them (each K/V chunk read once per item)
    "items_of_eight_tiles": (3, 3, 16, [(0, 1000, 0), (1000, 600, 2500), (1600, 37, 5)], -1),
    "items_of_eight_tiles_window": (3, 3, 16, [(0, 1100, 0), (1100, 500, 2000)], 300),
}


@pytest.mark.parametrize("case", CASES.keys())
def test_kernel_equals_exact_attention(case: str) -> None:
    assert KERNELS is not None
    kv_heads, group, block_size, runs, window = CASES[case]
    k_cache, v_cache, tables, run_t = make_cache(kv_heads, block_size, runs)
    rows = sum(n for _, n, _ in runs) + 3  # rows outside every run stay untouched
    q = torch.randn(rows, kv_heads * group, D, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = torch.full_like(q, 7.0)
    KERNELS.prompt_tiles(q, k_cache, v_cache, tables, run_t, out, D**-0.5, window)
    want = reference(q, k_cache, v_cache, tables, run_t, window)
    covered = torch.zeros(rows, dtype=torch.bool)
    for row, n, _ in runs:
        covered[row : row + n] = True
    assert (out[~covered] == 7.0).all()
    # bf16 output and bf16 probabilities in P.V: the exact answer's rounding scale
    torch.testing.assert_close(out[covered].float(), want[covered], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["two_runs_one_deep", "gqa_4", "items_of_eight_tiles"])
def test_queries_may_be_a_strided_view_of_fused_qkv(case: str) -> None:
    """q as the model hands it over: the first columns of the fused q/k/v output."""
    assert KERNELS is not None
    kv_heads, group, block_size, runs, window = CASES[case]
    k_cache, v_cache, tables, run_t = make_cache(kv_heads, block_size, runs)
    rows, heads = sum(n for _, n, _ in runs), kv_heads * group
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * D, generator=torch.Generator().manual_seed(2)).bfloat16()
    q = qkv[:, : heads * D].view(rows, heads, D)
    assert not q.is_contiguous()
    got, want = torch.zeros_like(q.contiguous()), torch.zeros_like(q.contiguous())
    KERNELS.prompt_tiles(q, k_cache, v_cache, tables, run_t, got, D**-0.5, window)
    KERNELS.prompt_tiles(q.contiguous(), k_cache, v_cache, tables, run_t, want, D**-0.5, window)
    assert torch.equal(got, want)


@pytest.fixture(
    scope="module",
    params=[(4, 2, None), (8, 2, None), (4, 1, None), (4, 2, 40)],
    ids=["gqa2", "gqa4", "mha", "window40"],
)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    heads, kv_heads, window = request.param
    arch = "llama" if window is None else "mistral"
    extra = {} if window is None else {"sliding_window": window}
    return write_random_checkpoint(
        tmp_path_factory.mktemp("tiles"),
        preset="tiny",
        architecture=arch,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=heads * 64,  # head_dim 64: the kernel's shape
        intermediate_size=256,
        **extra,
    )


def run(model_dir: Path, tiles: bool) -> list:  # type: ignore[type-arg]
    llm = LLM(
        model=str(model_dir),
        prompt_tiles=tiles,
        fused_prefill=False,  # without tiles: one SDPA per prompt chunk, the reference path
        dtype="bfloat16",
        max_num_batched_tokens=37,  # prompts split into chunks, decode rows mixed in
        block_size=16,
        enable_prefix_caching=True,
    )
    assert llm.engine.executor.worker.runner.tile_rows is tiles
    rng = random.Random(0)
    shared = [rng.randrange(5, 500) for _ in range(40)]  # a prefix-cache hit for later prompts
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 70, 17, 33, 130)] + [shared]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=2)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # after the cached prefix (prompt logprobs would bypass the cache): output logprobs
    hits = [[*shared, 7, 8, 9], [*shared, *(rng.randrange(5, 500) for _ in range(25))]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    second = llm.generate([{"prompt_token_ids": p} for p in hits], params, use_tqdm=False)
    assert all(out.num_cached_tokens >= 32 for out in second)
    return first + second


def same_greedy_tokens(a: list[int], b: list[int], b_logprobs: list) -> None:  # type: ignore[type-arg]
    """Equal tokens, or a divergence where the reference's top two were a bf16 tie."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            top = sorted((lp.logprob for lp in b_logprobs[i].values()), reverse=True)
            assert top[0] - top[1] < 0.02, (i, a, b)  # a near tie: rounding may pick either
            return


def test_engine_with_tiles_matches_sdpa(model_dir: Path) -> None:
    tiled, sdpa = run(model_dir, True), run(model_dir, False)
    for a, b in zip(tiled, sdpa, strict=True):
        ids = a.prompt_token_ids
        if a.prompt_logprobs is not None:
            assert b.prompt_logprobs is not None
            for pos in range(1, len(ids)):
                got = a.prompt_logprobs[pos][ids[pos]].logprob
                want = b.prompt_logprobs[pos][ids[pos]].logprob
                assert got == pytest.approx(want, abs=0.05), (len(ids), pos)  # bf16 rounding only
        got_lp, want_lp = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert got_lp is not None and want_lp is not None
        assert got_lp[0][a.outputs[0].token_ids[0]].logprob == pytest.approx(
            want_lp[0][b.outputs[0].token_ids[0]].logprob, abs=0.05
        )
        same_greedy_tokens(a.outputs[0].token_ids, b.outputs[0].token_ids, want_lp)
