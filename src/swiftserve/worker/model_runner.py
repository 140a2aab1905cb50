"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Inputs are written into persistent numpy buffers whose torch views the model reads, so a
step allocates no new input tensors for ids, positions and slots. Logits are computed
only for the rows that sample (and rows whose prompt logprobs were asked for).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from swiftserve.core.messages import PLACEHOLDER, RunnerOutput, ScheduledRequest, SchedulerOutput
from swiftserve.model.attention import AttentionMetadata, PrefillSegment, TileRuns
from swiftserve.model.kv_quant import row_width
from swiftserve.model.llama import LlamaForCausalLM
from swiftserve.model.ops import TorchOps
from swiftserve.worker.cuda_graphs import DecodeGraphs
from swiftserve.worker.guided import GuidedDecoding
from swiftserve.worker.kv_memory import allocate_kv_caches
from swiftserve.worker.sampler import Sampler, SamplingState, logprob_entries
from swiftserve.worker.spec_verify import verify

logger = logging.getLogger(__name__)

# Prompt runs of this many rows go to the tiled attention kernel where the backend has it: at
# 1,000 tokens of context it beats the row kernel from 8 rows (issue 24's notes).
TILE_MIN_ROWS = 8


@dataclass
class _Batch:
    num_tokens: int
    meta: AttentionMetadata
    order: list[ScheduledRequest]
    sample_rows: list[tuple[int, str]]  # (row, request_id)
    prompt_rows: list[tuple[str, list[int], list[int]]]  # (request_id, rows, target tokens)
    spec_rows: list[tuple[str, list[int], list[int]]]  # (request_id, rows of the last token + drafts, drafts)


