"""Where a model comes from: a local checkpoint directory, or the built-in demo when none is named."""

from __future__ import annotations

from pathlib import Path

from swiftserve.worker.encoder_runner import is_encoder_checkpoint

__all__ = ["DEMO_MODEL_DIR", "demo_model_dir", "is_encoder_checkpoint", "resolve_model"]

DEMO_MODEL_DIR = Path(__file__).parent.parent / "demo_model"


def demo_model_dir() -> Path:
    """The built-in demo: the trained checkpoint shipped in the package (``swiftserve train-demo``)."""
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return DEMO_MODEL_DIR
    raise ValueError(
        f"the built-in demo model is missing ({DEMO_MODEL_DIR}); pass --model DIR, or recreate it "
        f"with `swiftserve train-demo --out {DEMO_MODEL_DIR}` (about 13 minutes on 2 cores)"
    )


def resolve_model(model: str | None) -> Path:
    """A checkpoint directory for ``model`` (the demo when None)."""
    if model is None:
        return demo_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model: {model!r} is not a local checkpoint directory (no hub access)")
    return path
