"""N-gram (prompt lookup) proposals for speculative decoding. Pure Python, no torch.

For a request whose last n tokens occurred earlier in its prompt or output, propose the k
tokens that followed their latest occurrence (n from ``max_n`` down to ``min_n``: the longest
match wins). The latest, not the first as in vLLM: text that has drifted since (a model's
own loops, an edited quote) is continued as it reads now; on issue 19's copy workload
acceptance rose from 0.28 to 0.45. Where the occurrence is closer than k tokens (a loop of
period p < k) the proposal goes on around the loop. Each request keeps an index from n-gram
to the position after its latest occurrence, extended by O(max_n) dict writes per new token,
so a proposal costs a few lookups however long the context. A request proposes as many
drafts as its recent acceptance says will survive: ``round(2 k rate)``, at most k, at least 1
(in a loop all k; in new text one or two, whose verification costs little).

Requests asking for prompt logprobs are not eligible (they decode one token a step).
Penalties, token rules, min_tokens and the structured-output grammar are applied per draft
position by the verifier (worker/spec_verify.py, worker/guided.py: draft_masks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swiftserve.core.request import Request
from swiftserve.core.step_cost import StepCostModel

RATE_ALPHA = 0.5  # weight of the latest verification in a request's acceptance average


@dataclass
class _Index:
    indexed: int = 0  # positions [0, indexed) have their n-grams in ``after``
    after: dict[tuple[int, ...], int] = field(default_factory=dict)
    rate: float = 0.25  # recent acceptance per draft token (moving average; three misses in a row back off)
    cooldown: int = 0  # steps to skip before proposing again


def eligible(request: Request) -> bool:
    """Whether speculation keeps this request's output exact (see the module docstring)."""
    p = request.sampling_params
    return p.prompt_logprobs is None


class NgramProposer:
    """Proposes up to ``k`` draft tokens per request by prompt lookup."""

    lookahead = 0  # KV slots past a step's tokens that proposing writes (core/draft.py: k)
    min_rate = 0.05  # below this acceptance per draft token, verifying costs more than it saves
    max_cooldown = 16  # steps without proposals once a request's drafts keep failing

    def __init__(self, k: int, min_n: int, max_n: int, adaptive: bool = True):
        self.k, self.min_n, self.max_n, self.adaptive = k, min_n, max_n, adaptive
        self._indexes: dict[str, _Index] = {}
        self.acceptance = 1.0  # moving average of accepted / proposed, optimistic at first

    def wants(self, request: Request) -> bool:
        """Whether the worker should propose for this request after the step (draft models;
        prompt lookup proposes here, in ``propose``)."""
        return False

    def receive(self, request_id: str, drafts: list[int]) -> None:
        """Proposals made by the worker (draft models only)."""

    def _index(self, request_id: str) -> _Index:
        return self._indexes.setdefault(request_id, _Index())

    def pays(self, cost: StepCostModel, decode_rows: int, step: int) -> bool:
        """Whether verifying drafts is worth it this step. A draft token costs about one more
        token of compute (c, fitted online); it saves a decode step's share per request
        (T / rows) when accepted: so it pays while acceptance x T / rows > c. Small models
        at large batches are compute-bound and fail this; one step in 16 still speculates, to
        keep measuring acceptance (one in 64 while it is under 10%)."""
        probe = 16 if self.acceptance > 0.1 else 64  # rarer probes where drafts keep failing
        if not self.adaptive or not cost.ready or step % probe == 0:
            return True
        per_token = cost.coef[1]
        return self.acceptance * cost.predict(0, decode_rows) > per_token * max(decode_rows, 1)

    def propose(self, request: Request, limit: int) -> list[int]:
        """Draft tokens to verify in the request's next step (at most ``limit``)."""
        k = min(self.k, limit)
        if k <= 0 or not eligible(request):
            return []
        tokens = request.prompt_token_ids + request.output_token_ids
        index = self._index(request.request_id)
        self._extend(index, tokens)
        if index.cooldown:
            index.cooldown -= 1
            return []
        # as many drafts as the request's recent acceptance says will survive (k when most do)
        k = max(1, min(k, round(2 * k * index.rate)))
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = index.after.get(tuple(tokens[end - n :]))
            if start is not None:
                drafts = tokens[start : start + k]
                while len(drafts) < k:  # the loop's period is below k: its next round
                    drafts.append(drafts[len(drafts) - (end - start)])
                return drafts
        return []

    def _extend(self, index: _Index, tokens: list[int]) -> None:
        """Index every n-gram that is followed by a token, i.e. ends before the last token."""
        for pos in range(max(index.indexed, 1), len(tokens)):  # n-grams ending just before pos
            for n in range(self.min_n, min(self.max_n, pos) + 1):
                index.after[tuple(tokens[pos - n : pos])] = pos
        index.indexed = max(index.indexed, len(tokens))

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """Back off where a request's drafts keep failing (sampled text, say): once its recent
        acceptance falls below ``min_rate``, it proposes one step in ``max_cooldown`` + 1 (a probe
        that lets the average recover). A single miss does not back off: at 0.3 acceptance
        most verifications accept nothing, yet verifying every step pays (issue 19's copy
        workload: 1.43x against 1.18x with a back-off after every miss)."""
        index = self._indexes.get(request_id)
        if index is None:
            return
        rate = accepted / max(proposed, 1)
        self.acceptance += 0.05 * (rate - self.acceptance)
        index.rate += RATE_ALPHA * (rate - index.rate)
        index.cooldown = self.max_cooldown if index.rate < self.min_rate else 0

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


@dataclass
class SpecDecodeStats:
    """Counters as vLLM names them: drafts (steps with proposals), draft tokens proposed,
    accepted, and tokens emitted by those steps (accepted + the one sampled after them)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0

    def observe(self, proposed: int, accepted: int, emitted: int) -> None:
        if proposed:
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            self.num_emitted_tokens += emitted

    def stats(self) -> dict[str, float]:
        """For /metrics and bench JSON (``spec_decode_`` prefix)."""
        return {f"spec_decode_{k}": float(v) for k, v in vars(self).items()}

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step (vLLM's: 1 + accepted per draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
