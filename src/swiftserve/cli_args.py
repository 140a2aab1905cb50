"""Command-line flags generated from the option dataclasses (EngineConfig, ServerSettings),
so every option is a flag with the dataclass's name, default and validation."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from swiftserve.config import (
    BF16_GEMMS,
    DEVICES,
    DTYPES,
    KERNEL_BACKENDS,
    LOAD_FORMATS,
    POLICIES,
    QUANTIZATIONS,
    TOKENIZER_MODES,
    EngineConfig,
)
from swiftserve.server.settings import ENGINE_MODES, TOOL_CALL_PARSERS, ServerSettings

_CHOICES = {
    "dtype": DTYPES,
    "scheduling_policy": POLICIES,
    "quantization": QUANTIZATIONS,
    "engine_mode": ENGINE_MODES,
    "kernel_backend": KERNEL_BACKENDS,
    "bf16_gemm": BF16_GEMMS,
    "device": DEVICES,
    "load_format": LOAD_FORMATS,
    "tokenizer_mode": TOKENIZER_MODES,
    "tool_call_parser": TOOL_CALL_PARSERS,
}


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in _comma_list(text))


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--kebab-case`` flag per field of an option dataclass (unset flags stay None)."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind.startswith("tuple[int"):
            parser.add_argument(flag, type=_int_list, default=None, metavar="N,N,...")
        elif kind.startswith("tuple"):
            parser.add_argument(flag, type=_comma_list, default=None, metavar="A,B,...")
        elif "bool" in kind:
            # ``--flag`` alone means true (vLLM's store_true flags); ``--flag false`` still works.
            parser.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=None, metavar="BOOL")
        elif "int" in kind:
            parser.add_argument(flag, type=int, default=None)
        elif "float" in kind:
            parser.add_argument(flag, type=float, default=None)
        else:
            parser.add_argument(flag, type=str, default=None, choices=_CHOICES.get(f.name))


def dataclass_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options of ``cls`` given on the command line (unset flags keep the defaults)."""
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None:
            out[f.name] = value
    return out


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--model`` and one ``--kebab-case`` flag per EngineConfig field."""
    add_dataclass_args(parser, EngineConfig)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig options given on the command line (unset flags keep defaults)."""
    return dataclass_kwargs(args, EngineConfig)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerSettings field."""
    add_dataclass_args(parser, ServerSettings)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(**dataclass_kwargs(args, ServerSettings))
