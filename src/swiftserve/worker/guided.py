"""Guided decoding in the worker: one grammar matcher per structured-output request.

A matcher is built on a background thread when its request is first scheduled (llguidance
drops the GIL while it builds), so the build overlaps that step's forward pass; the first
sampling step waits for it. Preemption by recompute keeps the runner's per-request state (the
scheduler does not send a preempted request as new again), so its matcher simply carries on:
recomputed rows do not sample and never advance it. A request that does arrive with output
already produced (a rebuilt worker) gets a fresh matcher that replays those tokens.
Each step: fill one bitmask row per constrained request, unpack it into a boolean mask for
the sampler, then advance every matcher by the token it sampled.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from swiftserve.sampling_params import StructuredOutputsParams
from swiftserve.structured.grammar import GrammarCompiler, allowed_tokens, fill_bitmasks, tokenizer_json

if TYPE_CHECKING:
    from llguidance import LLMatcher

logger = logging.getLogger(__name__)


class GuidedDecoding:
    """Builds, masks with and advances the matchers of one model's requests."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(
            lambda: _load_tokenizer_json(Path(model_dir)), vocab_size, eos_token_ids
        )
        self._pool: ThreadPoolExecutor | None = None

    def start(self, spec: StructuredOutputsParams, replay: list[int]) -> Future[LLMatcher | None]:
        """Begin building a matcher for ``spec`` that has already consumed ``replay``."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="swiftserve-grammar")
        return self._pool.submit(self._build, spec, list(replay))

    def _build(self, spec: StructuredOutputsParams, replay: list[int]) -> LLMatcher | None:
        try:
            matcher = self.compiler.matcher(spec)
        except Exception:  # frontends validate first; a spec that slips past only ends its request
            logger.exception("structured output: cannot build the grammar; the request ends at once")
            return None
        if replay and not matcher.consume_tokens(replay):
            logger.warning("grammar replay after preemption failed: %s", matcher.get_error()[:200])
        return matcher

    def masks(self, matchers: list[LLMatcher | None]) -> torch.Tensor:
        """[len(matchers), vocab] booleans: True where a token may be sampled next (EOS
        alone for a request whose grammar could not be built)."""
        live = [m for m in matchers if m is not None]
        allowed = torch.from_numpy(allowed_tokens(fill_bitmasks(live, self.vocab_size), self.vocab_size))
        if len(live) == len(matchers):
            return allowed
        out = torch.zeros(len(matchers), self.vocab_size, dtype=torch.bool)
        eos = list(self.compiler.eos_token_ids)
        it = iter(allowed)
        for row, m in enumerate(matchers):
            if m is not None:
                out[row] = next(it)
            elif eos:
                out[row, eos] = True
        return out

    def draft_masks(self, matcher: LLMatcher | None, drafts: list[int]) -> torch.Tensor:
        """[len(drafts) + 1, vocab] allowed tokens at each verification row (row j: after
        drafts[:j]). The walk stops at the first draft the grammar refuses (that draft is
        rejected, so later rows are never used: they allow everything). The matcher is rolled
        back to where it was."""
        rows = torch.ones(len(drafts) + 1, self.vocab_size, dtype=torch.bool)
        if matcher is None:
            rows[0] = self.masks([None])[0]
            return rows
        valid = matcher.validate_tokens(drafts)
        masks = [self.masks([matcher])[0]]
        for token in drafts[:valid]:
            matcher.consume_token(token)
            masks.append(self.masks([matcher])[0])
        if valid:
            matcher.rollback(valid)
        rows[: len(masks)] = torch.stack(masks)
        return rows

    @staticmethod
    def advance(matcher: LLMatcher, token: int) -> None:
        """Feed the sampled token (an error state only ever allows EOS next)."""
        if not matcher.consume_token(token):
            logger.warning("sampled token %d outside the grammar: %s", token, matcher.get_error()[:200])


def _load_tokenizer_json(model_dir: Path) -> str:
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError("structured output needs the checkpoint's tokenizer.json")
    return tokenizer_json(Tokenizer.from_file(str(path)))
