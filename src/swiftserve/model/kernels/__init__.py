"""Optional compiled CPU kernels, built on first use with torch's C++ extension loader.

If the build fails (no compiler, no ninja) or ``SWIFTSERVE_CPU_KERNELS=0``, callers fall
back to the pure-PyTorch path, which computes the same result; tests check both agree.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def paged_decode_kernel() -> ModuleType | None:
    """The compiled module with ``paged_decode``, or None when unavailable."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("SWIFTSERVE_CPU_KERNELS", "1") == "0":
        _failed = True
        return None
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load

                source = Path(__file__).with_name("paged_decode.cpp")
                _module = load(
                    name="swiftserve_paged_decode_v4",
                    sources=[str(source)],
                    # fast-math: vectorized expf (libmvec) and reassociated sums; the
                    # kernel is tested against the exact PyTorch path.
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp", "-lmvec"],
                    verbose=False,
                )
            except Exception as e:  # any build failure means: use the PyTorch path
                logger.warning("CPU attention kernel unavailable (%s); using PyTorch path", e)
                _failed = True
    return _module
