"""Run EngineCore off the event loop: in a background thread, or in its own process.

Both clients take the same commands (add / abort) and deliver the same output batches
through an ``emit`` callback; AsyncLLM does not know which one it talks to. The process
client speaks msgspec-encoded messages over a pipe (never pickle), so the engine's Python
work no longer competes with the HTTP event loop for the GIL.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from swiftserve.config import EngineConfig
from swiftserve.core.messages import EngineCoreOutput
from swiftserve.engine.core import EngineCore, EngineCoreRequest

logger = logging.getLogger(__name__)
Emit = Callable[[list[EngineCoreOutput] | BaseException], None]


@dataclass(frozen=True)
class CoreInfo:
    """What the frontend must know about the engine to validate requests."""

    max_model_len: int
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class Add:
    requests: list[EngineCoreRequest]


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]
    stopped: bool = False


class EngineFault(RuntimeError):
    """Injected by SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER (reliability tests)."""


def _fault_after() -> int | None:
    value = os.environ.get("SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER")
    return int(value) if value else None


def _apply(core: EngineCore, command: Add | Abort) -> None:
    if isinstance(command, Add):
        for i, request in enumerate(command.requests):
            try:
                core.add_request(request)
            except ValueError:  # the frontend checks first; keep admission all-or-nothing
                logger.exception("request rejected by the core")
                core.abort_requests([r.request_id for r in command.requests[:i]])
                return
    else:
        core.abort_requests(command.request_ids, stopped=command.stopped)


def core_stats(core: EngineCore) -> dict[str, Any]:
    bm = core.block_manager
    return {
        "num_running": core.scheduler.num_running,
        "num_waiting": core.scheduler.num_waiting,
        "kv_cache_usage": bm.usage,
        "prefix_queries": bm.prefix_queries,
        "prefix_hits": bm.prefix_hits,
        "num_preemptions": core.scheduler.num_preemptions,
    }


class ThreadCoreClient:
    """EngineCore stepped by a daemon thread of this process."""

    def __init__(self, config: EngineConfig, model_path: str, progress: bool = True):
        self.core = EngineCore(config, model_path, progress=progress)
        self.info = CoreInfo(self.core.max_model_len, self.core.block_manager.num_blocks, config.block_size)
        self.error: BaseException | None = None
        self._commands: queue.Queue[Add | Abort | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="swiftserve-engine", daemon=True)
        self._emit: Emit = lambda _: None

    def start(self, emit: Emit) -> None:
        self._emit = emit
        self._thread.start()

    def send(self, command: Add | Abort) -> None:
        self._commands.put(command)

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return core_stats(self.core)

    def _run(self) -> None:
        fault, steps = _fault_after(), 0
        try:
            while True:
                try:
                    command = self._commands.get(block=not self.core.has_unfinished())
                    while True:
                        if command is None:
                            return
                        with self._lock:
                            _apply(self.core, command)
                        command = self._commands.get_nowait()
                except queue.Empty:
                    pass
                if self.core.has_unfinished():
                    with self._lock:
                        outputs = self.core.step()
                    steps += 1
                    if fault is not None and steps >= fault:
                        raise EngineFault("injected engine fault (SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER)")
                    self._emit(outputs)
        except BaseException as e:  # the engine is dead: tell the frontend
            logger.exception("engine thread died")
            self.error = e
            self._emit(e)


# ---- process mode --------------------------------------------------------------------------
_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


def _engine_process_main(config_bytes: bytes, model_path: str, conn: Any) -> None:
    """Entry point of the engine process: build the core, then loop on commands and steps."""
    config = msgspec.convert(_decode(config_bytes), EngineConfig)
    core = EngineCore(config, model_path, progress=False)
    info = [core.max_model_len, core.block_manager.num_blocks, config.block_size]
    conn.send_bytes(_encode(("ready", info)))
    fault, steps = _fault_after(), 0
    try:
        while True:
            if not core.has_unfinished() or conn.poll(0):
                while True:
                    kind, *payload = _decode(conn.recv_bytes())
                    if kind == "stop":
                        return
                    if kind == "add":
                        _apply(core, Add(msgspec.convert(payload[0], list[EngineCoreRequest])))
                    else:
                        _apply(core, Abort(payload[0], payload[1]))
                    if not conn.poll(0):
                        break
                if not core.has_unfinished():
                    conn.send_bytes(_encode(("stats", core_stats(core))))
                    continue
            outputs = core.step()
            steps += 1
            if fault is not None and steps >= fault:
                raise EngineFault("injected engine fault (SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER)")
            conn.send_bytes(_encode(("out", outputs, core_stats(core))))
    except (EOFError, BrokenPipeError):
        return  # the frontend went away
    except BaseException as e:
        logger.exception("engine process died")
        try:
            conn.send_bytes(_encode(("error", repr(e))))
        finally:
            os._exit(1)


class ProcessCoreClient:
    """EngineCore in a spawned process; a reader thread turns its messages into emits."""

    def __init__(
        self, config: EngineConfig, model_path: str, progress: bool = True, startup_timeout_s: float = 600.0
    ):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_engine_process_main,
            args=(_encode(config), str(Path(model_path)), child),
            name="swiftserve-engine",
            daemon=True,
        )
        self._proc.start()
        child.close()
        if not self._conn.poll(startup_timeout_s):
            self._proc.kill()
            raise RuntimeError("engine process did not start in time")
        try:
            kind, payload = _decode(self._conn.recv_bytes())
        except EOFError as e:
            raise RuntimeError(f"engine process failed to start (exit code {self._proc.exitcode})") from e
        if kind != "ready":
            raise RuntimeError(f"engine process failed to start: {payload}")
        self.info = CoreInfo(*payload)
        self.error: BaseException | None = None
        self._stats: dict[str, Any] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="swiftserve-engine-reader", daemon=True)
        self._emit: Emit = lambda _: None

    def start(self, emit: Emit) -> None:
        self._emit = emit
        self._reader.start()

    def send(self, command: Add | Abort) -> None:
        if isinstance(command, Add):
            message = _encode(("add", command.requests))
        else:
            message = _encode(("abort", command.request_ids, command.stopped))
        try:
            with self._send_lock:
                self._conn.send_bytes(message)
        except (BrokenPipeError, OSError) as e:
            self._die(e)

    def stop(self) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(_encode(("stop",)))
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
                kind, *payload = _decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                if self.error is None and self._proc.exitcode not in (0, None):
                    self._die(RuntimeError(f"engine process exited with code {self._proc.exitcode}"))
                elif self.error is None:
                    self._proc.join(timeout=5)
                    if self._proc.exitcode != 0:
                        self._die(RuntimeError("engine process stopped unexpectedly"))
                return
            if kind == "out":
                self._stats = payload[1]
                self._emit(msgspec.convert(payload[0], list[EngineCoreOutput]))
            elif kind == "stats":
                self._stats = payload[0]
            elif kind == "error":
                self._die(RuntimeError(f"engine process died: {payload[0]}"))
