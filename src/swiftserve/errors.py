"""Errors shared across layers (no torch): what a user did wrong, named once."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory that is missing files or holds something we cannot serve."""
