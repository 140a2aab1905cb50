"""Default sampling settings from a checkpoint's ``generation_config.json``.

As in vLLM, a request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or
``repetition_penalty`` unset gets the checkpoint's value when it names one (the trained demo
model names a temperature of 0.7: greedy decoding of a 12M-parameter model loops).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_sampling(model_dir: str | Path) -> dict[str, float]:
    """The sampling fields the checkpoint's generation config sets (empty when it has none)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    out: dict[str, float] = {}
    for name in SAMPLING_FIELDS:
        value = data.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = value
    return out
