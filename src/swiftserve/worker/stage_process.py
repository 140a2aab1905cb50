"""A pipeline stage's process and the control protocol between it and the engine.

A stage process (``python -m swiftserve.worker.stage_process``, a Ray actor, or one of
``swiftserve serve --node-rank k``'s) connects to the engine's control address, says its
rank (``Hello``), receives the engine's config (``StageInit``), joins the torch.distributed
group and loads its layers, then answers the engine's messages until ``Shutdown``. Every
message is a msgspec Struct sent as bytes over a multiprocessing Connection (authenticated
with a shared key), never pickle. The engine's side is worker/pipeline.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Client, Connection
from typing import Any

import msgspec

from swiftserve.config import EngineConfig
from swiftserve.core.messages import ModelInfo, RunnerOutput, SchedulerOutput
from swiftserve.engine.placement import replica_cores

logger = logging.getLogger(__name__)
# Shared by the engine and the stages it admits (multiprocessing's HMAC challenge); set
# SWIFTSERVE_PP_AUTHKEY to the same secret on every machine of a real cluster.
DEFAULT_AUTHKEY = b"swiftserve-pipeline"


def authkey() -> bytes:
    return os.environ.get("SWIFTSERVE_PP_AUTHKEY", "").encode() or DEFAULT_AUTHKEY


# ---- control messages ------------------------------------------------------------------------
class Hello(msgspec.Struct, frozen=True, tag="hello"):
    rank: int
    host: str  # this stage's address as the engine sees it
    port: int  # rank 0: a free port there for the torch.distributed rendezvous


class StageInit(msgspec.Struct, frozen=True, tag="init"):
    config: EngineConfig
    model_dir: str
    dist_addr: str
    dist_port: int
    cores: tuple[int, ...] | None  # pin to these (None: leave the affinity alone)
    num_threads: int


class Step(msgspec.Struct, frozen=True, tag="step"):
    sched: SchedulerOutput


class NumBlocks(msgspec.Struct, frozen=True, tag="blocks"):
    pass


class InitKV(msgspec.Struct, frozen=True, tag="init_kv"):
    num_blocks: int


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


class StageReady(msgspec.Struct, frozen=True, tag="ready"):
    info: ModelInfo
    layers: tuple[int, int]
    stack: bool  # the stage's decode steps run through the C++ layer stack


class Value(msgspec.Struct, frozen=True, tag="value"):
    value: int


class Result(msgspec.Struct, frozen=True, tag="result"):
    output: RunnerOutput


class StageFailed(msgspec.Struct, frozen=True, tag="failed"):
    message: str


_to_stage = msgspec.msgpack.Decoder(StageInit | Step | NumBlocks | InitKV | Shutdown)  # type: ignore[arg-type]
_from_stage = msgspec.msgpack.Decoder(StageReady | Value | Result | StageFailed)  # type: ignore[arg-type]
_to_stage_hello = msgspec.msgpack.Decoder(Hello)
encode = msgspec.msgpack.encode


def stages_on_node(config: EngineConfig) -> range:
    """The ranks machine ``node_rank`` runs (the same number on every machine)."""
    per = config.pipeline_parallel_size // config.nnodes
    return range(config.node_rank * per, (config.node_rank + 1) * per)


def stage_placement(config: EngineConfig, ranks: range) -> list[tuple[tuple[int, ...] | None, int]]:
    """(cores to pin to, torch threads) per local stage: a share of the cores each; with
    ``num_threads`` and fewer cores than stages, unpinned (oversubscribed on purpose)."""
    available = config.cpu_affinity or tuple(sorted(os.sched_getaffinity(0)))
    if config.num_threads and len(available) < len(ranks):
        return [(None, config.num_threads)] * len(ranks)
    shares = replica_cores(len(ranks), config.cpu_affinity, "pipeline_parallel_size (stages on this machine)")
    return [(share, config.num_threads or len(share)) for share in shares]


# ---- the stage process -------------------------------------------------------------------------
def _connect(address: tuple[str, int], timeout_s: float) -> Connection:
    """Connect to the engine's control address, retrying until ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey())
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"could not reach the engine at --master-addr {address[0]} (control port "
                    f"{address[1]}) within {timeout_s:g} s: {e}"
                ) from e
            time.sleep(0.2)


