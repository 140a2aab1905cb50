"""Start-up timeline: one log line per phase, in milliseconds since the process started.

Cold start is a product feature (autoscaling, restarts, a newcomer's first ``make serve``),
so every process that builds part of the server says where its start-up time went. Times are
measured from the moment the OS created the process (so interpreter start and imports are
counted), or from an anchor passed in (the engine process counts from the server's start).
No torch here: the server's frontend imports this before anything heavy.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("swiftserve.startup")


def process_start_epoch() -> float:
    """Wall-clock time (epoch seconds) at which the OS created this process.

    Read from /proc (Linux); elsewhere the time of the first call, which misses the
    interpreter's own start-up.
    """
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
        return time.time() - uptime + start_ticks / ticks
    except (OSError, ValueError, IndexError):
        return time.time()


class Timeline:
    """Phases of one process's start-up: ``with timeline.phase("load weights"): ...``.

    ``anchor`` is the epoch time that counts as 0 ms (default: this process's creation).
    """

    def __init__(self, who: str, anchor: float | None = None):
        self.who = who
        self.anchor = process_start_epoch() if anchor is None else anchor
        self.phases: list[tuple[str, float, float]] = []  # (name, start ms, duration ms)

    def now_ms(self) -> float:
        return (time.time() - self.anchor) * 1000.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.now_ms()
        try:
            yield
        finally:
            self.record(name, start)

    def record(self, name: str, start_ms: float) -> None:
        """Close a phase that began at ``start_ms`` (from ``now_ms()``) and log it."""
        end = self.now_ms()
        self.phases.append((name, start_ms, end - start_ms))
        logger.info("startup[%s]: %-24s %7.0f ms  (done at %.0f ms)", self.who, name, end - start_ms, end)

    def mark(self, name: str) -> None:
        """A point in time, e.g. "ready" (a phase of zero length)."""
        now = self.now_ms()
        self.phases.append((name, now, 0.0))
        logger.info("startup[%s]: %-24s at %.0f ms", self.who, name, now)


_current: Timeline | None = None


def current() -> Timeline:
    """This process's timeline (created on first use)."""
    global _current
    if _current is None:
        _current = Timeline("main")
    return _current


def set_current(timeline: Timeline) -> None:
    global _current
    _current = timeline


def freeze_heap() -> None:
    """Collect once, then move every object alive after start-up (modules, the model's Python
    side, tokenizers) out of the collector's view, so the full collections that serving
    triggers now and then scan only what serving made: shorter pauses in the latency tail."""
    import gc

    gc.collect()
    gc.freeze()
