"""EmbeddingEngine: the engine-side embedding service, an encoder behind a DynamicBatcher.

The server reaches the encoder only through this class (never ``model/``): requests are
``submit``-ted one input at a time and batched by size or an adaptive window (batching/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swiftserve.batching import DynamicBatcher
from swiftserve.worker.encoder_runner import EncoderRunner, is_encoder_checkpoint, worker_layout

__all__ = ["EmbeddingEngine", "is_encoder_checkpoint"]


class EmbeddingEngine:
    """One encoder checkpoint behind an adaptive DynamicBatcher (start() before submit())."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 10.0,
        target_p99_ms: float | None = 200.0,
        max_queue_size: int = 4096,
        workers: int | None = None,
        set_threads: bool = True,
    ):
        """``workers``: batches run side by side (None: one per core, one thread each; see
        worker_layout). ``set_threads=False`` leaves torch's thread count alone (when an LLM
        engine shares this process)."""
        self.workers, threads = worker_layout(workers)
        self.runner = EncoderRunner(path, threads=threads if set_threads else None)
        self.batcher = DynamicBatcher(
            self.runner.embed,
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
            adaptive=True,
            target_p99_ms=target_p99_ms,
            max_queue_size=max_queue_size,
            priority_levels=2,
            aging_ms=1000.0,
            # latency first: a lone request does not wait for company that is not coming
            min_expected_arrivals=1.0,
            max_concurrent_batches=self.workers,
        )

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_seq_length(self) -> int:
        return self.runner.max_seq_length

    async def start(self) -> None:
        await self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    async def submit(self, item: str | list[int], priority: int = 0) -> tuple[list[float], int]:
        """(embedding, tokens used) of one input (raises the batcher's QueueFull / QueueTimeout)."""
        return await self.batcher.submit(item, priority=priority)  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        return self.batcher.stats()  # type: ignore[no-any-return]
