"""Sampler: greedy, seeded reproducibility, filtered distributions (chi-square), penalties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from swiftserve.sampling_params import SamplingParams
from swiftserve.worker.sampler import Sampler, SamplingState, filter_logits

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])


def expected_distribution(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """Reference: min_p on the full distribution, then top_k, then top_p, renormalised."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-p, kind="stable")
    ranked_keep = keep[order].copy()
    if top_k != -1:
        ranked_keep[top_k:] = False
    q = np.where(ranked_keep, p[order], 0.0)
    q /= q.sum()
    before = np.cumsum(q) - q
    ranked_keep &= ~((before >= top_p) & (np.arange(len(q)) > 0))
    final = np.zeros_like(p)
    final[order[ranked_keep]] = p[order[ranked_keep]]
    return final / final.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, -1, 1.0, 0.0),
        (0.7, 4, 1.0, 0.0),
        (1.0, -1, 0.8, 0.0),
        (1.3, -1, 1.0, 0.2),
        (1.0, 5, 0.9, 0.05),
    ],
)
def test_sampling_frequencies_match_filtered_distribution(temperature, top_k, top_p, min_p) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    sampler = Sampler(seed=7)
    rows = 4000
    states = [SamplingState(params, [1]) for _ in range(rows)]
    tokens, _ = sampler(LOGITS.repeat(rows, 1), states)
    counts = np.bincount(tokens, minlength=len(LOGITS))
    expected = expected_distribution(LOGITS.numpy().astype(np.float64), temperature, top_k, top_p, min_p)
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a filtered-out token"
    stat = chisquare(counts[support], expected[support] * rows)
    assert stat.pvalue > 1e-3, (counts, expected * rows)


def test_filter_keeps_at_least_one_token() -> None:
    out = filter_logits(LOGITS[None].clone(), top_k=[-1], top_p=[1e-9], min_p=[0.0])
    assert torch.isfinite(out).sum() == 1 and out.argmax() == 0


def test_greedy_is_argmax_and_ignores_seed() -> None:
    sampler = Sampler()
    states = [SamplingState(SamplingParams(temperature=0.0, seed=3), [1])]
    assert sampler(LOGITS[None], states)[0] == [0]


def test_seeded_rows_reproducible_regardless_of_neighbours() -> None:
    params = SamplingParams(temperature=1.0, seed=42)

    def draw(neighbours: int) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        state = SamplingState(params, [1], generator=gen)
        others = [SamplingState(SamplingParams(temperature=1.0), [1]) for _ in range(neighbours)]
        sampler = Sampler(seed=neighbours)
        got = []
        for _ in range(20):
            tokens, _ = sampler(LOGITS.repeat(neighbours + 1, 1), [*others, state])
            got.append(tokens[-1])
        return got

    assert draw(0) == draw(5)


def test_logprobs_are_raw_and_ranked() -> None:
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0)
    tokens, entries = sampler(LOGITS[None], [SamplingState(params, [0])])
    raw = torch.log_softmax(LOGITS, -1)
    token, logprob, rank, top = entries[0]  # type: ignore[misc]
    assert token == tokens[0]
    assert logprob == pytest.approx(raw[token].item())
    assert rank == 1 + int((raw > raw[token]).sum())
    assert [t for t, _ in top] == [0, 1, 2]


def test_penalties_change_choice() -> None:
    sampler = Sampler()
    base = SamplingState(SamplingParams(temperature=0.0), [5], output_token_ids=[0, 0])
    assert sampler(LOGITS[None], [base])[0] == [0]
    freq = SamplingState(SamplingParams(temperature=0.0, frequency_penalty=0.5), [5], output_token_ids=[0, 0])
    assert sampler(LOGITS[None], [freq])[0] == [1]  # 2.0 - 2*0.5 = 1.0 < 1.5
    rep = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0])
    assert sampler(LOGITS[None], [rep])[0] == [1]  # prompt token 0 penalised: 2.0 / 2 = 1.0
    pres = SamplingState(SamplingParams(temperature=0.0, presence_penalty=1.0), [5], output_token_ids=[0])
    assert sampler(LOGITS[None], [pres])[0] == [1]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    state = SamplingState(params, [5], output_token_ids=[3], eos_token_ids=(0,))
    assert sampler(LOGITS[None], [state])[0] == [2]
    state.output_token_ids.append(4)
    assert sampler(LOGITS[None], [state])[0] == [0]


def test_token_rules_bias_allowed_and_bad_words() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 2] = 5.0  # the greedy choice without rules
    states = [
        SamplingState(SamplingParams(temperature=0.0, logit_bias={7: 100.0}), [1]),
        SamplingState(SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]), [1]),
        SamplingState(SamplingParams(temperature=0.0, bad_words_token_ids=[(9, 2), (2,)]), [1], [9]),
    ]
    tokens, _ = Sampler()(logits, states)
    assert tokens[0] == 7  # biased up
    assert tokens[1] in (3, 4)  # only the allowed ones
    assert tokens[2] != 2  # "9 2" and "2" are banned: 2 would complete both
    sampled = Sampler(seed=1)(
        torch.randn(1, 10).repeat(64, 1),
        [SamplingState(SamplingParams(temperature=1.0, allowed_token_ids=(5, 6)), [1]) for _ in range(64)],
    )[0]
    assert set(sampled) <= {5, 6}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
