"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

Inputs are written into persistent numpy buffers whose torch views the model reads, so a
step allocates no new input tensors for ids, positions and slots. Logits are computed
only for the rows that sample (and rows whose prompt logprobs were asked for).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from swiftserve.core.messages import RunnerOutput, ScheduledRequest, SchedulerOutput
from swiftserve.model.attention import AttentionMetadata, PrefillSegment
from swiftserve.model.kernels import cpu_kernels
from swiftserve.model.llama import LlamaForCausalLM
from swiftserve.worker.sampler import Sampler, SamplingState, logprob_entries

logger = logging.getLogger(__name__)


@dataclass
class _Batch:
    num_tokens: int
    meta: AttentionMetadata
    order: list[ScheduledRequest]
    sample_rows: list[tuple[int, str]]  # (row, request_id)
    prompt_rows: list[tuple[str, list[int], list[int]]]  # (request_id, rows, target tokens)


class ModelRunner:
    """Owns the model, the KV cache tensors and the per-request sampling state."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        seed: int = 0,
        use_kernels: bool = True,
    ):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.window = cfg.sliding_window
        dtype = model.dtype
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)  # see model/attention.py
        # zeros, not empty: padded gathers read unused slots, which must hold finite values.
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)
        ]
        n = max_num_batched_tokens
        self._ids = np.zeros(n, dtype=np.int64)
        self._pos = np.zeros(n, dtype=np.int64)
        self._slots = np.zeros(n, dtype=np.int64)
        self._ids_t = torch.from_numpy(self._ids)
        self._pos_t = torch.from_numpy(self._pos)
        self._slots_t = torch.from_numpy(self._slots)
        self.sampler = Sampler(seed)
        self.kernel = cpu_kernels() if use_kernels else None
        # Prompt rows through the fused kernel too (each row is a query at its position), in
        # place of one SDPA call per prompt: bfloat16 with the register-resident shapes only;
        # float32 stays on SDPA, the reference path that must match transformers exactly.
        self.fused_prefill = (
            self.kernel is not None
            and dtype == torch.bfloat16
            and cfg.head_dim == 64
            and cfg.num_heads // cfg.num_kv_heads <= 4
            and os.environ.get("SWIFTSERVE_FUSED_PREFILL", "1") != "0"
        )
        self.states: dict[str, SamplingState] = {}

    # ---- request state -------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for request_id in sched.finished_request_ids:
            self.states.pop(request_id, None)
        for new in sched.new_requests:
            params = new.sampling_params
            gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            self.states[new.request_id] = SamplingState(
                params, new.prompt_token_ids, list(new.output_token_ids), new.eos_token_ids, gen
            )

    # ---- batch preparation ---------------------------------------------------------------
    def _slots_for(self, block_ids: list[int], positions: np.ndarray) -> np.ndarray:
        table = np.asarray(block_ids, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _prepare(self, scheduled: list[ScheduledRequest]) -> _Batch:
        decode = [s for s in scheduled if len(s.token_ids) == 1]
        prefill = [s for s in scheduled if len(s.token_ids) > 1]
        order = decode + prefill
        sample_rows: list[tuple[int, str]] = []
        prompt_rows: list[tuple[str, list[int], list[int]]] = []
        decode_tables = decode_mask = None
        num_decode = len(decode)
        if decode:
            decode_tables, decode_mask = self._prepare_decode(decode)
            sample_rows = [(i, s.request_id) for i, s in enumerate(decode) if s.sample]
        segments: list[PrefillSegment] = []
        row = num_decode
        for s in prefill:
            n = len(s.token_ids)
            positions = np.arange(s.start_pos, s.start_pos + n, dtype=np.int64)
            self._ids[row : row + n] = s.token_ids
            self._pos[row : row + n] = positions
            self._slots[row : row + n] = self._slots_for(s.block_ids, positions)
            if not self.fused_prefill:
                segments.append(self._segment(s, row, positions))
            if s.sample:
                sample_rows.append((row + n - 1, s.request_id))
            if s.prompt_logprob_start is not None:
                prompt_rows.append(self._prompt_rows(s, row))
            row += n
        if self.fused_prefill and prefill:
            decode_tables = self._row_tables(order, row)
            num_decode, segments = row, []
        meta = AttentionMetadata(
            self._slots_t[:row],
            num_decode,
            decode_tables,
            decode_mask,
            segments,
            decode_positions=self._pos_t[:num_decode],
            window=self.window,
            kernel=self.kernel,
        )
        return _Batch(row, meta, order, sample_rows, prompt_rows)

    def _prepare_decode(self, decode: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch = len(decode)
        positions = np.fromiter((s.start_pos for s in decode), dtype=np.int64, count=batch)
        self._ids[:batch] = [s.token_ids[0] for s in decode]
        self._pos[:batch] = positions
        table = self._block_tables(decode)
        num_blocks = table.shape[1]
        bs = self.block_size
        self._slots[:batch] = table[np.arange(batch), positions // bs] * bs + positions % bs
        table_t = torch.from_numpy(table)
        if self.kernel is not None:
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
        ctx = np.arange(end, dtype=np.int64)
        mask = ctx[None, :] <= positions[:, None]
        if self.window is not None:
            mask &= ctx[None, :] > positions[:, None] - self.window
        blocks = torch.tensor(s.block_ids[: -(-end // self.block_size)], dtype=torch.long)
        mask_t = torch.from_numpy(mask).view(1, 1, n, end)
        return PrefillSegment(row, row + n, blocks, end, mask_t)

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
        batch = self._prepare(sched.scheduled)
        t = batch.num_tokens
        hidden = self.model(self._ids_t[:t], self._pos_t[:t], self.kv_caches, batch.meta)
        rows = [r for r, _ in batch.sample_rows]
        for _, prompt_rows, _ in batch.prompt_rows:
            rows.extend(prompt_rows)
        if not rows:
            return result
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows)))
        num_sample = len(batch.sample_rows)
        if num_sample:
            states = [self.states[rid] for _, rid in batch.sample_rows]
            tokens, entries = self.sampler(logits[:num_sample], states)
            for (_, rid), token, entry, state in zip(batch.sample_rows, tokens, entries, states, strict=True):
                state.output_token_ids.append(token)
                result.sampled_token_ids[rid] = token
                if entry is not None:
                    result.logprobs[rid] = entry
        self._prompt_logprobs(logits[num_sample:], batch, result)
        return result

    def _prompt_logprobs(self, logits: torch.Tensor, batch: _Batch, result: RunnerOutput) -> None:
        offset = 0
        for rid, rows, targets in batch.prompt_rows:
            n = len(rows)
            k = self.states[rid].params.prompt_logprobs or 0
            lp = torch.log_softmax(logits[offset : offset + n], dim=-1)
            result.prompt_logprobs[rid] = logprob_entries(lp, targets, [k] * n) if n else []
            offset += n
