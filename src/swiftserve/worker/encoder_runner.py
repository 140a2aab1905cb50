"""EncoderRunner: the worker side of embeddings (loads the encoder, runs batches of inputs)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from swiftserve.model.config import is_encoder_checkpoint

if TYPE_CHECKING:
    from swiftserve.model.encoder import EncoderModel

__all__ = ["EncoderRunner", "is_encoder_checkpoint"]


class EncoderRunner:
    """Owns one encoder model; ``embed`` runs a whole batch in one forward."""

    def __init__(self, path: str | Path, dtype: str = "float32"):
        from swiftserve.model.encoder import EncoderModel  # torch: only where it runs

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
