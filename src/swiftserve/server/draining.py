"""The uvicorn server with swiftserve's shutdown rules: drain on the first signal, end what
is still in flight with a proper error before the timeout, exit 1 after engine death."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import uvicorn

from swiftserve import startup

logger = logging.getLogger("swiftserve.server")


class DrainingServer(uvicorn.Server):
    """First SIGTERM/SIGINT: refuse new work (503), let in-flight requests finish, then exit.

    Work still in flight shortly before ``shutdown_timeout`` is ended with a proper error
    (a JSON 503 body, or an SSE error event and ``[DONE]``), so the process exits within
    the timeout and no client sees a bare connection close.
    """

    FLUSH_S = 1.0  # time left for the error responses to go out before the listener closes

    def __init__(self, config: uvicorn.Config, app: Any, shutdown_timeout: float):
        super().__init__(config)
        self.serving = app.state.serving
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._drain_started: float | None = None
        self._cancelled_at: float | None = None
        self._dead_since: float | None = None
        # After engine death, keep answering (503 on /health, errors elsewhere) this long so
        # that health checks and load balancers see it, then exit non-zero.
        self.death_grace_s = 1.0

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_started is not None:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        logger.info("received %s: draining (timeout %.0fs)", signal.Signals(sig).name, self.shutdown_timeout)
        self.serving.draining = True
        self._drain_started = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if self.serving.engine_dead:
            if self._dead_since is None:
                logger.error("engine died: /health is 503; exiting with status 1")
                self._dead_since = time.monotonic()
            self.exit_code = 1
            return time.monotonic() - self._dead_since >= self.death_grace_s
        if self._drain_started is not None:
            now = time.monotonic()
            if self.serving.in_flight == 0:
                return True
            cancel_at = self._drain_started + max(0.0, self.shutdown_timeout - self.FLUSH_S)
            if self._cancelled_at is None and now >= cancel_at:
                logger.warning(
                    "shutdown timeout: ending %d sequence(s) still in flight", self.serving.in_flight
                )
                self.serving.cancel_all()
                self._cancelled_at = now
            if self._cancelled_at is not None and now - self._cancelled_at >= self.FLUSH_S:
                return True
        return await super().on_tick(counter)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        startup.current().mark("listening")
