"""Draft-model proposals, as the scheduler sees them. Pure Python, no torch.

The draft model runs in the worker (worker/draft_runner.py): after each step it proposes up to
k tokens for the requests this module asked for, and they come back in the step's
``RunnerOutput.draft_token_ids``; the next schedule verifies them with the request's last token,
exactly as n-gram drafts are verified. Two things differ from prompt lookup:

* the draft writes KV a few positions past the tokens a step computes (its own guesses), so the
  scheduler allocates ``lookahead`` = k slots more than it schedules, when the pool has them
  (the worker never writes past a request's blocks);
* proposals cost draft forwards whether or not they are verified, so the adaptive rule
  (``pays``) and the per-request back-off decide which requests get proposals at all (``wants``),
  and whatever was proposed is then verified.
"""

from __future__ import annotations

from swiftserve.core.ngram import NgramProposer, eligible
from swiftserve.core.request import Request


class DraftProposer(NgramProposer):
    """Holds the draft model's proposals between the step that made them and the next one."""

    # A proposal costs k draft forwards besides the verification rows: back off sooner (two
    # misses in a row) and for longer than prompt lookup does.
    min_rate = 0.2
    max_cooldown = 32

    def __init__(self, k: int, adaptive: bool = True):
        super().__init__(k, 1, 1, adaptive)
        self.lookahead = k
        self._received: dict[str, list[int]] = {}

    def wants(self, request: Request) -> bool:
        """Whether the worker should propose for ``request`` after this step (called once per
        step for each request that samples); drafts not verified by now are dropped."""
        self._received.pop(request.request_id, None)
        if not eligible(request):
            return False
        index = self._index(request.request_id)
        if index.cooldown:
            index.cooldown -= 1
            return False
        return True

    def receive(self, request_id: str, drafts: list[int]) -> None:
        self._received[request_id] = drafts

    def propose(self, request: Request, limit: int) -> list[int]:
        drafts = self._received.pop(request.request_id, [])
        if self._index(request.request_id).cooldown:
            return []  # asked for before the last miss came back: not worth verifying
        return drafts[: max(limit, 0)]

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._received.pop(request_id, None)
