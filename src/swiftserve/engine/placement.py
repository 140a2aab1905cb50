"""Which cores each data-parallel replica runs on (no torch).

The cores this process may use are ordered NUMA node by node (Linux's
/sys/devices/system/node), then split into equal contiguous shares, one per replica, so a
replica's threads share a node's memory where the split allows. Each replica pins itself to
its share (``os.sched_setaffinity``) and runs one torch thread per core.
"""

from __future__ import annotations

import os
from pathlib import Path

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """Linux's cpulist format: "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


def numa_order(cores: list[int], root: Path = NODE_ROOT) -> list[int]:
    """``cores`` ordered by NUMA node, then by id (by id alone where the machine tells nothing)."""
    node_of: dict[int, int] = {}
    for node_dir in sorted(root.glob("node[0-9]*")) if root.is_dir() else []:
        try:
            for core in parse_cpulist((node_dir / "cpulist").read_text()):
                node_of[core] = int(node_dir.name[4:])
        except (OSError, ValueError):
            continue
    return sorted(cores, key=lambda c: (node_of.get(c, 0), c))


def replica_cores(
    replicas: int, cores: tuple[int, ...] | None = None, what: str = "data_parallel_size"
) -> list[tuple[int, ...]]:
    """One share of cores per replica (or pipeline stage: ``what`` names the option);
    ValueError when there are fewer cores than replicas."""
    available = list(cores) if cores else sorted(os.sched_getaffinity(0))
    if len(available) < replicas:
        raise ValueError(
            f"{what}={replicas} needs at least one core per process, but only "
            f"{len(available)} are available ({available}); set --cpu-affinity or --num-threads, "
            "or lower it"
        )
    ordered = numa_order(available) if not cores else available
    share, extra = divmod(len(ordered), replicas)
    out, start = [], 0
    for i in range(replicas):
        size = share + (1 if i < extra else 0)
        out.append(tuple(ordered[start : start + size]))
        start += size
    return out
