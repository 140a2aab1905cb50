"""``swiftserve serve``: build the engine, run uvicorn, drain on SIGTERM, exit 1 if the engine dies."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import uvicorn

from swiftserve.config import EngineConfig
from swiftserve.engine.async_llm import AsyncLLM
from swiftserve.engine.embedding import is_encoder_checkpoint
from swiftserve.engine.model_source import resolve_model
from swiftserve.server.app import create_app
from swiftserve.server.embeddings import EmbeddingService
from swiftserve.server.http_protocol import OpenAIH11Protocol
from swiftserve.server.settings import ServerSettings

logger = logging.getLogger("swiftserve.server")


class _DrainingServer(uvicorn.Server):
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


def run_server(settings: ServerSettings, engine_options: dict[str, Any]) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(**engine_options)
    path = resolve_model(config.model)
    settings = replace(
        settings, served_model_name=settings.served_model_name or config.model or "swiftserve-demo"
    )
    engine: AsyncLLM | None = None
    embedder: EmbeddingService | None = None
    embedding_name = None
    if is_encoder_checkpoint(path):  # an encoder as --model: an embeddings-only server
        embedder = EmbeddingService(path)
        embedding_name = settings.served_model_name
    else:
        engine = AsyncLLM(config, str(path), engine_process=settings.engine_mode == "process")
    if settings.embedding_model:
        embedder = EmbeddingService(settings.embedding_model)
        embedding_name = settings.embedding_model_name or Path(settings.embedding_model).name
    app = create_app(engine, settings, embedder, embedding_name)
    uv_config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http=OpenAIH11Protocol.with_timeouts(settings.header_timeout or None, settings.body_timeout or None),
        timeout_keep_alive=int(max(1, settings.keep_alive_timeout)),
        # the drain above ends every request in time; this only bounds the last flush
        timeout_graceful_shutdown=int(_DrainingServer.FLUSH_S) + 1,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
    server = _DrainingServer(uv_config, app, settings.shutdown_timeout)
    url = f"http://{settings.host}:{settings.port}"
    auth = f' -H "Authorization: Bearer {settings.api_key}"' if settings.api_key else ""
    print(
        f"\nswiftserve: serving {settings.served_model_name} at {url}/v1\n"
        f"try:\n  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"prompt": "def fib(n):", "max_tokens": 32}}\'\n',
        flush=True,
    )
    asyncio.run(server.serve())
    return server.exit_code
