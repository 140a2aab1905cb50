"""Command-line flags generated from EngineConfig, so every engine option is a flag."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from swiftserve.config import DTYPES, POLICIES, QUANTIZATIONS, EngineConfig

_CHOICES = {"dtype": DTYPES, "scheduling_policy": POLICIES, "quantization": QUANTIZATIONS}


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--model`` and one ``--kebab-case`` flag per EngineConfig field."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if "bool" in kind:
            parser.add_argument(flag, type=_parse_bool, default=None, metavar="BOOL")
        elif "int" in kind:
            parser.add_argument(flag, type=int, default=None)
        elif "float" in kind:
            parser.add_argument(flag, type=float, default=None)
        else:
            parser.add_argument(flag, type=str, default=None, choices=_CHOICES.get(f.name))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig options given on the command line (unset flags keep defaults)."""
    out = {}
    for f in dataclasses.fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            out[f.name] = value
    return out
