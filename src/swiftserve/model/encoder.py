"""Encoder models for embeddings (BERT family through ``transformers``), pooled as the
checkpoint's sentence-transformers config says (mean pooling + L2 normalisation by default).

Inputs longer than ``max_seq_length`` are truncated, as sentence-transformers does. A batch
is tokenized in one call and run as a few forwards of similar lengths (``length_groups``):
padding every sentence to the longest of a mixed batch cost ~25% of the encoder's time on
8-40 word sentences.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from swiftserve.model.config import ENCODER_TYPES, CheckpointError, is_encoder_checkpoint

__all__ = ["ENCODER_TYPES", "EncoderModel", "is_encoder_checkpoint"]


def _pooling(path: Path) -> tuple[str, bool]:
    """(mode, normalize) from modules.json / the Pooling module's config."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return "mean", True
    modules = json.loads(modules_file.read_text())
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    mode = "mean"
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            cfg_file = path / m.get("path", "") / "config.json"
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            if cfg.get("pooling_mode_cls_token"):
                mode = "cls"
            elif cfg.get("pooling_mode_max_tokens"):
                mode = "max"
            elif cfg.get("pooling_mode_mean_sqrt_len_tokens"):
                mode = "mean_sqrt_len"
    return mode, normalize


# One more forward costs about as much as this many padded tokens (MiniLM on CPU: ~3 ms of
# fixed cost per call against ~0.09 ms per token); the grouping trades the two.
FORWARD_COST_TOKENS = 32


def length_groups(lengths: list[int], step: int = 8, overhead: int = FORWARD_COST_TOKENS) -> list[list[int]]:
    """Indices of ``lengths`` split into forwards of similar length, cheapest first-to-last.

    Sorted by length and cut (at multiples of ``step`` items) where the padding saved pays
    for another forward: a dynamic program over the cut points minimizing
    ``sum(overhead + items x longest)`` of the groups.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    cuts = [*range(0, len(order), step), len(order)]
    best = [0.0] + [math.inf] * (len(cuts) - 1)
    back = [0] * len(cuts)
    for j in range(1, len(cuts)):
        longest = lengths[order[cuts[j] - 1]]
        for i in range(j):
            cost = best[i] + overhead + (cuts[j] - cuts[i]) * longest
            if cost < best[j]:
                best[j], back[j] = cost, i
    groups: list[list[int]] = []
    j = len(cuts) - 1
    while j > 0:
        groups.append(order[cuts[back[j]] : cuts[j]])
        j = back[j]
    return groups[::-1]


class EncoderModel:
    """Batched text -> embedding vectors."""

    def __init__(self, path: str | Path, dtype: str = "float32"):
        from transformers import AutoModel, AutoTokenizer

        self.path = Path(path)
        if not is_encoder_checkpoint(self.path):
            raise CheckpointError(f"{path}: not an encoder checkpoint (model_type in {ENCODER_TYPES})")
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        torch_dtype = torch.float32 if dtype in ("auto", "float32") else getattr(torch, dtype)
        self.model = AutoModel.from_pretrained(
            str(self.path), dtype=torch_dtype, local_files_only=True
        ).eval()
        self.pooling, self.normalize = _pooling(self.path)
        st_cfg = self.path / "sentence_bert_config.json"
        limit = self.model.config.max_position_embeddings
        if st_cfg.is_file():
            limit = min(limit, json.loads(st_cfg.read_text()).get("max_seq_length", limit))
        self.max_seq_length = int(limit)
        self.dimensions = int(self.model.config.hidden_size)

    def count_tokens(self, item: str | list[int]) -> int:
        return len(self.token_ids([item])[0])

    def token_ids(self, items: list[str | list[int]]) -> list[list[int]]:
        """Truncated token ids of each item (strings tokenized in one batched call)."""
        texts = [x for x in items if isinstance(x, str)]
        encoded = iter(
            self.tokenizer(texts, truncation=True, max_length=self.max_seq_length)["input_ids"]
            if texts
            else []
        )
        return [next(encoded) if isinstance(x, str) else list(x)[: self.max_seq_length] for x in items]

    def embed(self, items: list[str | list[int]]) -> list[list[float]]:
        """Embed a batch; strings are tokenized, token-id lists are used as given."""
        return [vector for vector, _ in self.embed_counted(items)]

    @torch.inference_mode()
    def embed_counted(self, items: list[str | list[int]]) -> list[tuple[list[float], int]]:
        """(embedding, tokens used) of each item, in order."""
        id_lists = self.token_ids(items)
        out: list[tuple[list[float], int]] = [([], 0)] * len(items)
        for group in length_groups([len(ids) for ids in id_lists]):
            vectors = self._forward([id_lists[i] for i in group])
            for i, vector in zip(group, vectors, strict=True):
                out[i] = (vector, len(id_lists[i]))
        return out

    def _forward(self, id_lists: list[list[int]]) -> list[list[float]]:
        width = max(len(ids) for ids in id_lists)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([row + [pad] * (width - len(row)) for row in id_lists])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in id_lists])
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        pooled = self._pool(hidden, mask)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.tolist()  # type: ignore[no-any-return]

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(hidden.dtype)
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.pooling == "max":
            return hidden.masked_fill(m == 0, -1e9).max(dim=1).values
        summed = (hidden * m).sum(dim=1)
        counts = m.sum(dim=1).clamp(min=1e-9)
        if self.pooling == "mean_sqrt_len":
            return summed / counts.sqrt()
        return summed / counts
