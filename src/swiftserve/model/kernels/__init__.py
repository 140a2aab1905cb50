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
_SOURCES = (
    "paged_decode.cpp",
    "layer_ops.cpp",
    "gemv.cpp",
    "bf16_gemm.cpp",
    "layer_stack.cpp",
    "bindings.cpp",
)


def cpu_kernels() -> ModuleType | None:
    """The compiled module (``paged_decode``, ``rms_norm``, ``add_rms_norm``, ``rope_qk_``,
    ``silu_and_mul``, ``write_kv_``, ``int8_gemv``, ``bf16_linear``, ``decoder_stack``), or
    None when unavailable."""
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

                here = Path(__file__).parent
                _module = load(
                    name="swiftserve_cpu_kernels_v13",
                    sources=[str(here / name) for name in _SOURCES],
                    # fast-math: vectorized expf (libmvec) and reassociated sums; the
                    # kernel is tested against the exact PyTorch path.
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp", "-lmvec"],
                    verbose=False,
                )
            except Exception as e:  # any build failure means: use the PyTorch path
                logger.warning("CPU kernels unavailable (%s); using the PyTorch path", e)
                _failed = True
    return _module
