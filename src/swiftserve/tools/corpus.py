"""The demo model's text: this Python's standard library sources, split into train and held-out.

The split rule is fixed and needs no randomness: a file is held out when the CRC-32 of its
path relative to the stdlib root is divisible by ``HELDOUT_MODULUS`` (about 1 file in 20).
Test suites and site-packages are left out, so the corpus is the library code itself.
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

HELDOUT_MODULUS = 20
_SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every library ``*.py`` file under the stdlib root, in a stable (sorted) order."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not _SKIP_PARTS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(relative_path: str) -> bool:
    """The fixed split rule (see the module docstring)."""
    return zlib.crc32(relative_path.encode()) % HELDOUT_MODULUS == 0


def split_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files)."""
    root = root or stdlib_root()
    train: list[Path] = []
    heldout: list[Path] = []
    for path in stdlib_files(root):
        (heldout if is_heldout(path.relative_to(root).as_posix()) else train).append(path)
    return train, heldout


def read_texts(files: list[Path]) -> Iterator[str]:
    """File contents (undecodable bytes replaced), skipping empty files."""
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text


def heldout_text() -> str:
    """The held-out files concatenated in order, one blank line between files."""
    return "\n\n".join(read_texts(split_files()[1]))
