"""Shared fixtures: tiny random checkpoints in real Hugging Face layout, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from swiftserve.tools.demo import write_random_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}

MODEL_SPECS = {
    "llama3": dict(architecture="llama", rope_parameters=LLAMA3_ROPE),
    "llama_tied_sharded": dict(architecture="llama", tie_word_embeddings=True, max_shard_size="100KB"),
    "qwen2": dict(architecture="qwen2"),
    "mistral": dict(architecture="mistral", sliding_window=24),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        name: write_random_checkpoint(root / name, preset="tiny", seed=i, **spec)  # type: ignore[arg-type]
        for i, (name, spec) in enumerate(MODEL_SPECS.items())
    }


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama3"]
