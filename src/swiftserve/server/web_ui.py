"""The web page at ``/`` (chat playground + live dashboard) and its data endpoint ``/v1/stats``.

The page is three static files shipped in the package (``server/web``), read once at start
and served from memory: no build step, no CDN, so it works offline. The page itself holds no
data, so it is served without the API key (it asks for the key and sends it); ``/v1/stats``
and every API route still need the key. The sampler behind ``/v1/stats`` runs once a second
in the server's event loop; see live_stats.py for why polling stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import Response

from swiftserve.server.live_stats import LiveStats

logger = logging.getLogger(__name__)

WEB_DIR = Path(__file__).parent / "web"
_ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}
# Everything the page needs comes from this server; nothing inline, nothing from elsewhere.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def public_paths(web_ui: bool) -> frozenset[str]:
    """Paths served without the API key: the health probe, and the page when it is on."""
    return frozenset({"/health", *(_ASSETS if web_ui else ())})


def add_web_routes(
    app: FastAPI, live: LiveStats, describe: Callable[[], dict[str, Any]], web_ui: bool
) -> None:
    """``GET /v1/stats`` always; the page and its assets unless the web UI is disabled."""

    @app.get("/v1/stats")
    async def stats(since: int = Query(default=0, ge=0)) -> dict[str, Any]:
        return {**live.snapshot(since), **describe()}

    if not web_ui:
        return
    for path, (name, media_type) in _ASSETS.items():
        body = (WEB_DIR / name).read_bytes()

        async def asset(body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers=_HEADERS)

        app.add_api_route(path, asset, methods=["GET"], include_in_schema=False)


async def sample_forever(live: LiveStats, read: Callable[[], tuple[dict[str, Any], Any, int]]) -> None:
    """Take one dashboard sample every ``live.interval_s`` until cancelled.

    ``read`` returns (engine stats, embedder stats or None, sequences in flight); both stats
    are the latest copies the engine and batcher already keep, so a sample costs microseconds.
    """
    while True:
        try:
            engine, embedding, in_flight = read()
            live.sample(engine, embedding, in_flight)
        except Exception:  # a dashboard sample must never take the server down
            logger.exception("dashboard sample failed")
        await asyncio.sleep(live.interval_s)


@contextlib.asynccontextmanager
async def sampling(live: LiveStats, read: Callable[[], tuple[dict[str, Any], Any, int]]):  # type: ignore[no-untyped-def]
    """Run ``sample_forever`` for the lifetime of the app."""
    task = asyncio.create_task(sample_forever(live, read))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
