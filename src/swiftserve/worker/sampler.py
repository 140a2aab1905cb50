"""Sampler: turns float32 logits into tokens, honouring each request's SamplingParams.

Order of processing, as in vLLM v1: raw logprobs (before any processing) are what
``logprobs`` reports; then min_tokens masking, penalties, temperature, min_p (relative to
the most likely token), top_k, top_p; then one draw by the exponential race
``argmax(p / q), q ~ Exp(1)``, which equals a categorical draw from p and lets each row
use its own seeded generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from swiftserve.core.messages import LogprobEntry
from swiftserve.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """What the sampler needs to remember about one request between steps."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    generator: torch.Generator | None = None
    grammar: Future[Any] | None = None  # the structured-output matcher (worker/guided.py)


def logprob_entries(
    logprobs: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[LogprobEntry]:
    """(token, logprob, rank, top-N) for each row of a [N, V] logprob matrix."""
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    k = max(num_top) if num_top else 0
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    entries: list[LogprobEntry] = []
    chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
    tv = top_vals.tolist() if top_vals is not None else None
    ti = top_ids.tolist() if top_ids is not None else None
    for row, token in enumerate(token_ids):
        n = num_top[row]
        top = tuple(zip(ti[row][:n], tv[row][:n], strict=True)) if (n and ti and tv) else ()
        entries.append((token, chosen_l[row], ranks_l[row], top))
    return entries


class Sampler:
    """Batched sampling over the rows of one step."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        grammar: tuple[list[int], torch.Tensor] | None = None,
    ) -> tuple[list[int], list[LogprobEntry | None]]:
        """Sample one token per row. ``grammar``: (rows, [len(rows), vocab] allowed-token
        booleans) of the rows under structured output; logprobs stay those of the raw logits."""
        want_lp = [s.params.logprobs for s in states]
        raw_lp = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_lp) else None
        guided = None
        if grammar is not None and grammar[0]:
            grammar_rows = torch.tensor(grammar[0])
            masked = logits.index_select(0, grammar_rows).masked_fill(~grammar[1], float("-inf"))
            guided = (grammar_rows, masked)
            logits = logits.index_copy(0, grammar_rows, masked)
        logits = self.apply_rules(logits, states)
        if guided is not None:
            logits = _keep_grammar_alive(logits, *guided)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            index = torch.tensor(random_rows)
            drawn = self._sample(logits.index_select(0, index), [states[i] for i in random_rows])
            tokens.index_copy_(0, index, drawn)
        token_list = tokens.tolist()
        entries: list[LogprobEntry | None] = [None] * len(states)
        if raw_lp is not None:
            rows = [i for i, n in enumerate(want_lp) if n is not None]
            got = logprob_entries(
                raw_lp.index_select(0, torch.tensor(rows)),
                [token_list[i] for i in rows],
                [want_lp[i] or 0 for i in rows],
            )
            for i, entry in zip(rows, got, strict=True):
                entries[i] = entry
        return token_list, entries

    @classmethod
    def apply_rules(cls, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Token rules, min_tokens and penalties: everything that depends on a row's own
        output so far (the speculative verifier calls it with drafts appended)."""
        if any(s.params.has_token_rules for s in states):
            logits = cls._apply_token_rules(logits, states)
        if any(s.params.min_tokens for s in states):
            logits = cls._mask_min_tokens(logits, states)
        if any(s.params.uses_penalties for s in states):
            logits = cls._apply_penalties(logits, states)
        return logits

    @staticmethod
    def _apply_token_rules(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """logit_bias, allowed_token_ids and bad_words, row by row (only rows that have them)."""
        logits = logits.clone()
        for row, s in enumerate(states):
            p = s.params
            if not p.has_token_rules:
                continue
            if p.logit_bias:
                ids, biases = zip(*p.logit_bias, strict=True)
                logits[row, list(ids)] += torch.tensor(biases, dtype=logits.dtype)
            if p.allowed_token_ids is not None:
                keep = torch.full_like(logits[row], float("-inf"))
                keep[list(p.allowed_token_ids)] = 0.0
                logits[row] += keep
            out = s.output_token_ids
            for seq in p.bad_words_token_ids:  # ban the token that would complete a bad word
                prefix = seq[:-1]
                if not prefix or tuple(out[-len(prefix) :]) == prefix:
                    logits[row, seq[-1]] = float("-inf")
        return logits

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        logits = logits.clone()
        for row, s in enumerate(states):
            if len(s.output_token_ids) < s.params.min_tokens:
                stops = list(s.params.stop_token_ids)
                if not s.params.ignore_eos:
                    stops += list(s.eos_token_ids)
                if stops:
                    logits[row, stops] = float("-inf")
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        logits = logits.clone()
        vocab = logits.shape[1]
        for row, s in enumerate(states):
            p = s.params
            if not p.uses_penalties:
                continue
            counts = torch.zeros(vocab)
            if s.output_token_ids:
                counts.index_add_(0, torch.tensor(s.output_token_ids), torch.ones(len(s.output_token_ids)))
            line = logits[row]
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                if s.prompt_token_ids:
                    seen[torch.tensor(s.prompt_token_ids)] = True
                penalized = torch.where(line > 0, line / p.repetition_penalty, line * p.repetition_penalty)
                line = torch.where(seen, penalized, line)
            line = line - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
            logits[row] = line
        return logits

    def _sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        temps = torch.tensor([max(s.params.temperature, 1e-5) for s in states])
        logits = filter_logits(
            logits / temps[:, None],
            top_k=[s.params.top_k for s in states],
            top_p=[s.params.top_p for s in states],
            min_p=[s.params.min_p for s in states],
        )
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(states) if s.generator is None]
        if unseeded:
            shared = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
            noise[unseeded] = shared
        for i, s in enumerate(states):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        return (probs / noise).argmax(dim=-1)


def _keep_grammar_alive(logits: torch.Tensor, rows: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """A grammar row that the other rules left with no token at all (min_tokens banning the
    EOS the finished grammar requires, say) samples from the grammar alone: the grammar wins."""
    dead = torch.isneginf(logits.index_select(0, rows)).all(dim=-1)
    if not bool(dead.any()):
        return logits
    keep = rows[dead]
    return logits.index_copy(0, keep, masked[dead])


def filter_logits(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Set to -inf every logit that min_p, then top_k, then top_p excludes (per row)."""
    vocab = logits.shape[1]
    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p)[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([vocab if k == -1 else k for k in top_k])
    sorted_logits = sorted_logits.masked_fill(torch.arange(vocab)[None, :] >= ks[:, None], float("-inf"))
    if any(p < 1.0 for p in top_p):
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
        drop = before >= torch.tensor(top_p)[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