class ModelRunner:
    """Owns the model, the KV cache tensors and the per-request sampling state."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        ops: TorchOps,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        seed: int = 0,
        guided: GuidedDecoding | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.window = cfg.sliding_window
        dtype = model.dtype
        # the embedding, not lm_head: packing may replace lm_head (tied or not) with a weightless module
        self.device = device = model.model.embed_tokens.weight.device
        self.cuda = device.type == "cuda"
        kv_dtype = kv_dtype or dtype  # int8: rows of head_dim values + their scale (model/kv_quant.py)
        shape = (
            cfg.num_kv_heads,
            num_blocks,
            block_size,
            row_width(cfg.head_dim, kv_dtype),
        )  # see attention.py
        # all zeros (padded gathers read unused slots), without a zero-fill pass on the CPU
        # a pipeline stage holds only its own layers (worker/pipeline_stage.py)
        self.kv_caches = allocate_kv_caches(len(model.model.layers), shape, kv_dtype, device)
        # Persistent inputs: numpy views of (pinned, on CUDA) host staging buffers that each step
        # refills, copied to persistent device buffers (the same tensors on the CPU). A step
        # ends with the sampled tokens on the host, so the next refill never races a copy.
        self.max_tokens = n = max_num_batched_tokens
        staging = torch.zeros(3, n, dtype=torch.int64, pin_memory=self.cuda)
        self._staging = staging
        self._ids, self._pos, self._slots = staging.numpy()
        self._inputs = staging.to(device) if self.cuda else staging
        self._ids_t, self._pos_t, self._slots_t = self._inputs
        self.sampler = Sampler(seed)
        self.guided = guided
        self.ops = ops
        # Prompt rows through the row attention kernel too (each row a query at its position)
        # in place of one SDPA call per prompt, where the backend says it pays.
        self.fused_prefill = ops.fused_rows(cfg, dtype)
        self.fused_rows_limit = ops.fused_rows_limit
        self.tile_rows = ops.tile_rows(cfg, dtype, kv_dtype, block_size)
        self.states: dict[str, SamplingState] = {}
        self.graphs: DecodeGraphs | None = None

    def capture_graphs(self, sizes: tuple[int, ...], max_model_len: int) -> None:
        """Capture decode-only CUDA graphs at these batch sizes (worker/cuda_graphs.py)."""
        from swiftserve.worker.cuda_graphs import DecodeGraphs

        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.ops, sizes, max_blocks)

    # ---- request state -------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            self.states.pop(request_id, None)
        for new in sched.new_requests:
            params = new.sampling_params
            gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            state = SamplingState(
                params, new.prompt_token_ids, list(new.output_token_ids), new.eos_token_ids, gen
            )
            if params.structured_outputs is not None and self.guided is not None:
                # built off-thread while this step's forward runs; replays tokens after preemption
                state.grammar = self.guided.start(params.structured_outputs, state.output_token_ids)
            self.states[new.request_id] = state

    # ---- batch preparation ---------------------------------------------------------------
    def _tokens(self, s: ScheduledRequest) -> list[int]:
        """The step's token ids, placeholders (always at the tail: tokens sampled by the step
        before, scheduled before it finished) read from this runner's own sampled tokens."""
        ids = s.token_ids
        if ids[-1] != PLACEHOLDER:
            return ids
        state = self.states[s.request_id]
        offset = s.start_pos - len(state.prompt_token_ids)
        out = state.output_token_ids
        return [t if t != PLACEHOLDER else out[offset + i] for i, t in enumerate(ids)]

    def _slots_for(self, block_ids: list[int], positions: np.ndarray) -> np.ndarray:
        table = np.asarray(block_ids, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _prepare(self, scheduled: list[ScheduledRequest]) -> _Batch:
        decode = [s for s in scheduled if len(s.token_ids) == 1]
        prefill = [s for s in scheduled if len(s.token_ids) > 1]
        tiled = [s for s in prefill if len(s.token_ids) >= TILE_MIN_ROWS] if self.tile_rows else []
        if tiled:  # the tiled runs are the batch's last rows
            prefill = [s for s in prefill if len(s.token_ids) < TILE_MIN_ROWS]
        order = decode + prefill + tiled
        sample_rows: list[tuple[int, str]] = []
        prompt_rows: list[tuple[str, list[int], list[int]]] = []
        spec_rows: list[tuple[str, list[int], list[int]]] = []
        decode_tables = decode_mask = None
        num_decode = len(decode)
        if decode:
            decode_tables, decode_mask = self._prepare_decode(decode)
            sample_rows = [(i, s.request_id) for i, s in enumerate(decode) if s.sample]
        segments: list[PrefillSegment] = []
        row = num_decode
        # big prompt chunks go to SDPA where the backend says the row kernel loses there
        fused = self.fused_prefill and sum(len(s.token_ids) for s in prefill) <= self.fused_rows_limit
        # (decode rows were staged above; prompt rows below; one host-to-device copy after)
        for s in prefill:
            positions = self._stage_prompt(s, row, sample_rows, spec_rows, prompt_rows)
            if not fused:
                segments.append(self._segment(s, row, positions))
            row += len(positions)
        if fused and prefill:
            decode_tables = self._row_tables(order[: len(decode) + len(prefill)], row)
            num_decode, segments = row, []
        tiles = self._tile_runs(tiled, row) if tiled else None
        for s in tiled:
            row += len(self._stage_prompt(s, row, sample_rows, spec_rows, prompt_rows))
        if self.cuda:
            self._inputs[:, :row].copy_(self._staging[:, :row], non_blocking=True)
            decode_tables, decode_mask = self._dev(decode_tables), self._dev(decode_mask)
            segments = [self._segment_to_device(seg) for seg in segments]
        meta = AttentionMetadata(
            self._slots_t[:row],
            num_decode,
            decode_tables,
            decode_mask,
            segments,
            decode_positions=self._pos_t[:num_decode],
            window=self.window,
            ops=self.ops,
            tiles=tiles,
        )
        return _Batch(row, meta, order, sample_rows, prompt_rows, spec_rows)

    def _stage_prompt(
        self,
        s: ScheduledRequest,
        row: int,
        sample_rows: list[tuple[int, str]],
        spec_rows: list[tuple[str, list[int], list[int]]],
        prompt_rows: list[tuple[str, list[int], list[int]]],
    ) -> np.ndarray:
        """Stage a prompt chunk (or verification run) at ``row``; note the rows that sample,
        verify drafts or score prompt tokens. Returns its positions."""
        n = len(s.token_ids)
        positions = np.arange(s.start_pos, s.start_pos + n, dtype=np.int64)
        self._ids[row : row + n] = self._tokens(s)
        self._pos[row : row + n] = positions
        self._slots[row : row + n] = self._slots_for(s.block_ids, positions)
        if s.num_spec:  # verify: logits at the last token and at every draft
            rows = list(range(row + n - 1 - s.num_spec, row + n))
            spec_rows.append((s.request_id, rows, s.token_ids[n - s.num_spec :]))
        elif s.sample:
            sample_rows.append((row + n - 1, s.request_id))
        if s.prompt_logprob_start is not None:
            prompt_rows.append(self._prompt_rows(s, row))
        return positions

    def _tile_runs(self, tiled: list[ScheduledRequest], row: int) -> TileRuns:
        """The tiled kernel's description of ``tiled``, whose rows start at ``row``."""
        runs = np.empty((len(tiled), 3), dtype=np.int64)
        for i, s in enumerate(tiled):
            runs[i] = (row, len(s.token_ids), s.start_pos)
            row += len(s.token_ids)
        return TileRuns(torch.from_numpy(self._block_tables(tiled)), torch.from_numpy(runs))

    def _dev(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(self.device, non_blocking=True)

    def _segment_to_device(self, seg: PrefillSegment) -> PrefillSegment:
        return PrefillSegment(
            seg.q_start, seg.q_end, self._dev(seg.ctx_blocks), seg.ctx_len, self._dev(seg.mask)
        )

    def _prepare_decode(self, decode: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch = len(decode)
        positions = np.fromiter((s.start_pos for s in decode), dtype=np.int64, count=batch)
        self._ids[:batch] = [self._tokens(s)[0] for s in decode]
        self._pos[:batch] = positions
        table = self._block_tables(decode)
        num_blocks = table.shape[1]
        bs = self.block_size
        self._slots[:batch] = table[np.arange(batch), positions // bs] * bs + positions % bs
        table_t = torch.from_numpy(table)
        if not self.ops.decode_mask:
            return table_t, None  # the fused kernel needs no mask
        ctx = np.arange(num_blocks * bs, dtype=np.int64)
        mask = ctx[None, :] <= positions[:, None]
        if self.window is not None:
            mask &= ctx[None, :] > positions[:, None] - self.window
        return table_t, torch.from_numpy(mask).view(1, batch, 1, num_blocks * bs)

    def _block_tables(self, requests: list[ScheduledRequest]) -> np.ndarray:
        """[len(requests), nb] block ids covering each request's positions up to this step's
        last token, padded with block 0."""
        nb = max(-(-(s.start_pos + len(s.token_ids)) // self.block_size) for s in requests)
        tables = np.zeros((len(requests), nb), dtype=np.int64)
        for i, s in enumerate(requests):
            blocks = s.block_ids[:nb]
            tables[i, : len(blocks)] = blocks
        return tables

    def _row_tables(self, order: list[ScheduledRequest], rows: int) -> torch.Tensor:
        """[rows, nb] block table of every row's request (decode rows, then prompt rows)."""
        counts = [len(s.token_ids) for s in order]
        return torch.from_numpy(np.repeat(self._block_tables(order), counts, axis=0)[:rows])

    def _segment(self, s: ScheduledRequest, row: int, positions: np.ndarray) -> PrefillSegment:
        n = len(positions)
        end = s.start_pos + n
        fresh = s.start_pos == 0 and (self.window is None or n <= self.window)
        if fresh:
            return PrefillSegment(row, row + n, None, n, None)
        blocks = torch.tensor(s.block_ids[: -(-end // self.block_size)], dtype=torch.long)
        if self.window is None:  # plain causal after the cached context: no mask to build
            return PrefillSegment(row, row + n, blocks, end, None)
        ctx = np.arange(end, dtype=np.int64)
        mask = (ctx[None, :] <= positions[:, None]) & (ctx[None, :] > positions[:, None] - self.window)
        return PrefillSegment(row, row + n, blocks, end, torch.from_numpy(mask).view(1, 1, n, end))

    def _prompt_rows(self, s: ScheduledRequest, row: int) -> tuple[str, list[int], list[int]]:
        """Rows whose logits score the next prompt token (positions up to prompt_len - 2)."""
        state = self.states[s.request_id]
        prompt = state.prompt_token_ids
        start = max(s.start_pos, s.prompt_logprob_start or 0)
        stop = min(s.start_pos + len(s.token_ids), len(prompt) - 1)
        positions = range(start, stop)
        return (
            s.request_id,
            [row + p - s.start_pos for p in positions],
            [prompt[p + 1] for p in positions],
        )

    # ---- execution -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step: forward the scheduled tokens, sample where requests need a token."""
        self._update_states(sched)
        result = RunnerOutput()
        if sched.is_empty:
            return result
        if self._graph_step(sched.scheduled):
            return self._replay(sched.scheduled, result)
        hidden, batch = self.forward(sched.scheduled)
        rows = [r for r, _ in batch.sample_rows]
        for _, spec_rows, _ in batch.spec_rows:
            rows.extend(spec_rows)
        for _, prompt_rows, _ in batch.prompt_rows:
            rows.extend(prompt_rows)
        if not rows:
            return result
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=self.device)))
        num_sample = len(batch.sample_rows)
        if num_sample == len(rows) and self._argmax_only(batch.sample_rows, logits, result):
            return result
        if self.cuda:
            logits = logits.cpu()  # the sampler's per-request generators live on the host
        num_spec = sum(len(r) for _, r, _ in batch.spec_rows)
        if num_sample:
            self._sample(logits[:num_sample], batch.sample_rows, result)
        if num_spec:
            self._verify(logits[num_sample : num_sample + num_spec], batch.spec_rows, result)
        self._prompt_logprobs(logits[num_sample + num_spec :], batch, result)
        return result

    def forward(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, _Batch]:
        """The model's final hidden states for these rows (their KV written), and the batch
        layout that says which row is whose (the draft model runs its steps through this)."""
        batch = self._prepare(scheduled)
        t = batch.num_tokens
        return self.model(self._ids_t[:t], self._pos_t[:t], self.kv_caches, batch.meta), batch

    def _verify(
        self, logits: torch.Tensor, spec_rows: list[tuple[str, list[int], list[int]]], result: RunnerOutput
    ) -> None:
        """Accept or reject each request's drafts (worker/spec_verify.py)."""
        states = [self.states[rid] for rid, _, _ in spec_rows]
        drafts = [d for _, _, d in spec_rows]
        matchers = [s.grammar.result() if s.grammar is not None else None for s in states]
        masks: list[torch.Tensor | None] = [
            self.guided.draft_masks(m, d) if s.grammar is not None and self.guided is not None else None
            for s, m, d in zip(states, matchers, drafts, strict=True)
        ]
        emitted, logprobs = verify(logits, drafts, states, self.sampler.generator, masks)
        for (rid, _, _), tokens, lps, state, matcher in zip(
            spec_rows, emitted, logprobs, states, matchers, strict=True
        ):
            if matcher is not None:
                for token in tokens:
                    GuidedDecoding.advance(matcher, token)
            state.output_token_ids.extend(tokens)
            result.spec_token_ids[rid] = tokens
            if lps is not None:
                result.spec_logprobs[rid] = lps

    def _graph_step(self, scheduled: list[ScheduledRequest]) -> bool:
        """Decode-only steps where every row samples and a captured bucket holds the batch."""
        return (
            self.graphs is not None
            and self.graphs.bucket(len(scheduled)) is not None
            and all(len(s.token_ids) == 1 and s.sample and s.prompt_logprob_start is None for s in scheduled)
        )

    def _replay(self, scheduled: list[ScheduledRequest], result: RunnerOutput) -> RunnerOutput:
        assert self.graphs is not None
        batch = len(scheduled)
        positions = np.fromiter((s.start_pos for s in scheduled), dtype=np.int64, count=batch)
        tables = self._block_tables(scheduled)
        bs = self.block_size
        slots = tables[np.arange(batch), positions // bs] * bs + positions % bs
        ids = np.fromiter((self._tokens(s)[0] for s in scheduled), dtype=np.int64, count=batch)
        logits = self.graphs.run(ids, positions, slots, tables)
        sample_rows = [(i, s.request_id) for i, s in enumerate(scheduled)]
        if not self._argmax_only(sample_rows, logits, result):
            self._sample(logits.cpu(), sample_rows, result)
        return result

    def _argmax_only(
        self, sample_rows: list[tuple[int, str]], logits: torch.Tensor, result: RunnerOutput
    ) -> bool:
        """When every row is plain greedy: the argmax where the logits are, only the token ids
        to the host (on a GPU, [B] ids instead of [B, vocab] logits). False: sample as usual."""
        states = [self.states[rid] for _, rid in sample_rows]
        if not all(s.params.plain_greedy for s in states):
            return False
        for (_, rid), token, state in zip(sample_rows, logits.argmax(dim=-1).tolist(), states, strict=True):
            state.output_token_ids.append(token)
            result.sampled_token_ids[rid] = token
        return True

    def _sample(self, logits: torch.Tensor, sample_rows: list[tuple[int, str]], result: RunnerOutput) -> None:
        states = [self.states[rid] for _, rid in sample_rows]
        rows = [i for i, s in enumerate(states) if s.grammar is not None]
        matchers = [states[i].grammar.result() for i in rows]  # type: ignore[union-attr]
        grammar = (rows, self.guided.masks(matchers)) if rows and self.guided is not None else None
        tokens, entries = self.sampler(logits, states, grammar)
        for i, matcher in zip(rows, matchers, strict=True):
            if matcher is not None:
                GuidedDecoding.advance(matcher, tokens[i])
        for (_, rid), token, entry, state in zip(sample_rows, tokens, entries, states, strict=True):
            state.output_token_ids.append(token)
            result.sampled_token_ids[rid] = token
            if entry is not None:
                result.logprobs[rid] = entry

    def _prompt_logprobs(self, logits: torch.Tensor, batch: _Batch, result: RunnerOutput) -> None:
        offset = 0
        for rid, rows, targets in batch.prompt_rows:
            n = len(rows)
            k = self.states[rid].params.prompt_logprobs or 0
            lp = torch.log_softmax(logits[offset : offset + n], dim=-1)
            result.prompt_logprobs[rid] = logprob_entries(lp, targets, [k] * n) if n else []
            offset += n
