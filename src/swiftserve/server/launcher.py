"""``swiftserve serve``: build the engine, run uvicorn, drain on SIGTERM, exit 1 if the engine dies."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any

import uvicorn

from swiftserve.config import EngineConfig
from swiftserve.engine.async_llm import AsyncLLM
from swiftserve.model.encoder import EncoderModel, is_encoder_checkpoint
from swiftserve.server.app import create_app
from swiftserve.server.embeddings import EmbeddingService
from swiftserve.server.http_protocol import OpenAIH11Protocol
from swiftserve.server.serving import ServerSettings

logger = logging.getLogger("swiftserve.server")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="503 + Retry-After once this many requests wait beyond max_num_seqs",
    )
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--max-n", type=int, default=16)
    parser.add_argument("--max-prompts", type=int, default=64)
    parser.add_argument("--max-stop-strings", type=int, default=16)
    parser.add_argument("--max-stop-length", type=int, default=256)
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument(
        "--max-header-bytes", type=int, default=64 * 1024, help="larger header blocks get 431"
    )
    parser.add_argument("--embedding-model", default=None, help="encoder checkpoint for /v1/embeddings")
    parser.add_argument("--embedding-model-name", default=None)
    parser.add_argument(
        "--engine-mode",
        choices=("process", "thread"),
        default="process",
        help="run EngineCore in its own process (default) or in a thread",
    )
    parser.add_argument("--log-level", default="info")


class _DrainingServer(uvicorn.Server):
    """First SIGTERM/SIGINT: refuse new work (503), let in-flight requests finish, then exit."""

    def __init__(self, config: uvicorn.Config, app: Any, shutdown_timeout: float):
        super().__init__(config)
        self.serving = app.state.serving
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._drain_started: float | None = None
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
            done = self.serving.in_flight == 0
            late = time.monotonic() - self._drain_started > self.shutdown_timeout
            if done or late:
                return True
        return await super().on_tick(counter)


def run_server(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    from swiftserve.demo import resolve_model

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig(**engine_options)
    path = resolve_model(config.model)
    settings = ServerSettings(
        served_model_name=args.served_model_name or (config.model or "swiftserve-demo"),
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        max_n=args.max_n,
        max_prompts=args.max_prompts,
        max_stop_strings=args.max_stop_strings,
        max_stop_length=args.max_stop_length,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )
    engine: AsyncLLM | None = None
    embedder: EmbeddingService | None = None
    embedding_name = None
    if is_encoder_checkpoint(path):  # an encoder as --model: an embeddings-only server
        embedder = EmbeddingService(EncoderModel(path))
        embedding_name = settings.served_model_name
    else:
        engine = AsyncLLM(config, str(path), engine_process=args.engine_mode == "process")
    if args.embedding_model:
        embedder = EmbeddingService(EncoderModel(args.embedding_model))
        embedding_name = args.embedding_model_name or Path(args.embedding_model).name
    app = create_app(engine, settings, embedder, embedding_name)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=OpenAIH11Protocol,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=int(args.shutdown_timeout),
        h11_max_incomplete_event_size=args.max_header_bytes,
    )
    server = _DrainingServer(uv_config, app, args.shutdown_timeout)
    url = f"http://{args.host}:{args.port}"
    auth = f' -H "Authorization: Bearer {args.api_key}"' if args.api_key else ""
    print(
        f"\nswiftserve: serving {settings.served_model_name} at {url}/v1\n"
        f"try:\n  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"prompt": "def fib(n):", "max_tokens": 32}}\'\n',
        flush=True,
    )
    asyncio.run(server.serve())
    return server.exit_code
