"""KV cache memory: the pool of K and V blocks for every layer.

On the CPU the pool is one anonymous memory mapping. The OS hands out its pages already
zeroed, on first touch, so a 2 GiB pool costs nothing at start-up (``torch.zeros`` spent
~1.8 s writing zeros that nothing had asked for yet) and the memory is still all zeros:
padded gathers of the reference attention read unused slots, which must hold finite
values. On CUDA ``torch.zeros`` fills at memory bandwidth, so it stays.
"""

from __future__ import annotations

import math
import mmap

import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def zeroed_host_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of ``numel`` zeros backed by lazily mapped, OS-zeroed pages."""
    nbytes = max(1, numel * dtype.itemsize)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # No MADV_HUGEPAGE: with THP defrag on "madvise" (a common default) each first touch
    # compacts memory for a 2 MiB page; measured, the first step took 0.65 s instead of 70 ms.
    # frombuffer keeps a reference to the mapping, which lives as long as the tensor
    return torch.frombuffer(buffer, dtype=torch.uint8, count=numel * dtype.itemsize).view(dtype)


def allocate_kv_caches(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> KVCaches:
    """(K, V) per layer, each of ``shape``, all zeros."""
    if device.type != "cpu":
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
    per = math.prod(shape)
    pool = zeroed_host_tensor(2 * num_layers * per, dtype).view(num_layers, 2, *shape)
    return [(pool[i, 0], pool[i, 1]) for i in range(num_layers)]
