"""DraftRunner: a small draft model that proposes tokens for speculative decoding.

It runs after a target step for the requests the scheduler wants proposals for
(``SchedulerOutput.draft_ids``), on its own KV cache laid out over the *same* block ids as the
target's (a block id names the same positions in both pools; only the bytes per block differ):

1. **catch-up**: a forward over the request's known-right tokens that have no draft KV yet (the
   bonus token the target just sampled included). The runner remembers how far each request's
   draft KV is right (``done``); the draft's own guesses that the target accepted were written
   with the right tokens already, so a request that proposes every step catches up one token
   (two when every guess was accepted). A request seen for the first time, or preempted,
   catches up from position 0: requests that do not propose (back-off after misses, or never)
   cost the draft nothing, so blocks shared through the prefix cache may lack draft KV. A long
   backlog is split into forwards that fit the runner's buffers;
2. **proposals**: the argmax at the last catch-up row is the first draft token, and k - 1
   one-token steps give the rest (greedy drafts: a point mass, which the verifier accepts
   with the target's probability, so outputs stay exact whatever the draft proposes).

Draft KV written past the accepted tokens is rewritten by a later catch-up. Proposals stop
at the request's allocated blocks (the scheduler's lookahead slots, core/draft.py) and at the
context length: the draft never writes into a block that is not the request's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from swiftserve.core.messages import RunnerOutput, ScheduledRequest, SchedulerOutput
from swiftserve.model.config import ModelConfig
from swiftserve.model.llama import LlamaForCausalLM
from swiftserve.model.ops import TorchOps
from swiftserve.worker.model_runner import ModelRunner
from swiftserve.worker.sampler import SamplingState

logger = logging.getLogger(__name__)


class DraftRunner:
    """The draft model, its KV cache, and the two phases of a proposal (module docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        ops: TorchOps,
        *,
        k: int,
        num_blocks: int,
        block_size: int,
        max_num_tokens: int,
        max_model_len: int,
    ):
        self.k = k
        self.block_size = block_size
        self.max_model_len = max_model_len
        # the runner gives the draft its own KV pool and input buffers; it never samples
        self.runner = ModelRunner(
            model, ops, num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=max_num_tokens
        )
        self.done: dict[str, int] = {}  # positions below this have the right draft KV
        self.fed: dict[str, tuple[int, list[int]]] = {}  # guesses fed from a position (proposals)

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, states: dict[str, SamplingState], result: RunnerOutput) -> None:
        """Catch the draft's KV up with this step and fill ``result.draft_token_ids``."""
        for rid in (*sched.finished_request_ids, *sched.preempted_request_ids):
            self.done.pop(rid, None)  # preempted: recomputed from its new start, blocks and all
            self.fed.pop(rid, None)
        rows: list[ScheduledRequest] = []
        for s in sched.scheduled:
            state = states.get(s.request_id)
            if state is None or s.request_id not in sched.draft_ids:
                continue
            row = self._catch_up_row(s, state)
            if row is not None:
                rows.append(row)
        if not rows:
            return
        last = self._catch_up(rows)  # argmax at the last row of each proposing request
        drafts = {rid: [token] for rid, token in last.items()}
        ends = {r.request_id: r.start_pos + len(r.token_ids) for r in rows if r.sample}
        tables = {r.request_id: r.block_ids for r in rows if r.sample}
        for _ in range(self.k - 1):
            step = [
                ScheduledRequest(rid, [d[-1]], ends[rid] + len(d) - 1, tables[rid], True)
                for rid, d in drafts.items()
                if self._room(ends[rid] + len(d) - 1, tables[rid])
            ]
            if not step:
                break
            for rid, token in self._forward(step).items():
                drafts[rid].append(token)
        result.draft_token_ids.update(drafts)
        self.fed.update((rid, (ends[rid], d[:-1])) for rid, d in drafts.items())  # all but the last fed

    def _catch_up_row(self, s: ScheduledRequest, state: SamplingState) -> ScheduledRequest | None:
        """A proposing request's known-right tokens that have no draft KV (with the token the
        step sampled, whose logits give the first draft); None when it sampled nothing."""
        tokens = state.prompt_token_ids + state.output_token_ids
        if not (s.sample and len(tokens) > s.start_pos + len(s.token_ids) - s.num_spec):
            return None
        end = min(len(tokens), len(s.block_ids) * self.block_size, self.max_model_len)
        begin = min(self._begin(s.request_id, tokens), end - 1)
        self.done[s.request_id] = end
        return ScheduledRequest(s.request_id, tokens[begin:end], begin, s.block_ids, True)

    def _catch_up(self, rows: list[ScheduledRequest]) -> dict[str, int]:
        """Forward the catch-up rows in pieces that fit the buffers (a long backlog is split;
        its head pieces sample nothing); the first draft token of each row."""
        limit = self.runner.max_tokens
        first: dict[str, int] = {}
        while rows:
            batch: list[ScheduledRequest] = []
            rest: list[ScheduledRequest] = []
            room = limit
            for r in rows:
                n = len(r.token_ids)
                if n <= room:
                    batch.append(r)
                    room -= n
                elif room > 0:  # the head now, the tail in a later forward
                    batch.append(
                        ScheduledRequest(r.request_id, r.token_ids[:room], r.start_pos, r.block_ids, False)
                    )
                    tail = r.token_ids[room:]
                    rest.append(ScheduledRequest(r.request_id, tail, r.start_pos + room, r.block_ids, True))
                    room = 0
                else:
                    rest.append(r)
            first.update(self._forward(batch))
            rows = rest
        return first

    def _begin(self, request_id: str, tokens: list[int]) -> int:
        """The first position whose draft KV is missing: 0 for a request seen first, else past
        the guesses the target accepted."""
        done = self.done.get(request_id)
        if done is None:
            return 0
        start, guesses = self.fed.pop(request_id, (done, []))
        if start == done:
            for token in guesses:
                if done >= len(tokens) or tokens[done] != token:
                    break
                done += 1
        return done

    def _room(self, position: int, block_ids: list[int]) -> bool:
        return position < min(len(block_ids) * self.block_size, self.max_model_len)

    def _forward(self, rows: list[ScheduledRequest]) -> dict[str, int]:
        """One draft forward; the argmax token of each sampling row, by request id."""
        hidden, batch = self.runner.forward(rows)
        if not batch.sample_rows:
            return {}
        picked = [r for r, _ in batch.sample_rows]
        if len(picked) < hidden.shape[0]:  # (a step of one-token rows that all sample: every row)
            hidden = hidden.index_select(0, torch.tensor(picked, device=hidden.device))
        tokens = self.runner.model.compute_logits(hidden).argmax(dim=-1).tolist()
        return {rid: token for (_, rid), token in zip(batch.sample_rows, tokens, strict=True)}


def check_draft(target_dir: Path, draft_dir: Path, max_model_len: int) -> ModelConfig:
    """The draft's config, after checking it can propose for the target: the same vocabulary
    (size and, where both ship a tokenizer.json, the same token strings) and positions for
    the whole context. A clear ValueError naming ``speculative_config.model`` otherwise."""
    own = "speculative_config.model"
    target, draft = ModelConfig.from_dir(target_dir), ModelConfig.from_dir(draft_dir)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{own}: the draft's vocab_size ({draft.vocab_size}) differs from the target's "
            f"({target.vocab_size})"
        )
    vocabs = [_vocab(d) for d in (target_dir, draft_dir)]
    if vocabs[0] is not None and vocabs[1] is not None and vocabs[0] != vocabs[1]:
        raise ValueError(f"{own}: the draft's tokenizer differs from the target's (another vocabulary)")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"{own}: the draft's max_position_embeddings ({draft.max_position_embeddings}) is below "
            f"max_model_len ({max_model_len})"
        )
    return draft


def _vocab(model_dir: Path) -> dict[str, int] | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocab = data.get("model", {}).get("vocab")
    added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    return {**vocab, **added} if isinstance(vocab, dict) else None
