"""EncoderRunner: the worker side of embeddings (loads the encoder, runs batches of inputs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from swiftserve.model.config import is_encoder_checkpoint

if TYPE_CHECKING:
    from swiftserve.model.encoder import EncoderModel

__all__ = ["EncoderRunner", "available_cores", "is_encoder_checkpoint", "worker_layout"]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_layout(workers: int | None) -> tuple[int, int]:
    """(concurrent forwards, torch threads each) for the cores available.

    Default: one single-threaded forward per core. Measured with all-MiniLM-L6-v2 on 2 cores
    (docs/benchmarks.md): two 1-thread forwards side by side beat one 2-thread forward at
    every load: a lone sentence after an idle gap runs faster on one thread (no OpenMP team
    to wake), and a request that arrives while another runs starts at once instead of
    queueing behind it (p99 at 10 req/s 44 -> 36 ms, under bursts 141 -> 86 ms).
    """
    cores = available_cores()
    n = workers if workers is not None else min(cores, 8)
    return n, max(1, cores // n)


class EncoderRunner:
    """Owns one encoder model; ``embed`` runs a whole batch (several may run at once, from
    different threads: the model is read-only at inference)."""

    def __init__(self, path: str | Path, dtype: str = "float32", threads: int | None = None):
        import torch

        from swiftserve.model.encoder import EncoderModel  # torch: only where it runs

        if threads is not None:
            # Process-wide: only the embedding server's process sets it (the LLM engine,
            # when there is one, runs in its own process; see server/launcher.py).
            torch.set_num_threads(threads)
        self.model: EncoderModel = EncoderModel(path, dtype)

    @property
    def vocab_size(self) -> int:
        return int(self.model.tokenizer.vocab_size)

    @property
    def max_seq_length(self) -> int:
        return int(self.model.max_seq_length)

    def count_tokens(self, item: str | list[int]) -> int:
        return self.model.count_tokens(item)

    def embed(self, items: list[str | list[int]]) -> list[tuple[list[float], int]]:
        """(vector, tokens used) per item: the token count comes from the batch's own
        tokenization, so the server never tokenizes an input twice."""
        return self.model.embed_counted(items)
