"""CUDA graphs for decode-only steps, captured at bucketed batch sizes (vLLM's scheme).

One graph per bucket size runs embeddings -> decoder stack -> final norm -> lm_head over
static input buffers: token ids, positions, KV slots and block tables padded to the longest
context. A step of B decode rows copies its inputs into the buffers (one host-to-device copy
from a pinned staging buffer), pads rows B..bucket with slot -1 (write no KV) and position 0,
and replays the smallest bucket >= B. Sampling stays outside the graph. Every Triton kernel
is compiled by the warm-up before capture; all graphs share one memory pool.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from swiftserve.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """Captured decode graphs; ``run`` returns float32 logits for the batch's rows."""

    def __init__(self, model: Any, kv_caches: list[Any], ops: Any, sizes: tuple[int, ...], max_blocks: int):
        self.model = model
        self.sizes = tuple(sorted(sizes))
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        device = model.model.embed_tokens.weight.device
        b = self.max_batch
        # ids, positions, slots, then the [b, max_blocks] table, in one buffer: one copy a step
        self._host = torch.zeros(3 * b + b * max_blocks, dtype=torch.int64, pin_memory=True)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros_like(self._host, device=device)
        self.ids, self.pos, self.slots = (self._dev[i * b : (i + 1) * b] for i in range(3))
        self.tables = self._dev[3 * b :].view(b, max_blocks)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        window = model.config.sliding_window
        for size in reversed(self.sizes):  # largest first: later graphs reuse its pool memory
            meta = AttentionMetadata(
                self.slots[:size], size, self.tables[:size], None, [],
                decode_positions=self.pos[:size], window=window, ops=ops,
            )  # fmt: skip
            self.slots[:size].fill_(-1)  # warm-up and capture write no KV
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles every kernel at this shape outside the capture
                    model.compute_logits(model(self.ids[:size], self.pos[:size], kv_caches, meta))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = model.compute_logits(model(self.ids[:size], self.pos[:size], kv_caches, meta))
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def bucket(self, batch: int) -> int | None:
        """The smallest captured size that holds ``batch`` rows, or None."""
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """Replay the bucket for these B decode rows; logits [B, vocab] (float32, on the device)."""
        batch, blocks = tables.shape
        size = self.bucket(batch)
        assert size is not None and blocks <= self.max_blocks
        b, host = self.max_batch, self._host_np
        host[:size] = 0
        host[:batch] = ids
        host[b : b + size] = 0
        host[b : b + batch] = pos
        host[2 * b : 2 * b + size] = -1  # padding rows write no KV
        host[2 * b : 2 * b + batch] = slots
        table = host[3 * b :].reshape(b, self.max_blocks)
        table[:size] = 0
        table[:batch, :blocks] = tables
        self._dev.copy_(self._host, non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:batch]
