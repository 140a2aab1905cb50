"""Verifying draft tokens so the output keeps the target model's distribution exactly.

A request with drafts d1..dk has k+1 logit rows in its step: row j predicts the token after
position j (row 0 follows the last accepted token). Greedy: accept d(j+1) while it is the
argmax of row j, then emit the argmax of the first row that disagrees (or of row k when all
were accepted). Sampling (rejection sampling, Leviathan et al. 2023): an n-gram draft is a
point mass, so d(j+1) is accepted with probability p_j(d(j+1)); on a rejection the token is
drawn from p_j with d(j+1) removed (the normalised residual max(p - q, 0)); when all k are
accepted one more token is drawn from row k. p_j is the row processed exactly as the
one-token sampler would process it had d1..dj already been emitted (token rules, min_tokens
and penalties see the output plus those drafts; then temperature, min_p, top_k, top_p), so
every emitted token has the distribution it would have had without speculation.
"""

from __future__ import annotations

import torch

from swiftserve.core.messages import LogprobEntry
from swiftserve.worker.sampler import Sampler, SamplingState, filter_logits, logprob_entries


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One categorical draw (the exponential race the sampler uses)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def _processed_probs(logits: torch.Tensor, states: list[SamplingState], counts: list[int]) -> torch.Tensor:
    """Row-wise probabilities after temperature, min_p, top_k and top_p (each request's
    parameters repeated over its rows)."""

    def per_row(values: list[float] | list[int]) -> list:  # type: ignore[type-arg]
        return [v for v, c in zip(values, counts, strict=True) for _ in range(c)]

    params = [s.params for s in states]
    temps = torch.tensor(per_row([max(p.temperature, 1e-5) for p in params]))
    filtered = filter_logits(
        logits / temps[:, None],
        top_k=per_row([p.top_k for p in params]),
        top_p=per_row([p.top_p for p in params]),
        min_p=per_row([p.min_p for p in params]),
    )
    return torch.softmax(filtered, dim=-1)


def verify(
    logits: torch.Tensor,
    drafts: list[list[int]],
    states: list[SamplingState],
    shared: torch.Generator,
    grammar: list[torch.Tensor | None] | None = None,
) -> tuple[list[list[int]], list[list[LogprobEntry] | None]]:
    """Per request: the emitted tokens (accepted drafts + one) and, when asked, their logprobs.

    ``logits``: [sum(len(d) + 1), vocab] rows, request after request. ``grammar``: per
    request, None or its [len(d) + 1, vocab] allowed-token rows (structured output; row j
    as the grammar stands after d1..dj), applied before everything else.
    """
    counts = [len(d) + 1 for d in drafts]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    raw = logits
    guided = [(i, m) for i, m in enumerate(grammar or ()) if m is not None]
    if guided:
        logits = logits.clone()
        for i, mask in guided:
            span = slice(starts[i], starts[i] + counts[i])
            logits[span] = logits[span].masked_fill(~mask, float("-inf"))
    masked = logits
    logits = Sampler.apply_rules(logits, _row_states(drafts, states))
    for i, _ in guided:  # a row the rules emptied (min_tokens vs a finished grammar): grammar wins
        span = slice(starts[i], starts[i] + counts[i])
        dead = torch.isneginf(logits[span]).all(dim=-1)
        if bool(dead.any()):
            logits[span][dead] = masked[span][dead]
    argmax = logits.argmax(dim=-1).tolist()
    sampled = [i for i, s in enumerate(states) if not s.params.greedy]
    probs: dict[int, torch.Tensor] = {}
    if sampled:
        rows = torch.tensor([starts[i] + j for i in sampled for j in range(counts[i])])
        processed = _processed_probs(
            logits.index_select(0, rows), [states[i] for i in sampled], [counts[i] for i in sampled]
        )
        offset = 0
        for i in sampled:
            probs[i] = processed[offset : offset + counts[i]]
            offset += counts[i]
    emitted: list[list[int]] = []
    for i, (d, state) in enumerate(zip(drafts, states, strict=True)):
        if i in probs:
            emitted.append(_accept_sampled(d, probs[i], state.generator or shared))
            continue
        row = argmax[starts[i] : starts[i] + counts[i]]
        accepted = 0
        while accepted < len(d) and row[accepted] == d[accepted]:
            accepted += 1
        emitted.append([*d[:accepted], row[accepted]])
    return emitted, _logprobs(raw, emitted, states, starts)


def _row_states(drafts: list[list[int]], states: list[SamplingState]) -> list[SamplingState]:
    """One state per logit row: row j of a request sees its output plus its first j drafts."""
    rows = []
    for d, s in zip(drafts, states, strict=True):
        if not (s.params.uses_penalties or s.params.has_token_rules or s.params.min_tokens):
            rows += [s] * (len(d) + 1)  # nothing depends on the output: share the state
            continue
        rows += [
            SamplingState(s.params, s.prompt_token_ids, s.output_token_ids + d[:j], s.eos_token_ids)
            for j in range(len(d) + 1)
        ]
    return rows


def _accept_sampled(draft: list[int], probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    uniforms = torch.rand(len(draft), generator=generator).tolist()
    draft_probs = probs[torch.arange(len(draft)), torch.tensor(draft)].tolist()
    for j, (u, p) in enumerate(zip(uniforms, draft_probs, strict=True)):
        if u >= p:  # rejected: draw from the residual, p without the draft token
            residual = probs[j].clone()
            residual[draft[j]] = 0.0
            return [*draft[:j], _draw(residual, generator)]
    return [*draft, _draw(probs[len(draft)], generator)]


def _logprobs(
    logits: torch.Tensor, emitted: list[list[int]], states: list[SamplingState], starts: list[int]
) -> list[list[LogprobEntry] | None]:
    """Raw-model logprobs of each emitted token (as the one-token sampler reports them)."""
    out: list[list[LogprobEntry] | None] = []
    for tokens, state, start in zip(emitted, states, starts, strict=True):
        n = state.params.logprobs
        if n is None:
            out.append(None)
            continue
        lp = torch.log_softmax(logits[start : start + len(tokens)], dim=-1)
        out.append(logprob_entries(lp, tokens, [n] * len(tokens)))
    return out
