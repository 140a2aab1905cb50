"""Pipeline parallelism, the engine's side: P stage workers, each in its own process.

The engine listens on a control address (``master_addr``, ``master_port`` + 1); every stage
process (started here for this machine's ranks, as Ray actors, or by ``swiftserve serve
--node-rank k`` on another machine) connects to it: worker/stage_process.py. The stages join
one torch.distributed group (gloo on the CPU, NCCL on CUDA), over which only hidden states
travel, stage to stage (worker/pipeline_stage.py). Control messages are msgspec Structs as
bytes, never pickle.

A step goes to every stage at once; each stage runs its steps in the order they came, so up
to P micro-batches are in flight, one per stage, and the last stage's results come back in
the same order (``PipeHandle``). A stage that dies (its process exits, or its connection
closes) fails the engine with a message naming the stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import subprocess
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import msgspec

from swiftserve.config import EngineConfig
from swiftserve.core.messages import RunnerOutput, SchedulerOutput
from swiftserve.model.config import ModelConfig
from swiftserve.worker.executor import Executor
from swiftserve.worker.stage_process import (
    Hello,
    InitKV,
    NumBlocks,
    Result,
    Shutdown,
    StageFailed,
    StageInit,
    StageReady,
    Step,
    Value,
    _from_stage,
    _to_stage_hello,
    authkey,
    encode,
    stage_placement,
    stages_on_node,
    start_stage,
)

logger = logging.getLogger(__name__)


# ---- the engine's side -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """A finished step as EngineCore reads it (the StepResult shape)."""

    output: RunnerOutput
    seconds: float  # since the step was sent, or since the previous result if later
    wakeup_s: float = 0.0


class PipeHandle:
    """A step sent down the pipeline; results come back in the order steps were sent."""

    def __init__(self, executor: PipelineExecutor, sent: float):
        self._executor = executor
        self._sent = sent

    def result(self) -> PipelineResult:
        return self._executor._next_result(self._sent)


class PipelineExecutor(Executor):
    """P pipeline stages in their own processes (this machine's spawned here)."""

    def __init__(self, config: EngineConfig, model_dir: str | Path, *, progress: bool = True):
        self.config = config
        self.depth = world = config.pipeline_parallel_size
        num_layers = ModelConfig.from_dir(model_dir).num_layers
        if world > num_layers:
            raise ValueError(
                f"EngineConfig.pipeline_parallel_size ({world}, --pipeline-parallel-size) is larger "
                f"than the model's {num_layers} layers"
            )
        ray = config.distributed_executor_backend == "ray"
        local = range(world) if ray else stages_on_node(config)  # (Ray places every stage)
        placement = [(None, config.num_threads or 1)] * world if ray else stage_placement(config, local)
        host = config.master_addr
        if ray and host == "127.0.0.1":
            from swiftserve.worker.ray_stages import engine_host

            host = engine_host()  # stages on other machines must reach it
        try:
            self._listener = Listener(
                (host, config.master_port + 1 if config.master_port else 0), authkey=authkey()
            )
        except OSError as e:
            raise ValueError(
                f"cannot listen on --master-addr {host} (port {config.master_port + 1}): {e}"
            ) from e
        address = self._listener.address
        self._ready = False
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._actors: list[Any] = []
        self._conns: list[Connection] = []
        try:
            if ray:
                from swiftserve.worker.ray_stages import start_ray_stages

                self._actors = start_ray_stages(config, address, placement)
            else:
                self._procs = {r: start_stage(r, address, config.distributed_timeout_s) for r in local}
            hellos = self._accept(world)  # rank 0's (host, port)
            dist: tuple[str, int] = (config.master_addr, config.master_port) if config.master_port else hellos
            for rank, conn in enumerate(self._conns):
                cores, threads = placement[rank - local.start] if rank in local else (None, 0)
                path = str(Path(model_dir).resolve())
                init = StageInit(config, path, dist[0], dist[1], cores, threads or config.num_threads or 1)
                conn.send_bytes(encode(init))
            ready = [self._reply(rank, StageReady, timeout=600.0) for rank in range(world)]
        except BaseException:
            self.shutdown()
            raise
        for rank, r in enumerate(ready):
            logger.info("pipeline stage %d: layers %d-%d", rank, r.layers[0], r.layers[1] - 1)
        self.stage_stacks = [r.stack for r in ready]
        info = ready[-1].info
        self.model_info = msgspec.structs.replace(info, weight_bytes=sum(r.info.weight_bytes for r in ready))
        self._ready = True
        self._last_done = 0.0

    def _accept(self, world: int) -> tuple[str, int]:
        """Every stage's connection (into ``self._conns``, by rank), within
        distributed_timeout_s; returns rank 0's (host, free port)."""
        conns: dict[int, Connection] = {}
        hellos: dict[int, Hello] = {}
        listener = self._listener

        def accept() -> None:
            while len(conns) < world:
                try:
                    conn = listener.accept()
                    hello = _to_stage_hello.decode(conn.recv_bytes())
                except (OSError, EOFError, msgspec.DecodeError):
                    return
                conns[hello.rank] = conn
                hellos[hello.rank] = hello

        thread = threading.Thread(target=accept, name="swiftserve-pp-accept", daemon=True)
        thread.start()
        thread.join(self.config.distributed_timeout_s)
        if len(conns) < world:
            self._conns = list(conns.values())  # (closed by shutdown)
            missing = sorted(set(range(world)) - set(conns))
            raise RuntimeError(
                f"pipeline stages {missing} did not connect within {self.config.distributed_timeout_s:g} s "
                f"(distributed_timeout_s); start the other machines with swiftserve serve "
                f"--nnodes {self.config.nnodes} --node-rank K --master-addr {self.config.master_addr} "
                f"--master-port {self.config.master_port}"
            )
        self._listener.close()
        self._conns = [conns[r] for r in range(world)]
        return hellos[0].host, hellos[0].port

    def _reply(self, rank: int, kind: type, timeout: float = float("inf")) -> Any:
        """The next reply of stage ``rank``, checking the other stages while waiting."""
        conn = self._conns[rank]
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            self.check_health()
            if time.monotonic() > deadline:
                raise RuntimeError(f"pipeline stage {rank} did not answer in {timeout:g} s")
        try:
            reply = _from_stage.decode(conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise RuntimeError(f"pipeline stage {rank} is gone") from e
        if isinstance(reply, StageFailed):
            raise RuntimeError(f"pipeline {reply.message}")
        assert isinstance(reply, kind), reply
        return reply

    def check_health(self) -> None:
        for rank, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"pipeline stage {rank} exited with code {proc.returncode}")
        if not self._ready:
            return
        for rank, conn in enumerate(self._conns[:-1]):
            if conn.poll(0):  # earlier stages only ever send a failure, or close
                self._reply(rank, Value)

    def _broadcast(self, message: msgspec.Struct) -> None:
        data = encode(message)
        for conn in self._conns:
            conn.send_bytes(data)

    def determine_num_kv_blocks(self) -> int:
        self._broadcast(NumBlocks())
        return min(self._reply(rank, Value).value for rank in range(self.depth))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(InitKV(num_blocks))
        for rank in range(self.depth):
            self._reply(rank, Value)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.submit_model(scheduler_output).result().output

    def submit_model(self, scheduler_output: SchedulerOutput) -> PipeHandle:  # type: ignore[override]
        self._broadcast(Step(scheduler_output))
        return PipeHandle(self, time.perf_counter())

    def _next_result(self, sent: float) -> PipelineResult:
        output = self._reply(self.depth - 1, Result).output
        now = time.perf_counter()
        # the pipeline's time for this step: from when it was sent or the previous step
        # came back, whichever is later (what the step-cost model should learn)
        seconds = now - max(sent, self._last_done)
        self._last_done = now
        return PipelineResult(output, seconds)

    def shutdown(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):  # (a stage already gone)
                conn.send_bytes(encode(Shutdown()))
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = {}
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._listener.close()
        if self._actors:
            from swiftserve.worker.ray_stages import stop_ray_stages

            stop_ray_stages(self._actors)
            self._actors = []
