"""``swiftserve serve``: build the engine, run uvicorn, drain on SIGTERM, exit 1 if the engine dies.

Start-up order is chosen for cold start: the engine process is spawned before the HTTP stack
is even imported, so its torch import and model load overlap everything the frontend does.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swiftserve import startup
from swiftserve.config import EngineConfig
from swiftserve.engine.core_client import start_core_client
from swiftserve.engine.model_source import is_encoder_checkpoint, resolve_model
from swiftserve.server.settings import ServerSettings

if TYPE_CHECKING:
    from swiftserve.engine.async_llm import AsyncLLM
    from swiftserve.server.embeddings import EmbeddingService


def run_server(settings: ServerSettings, engine_options: dict[str, Any]) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    timeline = startup.Timeline("server")
    startup.set_current(timeline)
    timeline.mark("command line parsed")
    config = EngineConfig(**{"warm_up": True, **engine_options})  # a server warms up at start
    path = resolve_model(config.model)
    settings = replace(
        settings, served_model_name=settings.served_model_name or config.model or "swiftserve-demo"
    )
    encoder = is_encoder_checkpoint(path)
    client = None
    if not encoder:  # start the engine first: its torch import and model load are the long pole
        with timeline.phase("spawn engine"):
            client = start_core_client(config, str(path), engine_process=settings.engine_mode == "process")
    with timeline.phase("import HTTP stack"):  # overlaps the engine process's start-up
        import uvicorn

        from swiftserve.engine.async_llm import AsyncLLM
        from swiftserve.server.app import create_app
        from swiftserve.server.draining import DrainingServer
        from swiftserve.server.embeddings import EmbeddingService
        from swiftserve.server.http_protocol import OpenAIH11Protocol
    engine: AsyncLLM | None = None
    embedder: EmbeddingService | None = None
    embedding_name = None
    if encoder:  # an encoder as --model: an embeddings-only server
        embedder = EmbeddingService(path, **_embedding_options(settings))
        embedding_name = settings.served_model_name
    else:
        engine = AsyncLLM(config, str(path), client=client)
    if settings.embedding_model:
        embedder = EmbeddingService(
            settings.embedding_model,
            # an LLM engine in this process (engine_mode thread) keeps torch's thread count
            set_threads=settings.engine_mode == "process",
            **_embedding_options(settings),
        )
        embedding_name = settings.embedding_model_name or Path(settings.embedding_model).name
    app = create_app(engine, settings, embedder, embedding_name)
    uv_config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http=OpenAIH11Protocol.with_timeouts(settings.header_timeout or None, settings.body_timeout or None),
        timeout_keep_alive=int(max(1, settings.keep_alive_timeout)),
        # the drain ends every request in time; this only bounds the last flush
        timeout_graceful_shutdown=int(DrainingServer.FLUSH_S) + 1,
        h11_max_incomplete_event_size=settings.max_header_bytes,
    )
    server = DrainingServer(uv_config, app, settings.shutdown_timeout)
    url = f"http://{settings.host}:{settings.port}"
    auth = f' -H "Authorization: Bearer {settings.api_key}"' if settings.api_key else ""
    print(
        f"\nswiftserve: serving {settings.served_model_name} at {url}/v1\n"
        + ("" if settings.disable_web_ui else f"chat page and live dashboard: {url}/\n")
        + f"try:\n  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"prompt": "def fib(n):", "max_tokens": 32}}\'\n',
        flush=True,
    )
    startup.freeze_heap()
    asyncio.run(server.serve())
    return server.exit_code


def _embedding_options(settings: ServerSettings) -> dict[str, Any]:
    """Batcher options from the serve flags: side-by-side workers, and --max-queued-requests
    as the embedding queue's bound (past it: 503 + Retry-After before latency runs away)."""
    options: dict[str, Any] = {"workers": settings.embedding_workers}
    if settings.max_queued_requests is not None:
        options["max_queue_size"] = max(1, settings.max_queued_requests)
    return options