def stage_main(rank: int, address: tuple[str, int], timeout_s: float, log_level: int) -> None:
    """Entry point of one stage process (also what a Ray actor runs)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    conn = _connect(address, timeout_s)
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        host = sock.getsockname()[0]  # the interface that reaches the engine
    conn.send_bytes(encode(Hello(rank, host, _free_port(host) if rank == 0 else 0)))
    try:
        init = _to_stage.decode(conn.recv_bytes())
        assert isinstance(init, StageInit)
        worker = _start_stage(rank, init)
        ready = StageReady(worker.model_info, worker.layer_range, bool(worker.model.stack))
        conn.send_bytes(encode(ready))
        _serve_stage(conn, worker)
    except (EOFError, BrokenPipeError):
        os._exit(0)  # the engine went away
    except BaseException as e:
        logger.exception("pipeline stage %d died", rank)
        try:
            conn.send_bytes(encode(StageFailed(f"stage {rank}: {e!r}")))
        finally:
            os._exit(1)


def _start_stage(rank: int, init: StageInit) -> Any:
    if init.cores is not None:  # before torch sizes its thread pools
        os.sched_setaffinity(0, set(init.cores))
    import datetime

    import torch
    import torch.distributed as dist

    from swiftserve.worker.worker import Worker

    torch.set_num_threads(init.num_threads)
    config = init.config
    world = config.pipeline_parallel_size
    backend = "nccl" if config.device != "cpu" and torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init.dist_addr}:{init.dist_port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=config.distributed_timeout_s),
    )
    config = dataclasses.replace(config, num_threads=init.num_threads)
    return Worker(config, init.model_dir, progress=False, stage=(rank, world))


def _serve_stage(conn: Connection, worker: Any) -> None:
    last = worker.stage[0] == worker.stage[1] - 1
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the engine went away (closed or reset): nothing left to do
        message = _to_stage.decode(data)
        if isinstance(message, Step):
            output = worker.execute_model(message.sched)
            if last:
                conn.send_bytes(encode(Result(output)))
        elif isinstance(message, NumBlocks):
            conn.send_bytes(encode(Value(worker.determine_num_kv_blocks())))
        elif isinstance(message, InitKV):
            worker.initialize_kv_cache(message.num_blocks)
            conn.send_bytes(encode(Value(0)))
        elif isinstance(message, Shutdown):
            if worker.runner is not None:
                worker.runner.link.wait_sent()
            return


def start_stage(rank: int, address: tuple[str, int], timeout_s: float) -> subprocess.Popen[bytes]:
    """A stage in a fresh interpreter (``python -m swiftserve.worker.stage_process``): not a
    multiprocessing child, so a daemonic engine process may start it too."""
    args = [
        str(rank),
        address[0],
        str(address[1]),
        str(timeout_s),
        str(logging.getLogger().getEffectiveLevel()),
    ]
    return subprocess.Popen([sys.executable, "-m", "swiftserve.worker.stage_process", *args])


def run_headless(config: EngineConfig) -> int:
    """``swiftserve serve --node-rank k`` (k > 0): run this machine's stages, no engine, no
    API; returns the exit code once they end."""
    address = (config.master_addr, config.master_port + 1)
    procs = [start_stage(rank, address, config.distributed_timeout_s) for rank in stages_on_node(config)]
    return max(abs(p.wait()) for p in procs)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":  # a stage process: RANK HOST PORT TIMEOUT_S LOG_LEVEL
    from swiftserve.worker.stage_process import stage_main as _main  # the package's module, not __main__

    _rank, _host, _port, _timeout, _level = sys.argv[1:6]
    _main(int(_rank), (_host, int(_port)), float(_timeout), int(_level))
