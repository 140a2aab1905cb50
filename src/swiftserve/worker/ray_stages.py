"""Pipeline stages as Ray actors (``distributed_executor_backend="ray"``).

Ray places the stages (on any machine of the cluster that has the CPUs) and owns their
processes; each actor runs the same stage loop as an ``mp`` stage (worker/pipeline.py:
``stage_main``), which connects back to the engine's control address. Nothing else changes:
hidden states still go stage to stage over torch.distributed, control messages as msgspec.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from swiftserve.config import EngineConfig


def _ray() -> Any:
    import ray

    if not ray.is_initialized():  # join the cluster RAY_ADDRESS names, else start a local one
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    return ray


def engine_host() -> str:
    """This machine's address on the Ray cluster (where the stages reach the engine)."""
    return str(_ray().util.get_node_ip_address())


class StageActor:
    """One pipeline stage in a Ray actor."""

    def run(self, rank: int, address: tuple[str, int], timeout_s: float, log_level: int) -> None:
        from swiftserve.worker.stage_process import stage_main

        stage_main(rank, address, timeout_s, log_level)


def start_ray_stages(
    config: EngineConfig, address: tuple[str, int], placement: list[tuple[Any, int]]
) -> list[Any]:
    """One actor per stage, ``num_cpus`` = its torch threads; each starts its loop at once."""
    ray = _ray()
    remote = ray.remote(StageActor)
    level = logging.getLogger().getEffectiveLevel()
    actors = []
    for rank, (_, threads) in enumerate(placement):
        actor = remote.options(num_cpus=threads, max_restarts=0).remote()
        actor.run.remote(rank, address, config.distributed_timeout_s, level)  # runs until shutdown
        actors.append(actor)
    return actors


def stop_ray_stages(actors: list[Any]) -> None:
    ray = _ray()
    for actor in actors:
        ray.kill(actor)
