"""Optional compiled CPU kernels, built by ``make install`` with torch's C++ extension loader.

The build is cached under a name keyed by the sources, their folder and the CPU's instruction
sets, so a different checkout or a different machine never picks up (or clobbers) another's
build, and
the engine loads the cached module at start (never inside a request). If the build fails (no
compiler, no ninja), callers use the PyTorch backend, which computes the same result; tests
check both agree. ``EngineConfig.kernel_backend`` chooses the backend (model/ops.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16")
_SOURCES = (
    "paged_decode.cpp",
    "layer_ops.cpp",
    "gemv.cpp",
    "gemv_vnni.cpp",
    "kv_int8.cpp",
    "bf16_gemm.cpp",
    "layer_stack.cpp",
    "prompt_tiles.cpp",
    "amx_gemm.cpp",
    "bindings.cpp",
)


def cpu_kernels() -> ModuleType | None:
    """The compiled module (``paged_decode``, ``rms_norm``, ``add_rms_norm``, ``rope_qk_``,
    ``silu_and_mul``, ``write_kv_``, ``int8_gemv``, ``bf16_linear``, ``decoder_stack``), or
    None when unavailable."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            name = build_name()
            _module = _load_prebuilt(name)
            if _module is not None:
                return _module
            try:
                from torch.utils.cpp_extension import load

                here = Path(__file__).parent
                _module = load(
                    name=name,
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


def _build_dir(name: str) -> Path:
    """Where torch's extension loader builds ``name`` (its own rule, without importing
    torch.utils.cpp_extension, which costs ~150 ms of start-up)."""
    import torch
    from torch import _appdirs

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cache = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
        accel = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        if torch.version.hip is not None:
            accel = f"rocm{torch.version.hip.replace('.', '')}"
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cache, f"{py}_{accel}")
    return Path(root) / name


def _load_prebuilt(name: str) -> ModuleType | None:
    """The already built module, imported directly (no ninja run, no cpp_extension import).

    Safe because the name is keyed by the sources: a built .so of this name is up to date.
    Anything odd (no file, a truncated link) returns None and the full loader rebuilds.
    """
    path = _build_dir(name) / f"{name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as e:  # fall back to torch's loader, which rebuilds if it must
        logger.info("prebuilt CPU kernels at %s not loadable (%s): rebuilding", path, e)
        return None


def cpu_isa() -> tuple[str, ...]:
    """The instruction-set extensions of this CPU that the kernels care about."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return tuple(flag for flag in _ISA_FLAGS if flag in flags)


def build_name() -> str:
    """Extension name keyed by the kernel sources, their folder and this CPU's instruction sets."""
    here = Path(__file__).parent
    # The checkout's path too: torch's build folder records absolute source paths, so two
    # checkouts sharing one name would rebuild over each other on every switch.
    digest = hashlib.sha256(",".join((*cpu_isa(), str(here.resolve()))).encode())
    for name in (*_SOURCES, "ops.h", "simd.h", "split.h", "amx.h", "bf16_simd.h"):
        path = here / name
        if path.is_file():
            digest.update(path.read_bytes())
    return f"swiftserve_cpu_kernels_{digest.hexdigest()[:12]}"
