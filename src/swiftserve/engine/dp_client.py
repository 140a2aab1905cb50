"""Data parallel: N engine processes behind one API server, one router in front.

Each replica is a full engine (its own scheduler, KV cache and model copy) in its own process,
pinned to its share of the cores (engine/placement.py). A request goes to the replica with
the least load, vLLM's score ``waiting x 4 + running`` from the stats every replica sends
after each step, plus the requests routed to it since its last update (so a burst between
updates spreads out). Aborts and stop-string stops go to the replica that owns the request.
A replica that dies is the engine dying: every request in flight fails, ``/health`` turns 503
and the server exits non-zero, as with one engine.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from swiftserve.config import EngineConfig
from swiftserve.core.messages import Abort, Add, CoreInfo, EngineCoreOutput
from swiftserve.engine.core_client import Emit, ProcessCoreClient
from swiftserve.engine.placement import replica_cores

logger = logging.getLogger(__name__)
MEAN_STATS = ("kv_cache_usage", "step_budget", "pipeline_max_in_flight")  # averaged; the rest summed


class DataParallelCoreClient:
    """The ProcessCoreClient interface over ``config.data_parallel_size`` engine processes."""

    def __init__(self, config: EngineConfig, model_path: str, progress: bool = True):
        shares = replica_cores(config.data_parallel_size, config.cpu_affinity)
        self.replicas: list[ProcessCoreClient] = []
        for i, cores in enumerate(shares):
            replica = dataclasses.replace(
                config, data_parallel_size=1, cpu_affinity=cores, num_threads=config.num_threads or len(cores)
            )
            logger.info("data-parallel replica %d: cores %s", i, list(cores))
            self.replicas.append(
                ProcessCoreClient(replica, model_path, progress, name=f"swiftserve-engine-{i}")
            )
        self.error: BaseException | None = None
        self._owner: dict[str, int] = {}
        self._pending = [0] * len(shares)  # routed since the replica's last stats update
        self._seen = [0] * len(shares)
        self._routed = [0] * len(shares)  # requests routed so far (for /metrics)
        self._next = 0
        self._lock = threading.Lock()
        self._emit: Emit = lambda _: None

    @property
    def info(self) -> CoreInfo:
        return self.wait_ready()

    def wait_ready(self) -> CoreInfo:
        infos = [r.wait_ready() for r in self.replicas]
        return infos[0]

    def start(self, emit: Emit) -> None:
        self._emit = emit
        for i, replica in enumerate(self.replicas):
            replica.start(self._emitter(i))

    def _emitter(self, index: int) -> Emit:
        def emit(item: list[EngineCoreOutput] | BaseException) -> None:
            if isinstance(item, BaseException):
                if self.error is None:
                    self.error = RuntimeError(f"data-parallel replica {index} died: {item}")
                    self._emit(self.error)
                return
            with self._lock:
                for out in item:
                    if out.finish_reason is not None:
                        self._owner.pop(out.request_id, None)
            self._emit(item)

        return emit

    def _pick(self) -> int:
        """The least-loaded replica (waiting x 4 + running + routed since its last update);
        ties go round-robin, so sequential requests on an idle server alternate."""
        n = len(self.replicas)
        self._next = (self._next + 1) % n
        best, best_score = 0, float("inf")
        for i in ((self._next + j) % n for j in range(n)):
            replica = self.replicas[i]
            if replica.stats_version != self._seen[i]:
                self._seen[i], self._pending[i] = replica.stats_version, 0
            stats = replica.stats()
            score = 4 * stats.get("num_waiting", 0) + stats.get("num_running", 0) + self._pending[i]
            if score < best_score:
                best, best_score = i, score
        return best

    def send(self, command: Add | Abort) -> None:
        if isinstance(command, Add):
            with self._lock:
                index = self._pick()
                self._pending[index] += len(command.requests)
                self._routed[index] += len(command.requests)
                for request in command.requests:
                    self._owner[request.request_id] = index
            self.replicas[index].send(command)
            return
        by_owner: dict[int, list[str]] = {}
        with self._lock:
            for request_id in command.request_ids:
                owner = self._owner.pop(request_id, None)
                if owner is not None:
                    by_owner.setdefault(owner, []).append(request_id)
        for owner, ids in by_owner.items():
            self.replicas[owner].send(Abort(ids, command.stopped))

    def stop(self) -> None:
        threads = [threading.Thread(target=r.stop) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def stats(self) -> dict[str, Any]:
        """The replicas' stats summed (kv_cache_usage and step_budget averaged), with each
        replica's own under ``engines``."""
        per = [r.stats() for r in self.replicas]
        if not any(per):
            return {}
        total: dict[str, Any] = {}
        for stats in per:
            for key, value in stats.items():
                if isinstance(value, int | float):
                    total[key] = total.get(key, 0) + value
        for key in MEAN_STATS:
            if key in total:
                total[key] /= len(per)
        with self._lock:
            routed = list(self._routed)
        total["engines"] = [{**stats, "routed_requests": n} for stats, n in zip(per, routed, strict=True)]
        return total
