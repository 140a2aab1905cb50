"""Tokenizer loading (Hugging Face tokenizer files; never remote code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swiftserve.errors import CheckpointError


def load_tokenizer(path: str | Path) -> Any:
    """AutoTokenizer from a local directory with tokenizer.json / tokenizer_config.json."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{path}: no tokenizer.json or tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
