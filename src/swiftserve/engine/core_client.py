"""Run the engine loop off the event loop: in a background thread, or in its own process.

Both clients take the same commands (core/messages.py: Add, Abort) and deliver the same
output batches through an ``emit`` callback; AsyncLLM does not know which one it talks to.
Both drive the one loop of engine/core_loop.py. The process client speaks msgspec-encoded
Structs over a pipe (never pickle), so the engine's Python work does not compete with the
HTTP event loop for the GIL.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from swiftserve import startup
from swiftserve.config import EngineConfig
from swiftserve.core.messages import (
    Abort,
    Add,
    Command,
    CoreInfo,
    EngineCoreOutput,
    Failed,
    Outputs,
    Ready,
    Reply,
    Stop,
)
from swiftserve.engine.core_loop import CoreLoop, core_info, decode_command, encode

if TYPE_CHECKING:
    from swiftserve.engine.dp_client import DataParallelCoreClient

logger = logging.getLogger(__name__)
Emit = Callable[[list[EngineCoreOutput] | BaseException], None]


class ThreadCoreClient:
    """The engine loop in a daemon thread of this process."""

    def __init__(self, config: EngineConfig, model_path: str, progress: bool = True):
        from swiftserve.engine.core import EngineCore  # torch: only in the process that runs it

        self.loop = CoreLoop(EngineCore(config, model_path, progress=progress))
        self.info = core_info(self.loop.core)
        self.error: BaseException | None = None
        self._commands: queue.Queue[Command] = queue.Queue()
        self._stats: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="swiftserve-engine", daemon=True)
        self._emit: Emit = lambda _: None

    def wait_ready(self) -> CoreInfo:
        return self.info  # built in the constructor

    def start(self, emit: Emit) -> None:
        self._emit = emit
        self._thread.start()

    def send(self, command: Add | Abort) -> None:
        self._commands.put(command)

    def stop(self) -> None:
        self._commands.put(Stop())
        self._thread.join(timeout=30)

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def _recv(self, block: bool) -> Command | None:
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def _deliver(self, outputs: list[EngineCoreOutput], stats: dict[str, Any]) -> None:
        self._stats = stats
        if outputs:
            self._emit(outputs)

    def _run(self) -> None:
        try:
            self.loop.serve(self._recv, self._deliver)
        except BaseException as e:  # the engine is dead: tell the frontend
            logger.exception("engine thread died")
            self.error = e
            self._emit(e)


# ---- process mode --------------------------------------------------------------------------
_reply_decoder = msgspec.msgpack.Decoder(Reply)  # type: ignore[arg-type]


def _engine_process_main(
    config_bytes: bytes, model_path: str, conn: Any, log_level: int, anchor: float
) -> None:
    """Entry point of the engine process: build the core, then serve the pipe.

    ``anchor``: the server's start (epoch seconds), so both processes' start-up timelines
    share one clock.
    """
    # A spawned process starts with no logging set up: keep the server's level and format
    # (the kernel backend and KV sizing are logged from here).
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    timeline = startup.Timeline("engine", anchor)
    startup.set_current(timeline)
    timeline.record("interpreter start", (startup.process_start_epoch() - anchor) * 1000.0)
    config = msgspec.convert(msgspec.msgpack.decode(config_bytes), EngineConfig)
    if config.cpu_affinity:  # a data-parallel replica: its own cores, before torch sizes its pools
        os.sched_setaffinity(0, set(config.cpu_affinity))
    with timeline.phase("import torch"):
        import torch  # noqa: F401 (timed on its own: it is most of a cold start)

        from swiftserve.engine.core import EngineCore
    loop = CoreLoop(EngineCore(config, model_path, progress=False))
    startup.freeze_heap()
    conn.send_bytes(encode(Ready(core_info(loop.core))))
    timeline.mark("ready")

    def recv(block: bool) -> Command | None:
        while block or conn.poll(0):
            while block and not conn.poll(1.0):  # idle: a dead pipeline stage must not wait for work
                loop.core.executor.check_health()
            command, rejected = decode_command(conn.recv_bytes())
            if rejected:
                conn.send_bytes(encode(Outputs(rejected, {})))
            if command is not None:
                return command
        return None

    def emit(outputs: list[EngineCoreOutput], stats: dict[str, Any]) -> None:
        conn.send_bytes(encode(Outputs(outputs, stats)))

    try:
        loop.serve(recv, emit)
    except (EOFError, BrokenPipeError):
        return  # the frontend went away
    except BaseException as e:
        logger.exception("engine process died")
        try:
            conn.send_bytes(encode(Failed(repr(e))))
        finally:
            os._exit(1)


def _start_method() -> str:
    """ "fork" while this process is still a bare interpreter (one thread, no torch), as the
    server is when it starts its engine: the child skips a fresh interpreter and the
    re-import of the parent's modules (~0.3 s of cold start). Anywhere else "spawn", the
    only safe choice once threads or torch's thread pools exist (vLLM makes the same call)."""
    bare = threading.active_count() == 1 and "torch" not in sys.modules
    return "fork" if bare and sys.platform == "linux" else "spawn"


