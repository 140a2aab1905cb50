"""Helpers shared by the frozen option dataclasses (SamplingParams, EngineConfig).

Unknown option names must be errors, never silently dropped; the error is a ``ValueError``
(also a ``TypeError``, which is what Python itself raises for an unexpected keyword).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class UnknownOptionError(ValueError, TypeError):
    """An option name that the receiving class does not know."""


def reject_unknown_options(cls: type[T]) -> type[T]:
    """Wrap a dataclass ``__init__`` so unknown keyword names raise ``UnknownOptionError``."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    original: Callable[..., None] = cls.__init__  # type: ignore[misc]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise UnknownOptionError(
                f"{cls.__name__}: unknown option(s) {', '.join(unknown)}; "
                f"valid options: {', '.join(sorted(names))}"
            )
        original(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign,misc]
    return cls


def check_finite(owner: str, name: str, value: float) -> None:
    """Raise ValueError naming ``owner.name`` if value is NaN or infinite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, got {value!r}")


def check_range(
    owner: str,
    name: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ValueError naming the field and the allowed range when value is outside it."""
    check_finite(owner, name, value)
    bad_low = low is not None and (value <= low if low_open else value < low)
    bad_high = high is not None and (value >= high if high_open else value > high)
    if bad_low or bad_high:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low}"
        hi = "inf)" if high is None else f"{high}" + (")" if high_open else "]")
        raise ValueError(f"{owner}.{name} must be in {lo}, {hi}, got {value!r}")
