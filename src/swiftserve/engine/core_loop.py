"""The one engine loop: apply commands, step, emit outputs and stats.

The offline ``LLM``, the thread client and the engine process all drive EngineCore through
``CoreLoop``: ``apply`` a command (Add / Abort), ``step`` once, or ``serve`` until Stop. A
command the core cannot apply fails the requests it names (a ``rejected`` output), never the
loop: one hostile message must not take the engine down for everyone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from swiftserve.core.messages import (
    Abort,
    Add,
    Command,
    CoreInfo,
    EngineCoreOutput,
    Stop,
    rejected_output,
)

if TYPE_CHECKING:
    from swiftserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

# recv(block) -> the next command, or None when block is False and nothing is waiting.
Recv = Callable[[bool], Command | None]
EmitOutputs = Callable[[list[EngineCoreOutput], dict[str, Any]], None]


class EngineFault(RuntimeError):
    """Injected by SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER (reliability tests)."""


def _fault_after() -> int | None:
    value = os.environ.get("SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER")
    return int(value) if value else None


def _step_delay() -> float:
    """SWIFTSERVE_INJECT_STEP_DELAY_S: sleep this long after every step (reliability tests that
    need work still in flight after a known time, e.g. the shutdown drain)."""
    return float(os.environ.get("SWIFTSERVE_INJECT_STEP_DELAY_S", "0") or 0)


def core_stats(core: EngineCore) -> dict[str, Any]:
    """Scheduler and cache gauges for /metrics."""
    bm = core.block_manager
    return {
        "num_running": core.scheduler.num_running,
        "num_waiting": core.scheduler.num_waiting,
        "kv_cache_usage": bm.usage,
        "prefix_queries": bm.prefix_queries,
        "prefix_hits": bm.prefix_hits,
        "num_preemptions": core.scheduler.num_preemptions,
        "pipeline_max_in_flight": max(core.max_in_flight, 1),
        **core.scheduler.slo_stats(),
    }


def core_info(core: EngineCore) -> CoreInfo:
    info = core.model_info
    return CoreInfo(
        core.max_model_len,
        core.block_manager.num_blocks,
        core.config.block_size,
        info.vocab_size,
        info.eos_token_ids,
    )


class CoreLoop:
    """EngineCore plus the command handling and fault injection every driver shares."""

    def __init__(self, core: EngineCore):
        self.core = core
        self._fault_after = _fault_after()
        self._step_delay = _step_delay()
        self._steps = 0

    def apply(self, command: Add | Abort) -> list[EngineCoreOutput]:
        """Apply one command; returns ``rejected`` outputs for requests it could not add."""
        if isinstance(command, Abort):
            self.core.abort_requests(command.request_ids, stopped=command.stopped)
            return []
        added: list[str] = []
        for request in command.requests:
            try:
                self.core.add_request(request)
            except Exception as e:  # keep admission all-or-nothing and the loop alive
                logger.warning("request %s rejected by the core: %s", request.request_id, e)
                self.core.abort_requests(added)
                return [rejected_output(r.request_id, str(e)) for r in command.requests]
            added.append(request.request_id)
        return []

    def step(self) -> list[EngineCoreOutput]:
        outputs = self.core.step()
        self._steps += 1
        if self._step_delay:
            time.sleep(self._step_delay)
        if self._fault_after is not None and self._steps >= self._fault_after:
            raise EngineFault("injected engine fault (SWIFTSERVE_INJECT_ENGINE_FAULT_AFTER)")
        return outputs

    def serve(self, recv: Recv, emit: EmitOutputs) -> None:
        """Run until a Stop command: drain every waiting command, then step once."""
        core = self.core
        emit([], core_stats(core))  # the gauges exist from the start, not from the first request
        while True:
            command = recv(not core.has_unfinished())
            rejected: list[EngineCoreOutput] = []
            while command is not None:
                if isinstance(command, Stop):
                    return
                rejected += self.apply(command)
                command = recv(False)
            if rejected:
                emit(rejected, core_stats(core))
            if core.has_unfinished():
                emit(self.step(), core_stats(core))
            elif not rejected:
                emit([], core_stats(core))  # idle: the latest gauges for /metrics


# ---- the wire format of the engine process --------------------------------------------------
_command_decoder = msgspec.msgpack.Decoder(Command)  # type: ignore[arg-type]
encode = msgspec.msgpack.encode


def decode_command(data: bytes) -> tuple[Command | None, list[EngineCoreOutput]]:
    """A command, or (None, rejections) when it does not decode or validate.

    A bad Add (say, a seed the generator cannot take) fails only the requests whose ids can
    still be read from it; anything else unreadable is logged and dropped.
    """
    try:
        return _command_decoder.decode(data), []
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as error:
        reason = f"the engine could not read this request: {error}"
        try:
            raw = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            raw = None
        ids = []
        if isinstance(raw, dict) and raw.get("type") == "add" and isinstance(raw.get("requests"), list):
            ids = [
                r["request_id"]
                for r in raw["requests"]
                if isinstance(r, dict) and isinstance(r.get("request_id"), str)
            ]
        logger.warning("undecodable command (%s); rejecting %d request(s)", error, len(ids))
        return None, [rejected_output(rid, reason) for rid in ids]