class ProcessCoreClient:
    """The engine loop in a spawned process; a reader thread turns its replies into emits.

    The constructor only spawns the process (so the caller's own start-up work overlaps the
    engine's); ``wait_ready`` blocks until the engine has loaded the model.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        progress: bool = True,
        startup_timeout_s: float = 600.0,
        name: str = "swiftserve-engine",
    ):
        ctx = multiprocessing.get_context(_start_method())
        self._conn, child = ctx.Pipe(duplex=True)
        args = (
            encode(config),
            str(Path(model_path)),
            child,
            logging.getLogger().getEffectiveLevel(),
            startup.current().anchor,
        )
        self._proc = ctx.Process(  # type: ignore[attr-defined]
            target=_engine_process_main, args=args, name=name, daemon=True
        )
        self._proc.start()
        child.close()
        self._startup_timeout_s = startup_timeout_s
        self._info: CoreInfo | None = None
        self.error: BaseException | None = None
        self._stats: dict[str, Any] = {}
        self.stats_version = 0  # bumped by every stats update (the data-parallel router reads it)
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="swiftserve-engine-reader", daemon=True)
        self._emit: Emit = lambda _: None

    @property
    def info(self) -> CoreInfo:
        return self.wait_ready()

    def wait_ready(self) -> CoreInfo:
        """Block until the engine process reports Ready (RuntimeError if it fails)."""
        if self._info is not None:
            return self._info
        if not self._conn.poll(self._startup_timeout_s):
            self._proc.kill()
            raise RuntimeError("engine process did not start in time")
        try:
            reply = _reply_decoder.decode(self._conn.recv_bytes())
        except EOFError as e:
            self._proc.join(timeout=5)
            raise RuntimeError(f"engine process failed to start (exit code {self._proc.exitcode})") from e
        if not isinstance(reply, Ready):
            raise RuntimeError(f"engine process failed to start: {reply}")
        self._info = reply.info
        return self._info

    def start(self, emit: Emit) -> None:
        self._emit = emit
        self._reader.start()

    def send(self, command: Add | Abort) -> None:
        """Encode and send; raises (ValueError, TypeError...) if the command cannot be encoded."""
        message = encode(command)
        try:
            with self._send_lock:
                self._conn.send_bytes(message)
        except (BrokenPipeError, OSError) as e:
            self._die(e)

    def stop(self) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(encode(Stop()))
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def _die(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self._emit(error)

    def _read(self) -> None:
        while True:
            try:
                reply = _reply_decoder.decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                if self.error is None and self._proc.exitcode not in (0, None):
                    self._die(RuntimeError(f"engine process exited with code {self._proc.exitcode}"))
                elif self.error is None:
                    self._proc.join(timeout=5)
                    if self._proc.exitcode != 0:
                        self._die(RuntimeError("engine process stopped unexpectedly"))
                return
            if isinstance(reply, Outputs):
                if reply.stats:
                    self._stats = reply.stats
                    self.stats_version += 1
                if reply.outputs:
                    self._emit(reply.outputs)
            elif isinstance(reply, Failed):
                self._die(RuntimeError(f"engine process died: {reply.message}"))


def start_core_client(
    config: EngineConfig, model_path: str, progress: bool = True, engine_process: bool = False
) -> ThreadCoreClient | ProcessCoreClient | DataParallelCoreClient:
    """Start the engine: a spawned process returns at once (``wait_ready`` later), a thread
    client builds the core before returning; ``data_parallel_size`` > 1 starts that many
    engine processes behind one router (engine/dp_client.py)."""
    if config.data_parallel_size > 1:
        if not engine_process:
            raise ValueError(
                "data_parallel_size > 1 needs the engine in its own processes (--engine-mode process)"
            )
        from swiftserve.engine.dp_client import DataParallelCoreClient

        return DataParallelCoreClient(config, model_path, progress)
    if engine_process:
        return ProcessCoreClient(config, model_path, progress)
    return ThreadCoreClient(config, model_path, progress)
