"""A Ray Serve application around our engine and our FastAPI app (``pip install 'swiftserve[ray]'``).

Each Serve replica is a Ray actor holding one engine and the same OpenAI-compatible app the
``swiftserve serve`` command runs (server/app.py), built on the replica by Serve's ASGI
builder; Serve's proxy spreads requests over the replicas, restarts a replica that dies and
autoscales if asked. A fleet of machines joined to one Ray cluster serves one endpoint::

    serve run swiftserve.integrations.ray_serve:app model=/models/smollm num_replicas=2 \\
        max_model_len=2048 num_threads=4

Arguments (``key=value``): any EngineConfig option, any ServerSettings option, and the Serve
ones below. Every response carries ``x-swiftserve-replica`` (the replica's id), so a client
can see which replica answered.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from swiftserve.config import EngineConfig
from swiftserve.server.settings import ServerSettings

# Serve's own options (everything else goes to EngineConfig or ServerSettings)
SERVE_KEYS = ("num_replicas", "autoscaling_config", "num_cpus", "name")


def _field_types(cls: type) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


def _parse(value: Any) -> Any:
    """``key=value`` arguments arrive as text: numbers, booleans, JSON lists/objects."""
    if not isinstance(value, str):
        return value
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return tuple(parsed) if isinstance(parsed, list) else parsed


def split_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(engine options, server settings, serve options); ValueError naming an unknown key."""
    engine_keys, server_keys = _field_types(EngineConfig), _field_types(ServerSettings)
    engine: dict[str, Any] = {}
    server: dict[str, Any] = {}
    serve: dict[str, Any] = {}
    for key, raw in args.items():
        value = _parse(raw)
        if key in SERVE_KEYS:
            serve[key] = value
        elif key in engine_keys:
            engine[key] = value
        elif key in server_keys:
            server[key] = value
        else:
            raise ValueError(f"unknown option {key!r} for the swiftserve Ray Serve app")
    if isinstance(engine.get("model"), (int, float)):
        engine["model"] = str(engine["model"])
    EngineConfig(**engine)  # fail here, in the driver, not in every replica
    return engine, server, serve


def build_asgi_app(engine_options: dict[str, Any], server_options: dict[str, Any]) -> Any:
    """On a replica: start an engine and return our FastAPI app around it."""
    from swiftserve.engine.async_llm import AsyncLLM
    from swiftserve.engine.model_source import resolve_model
    from swiftserve.server.app import create_app

    config = EngineConfig(**{"warm_up": True, **engine_options})  # a server warms up at start
    path = resolve_model(config.model)
    settings = ServerSettings(**server_options)
    settings = dataclasses.replace(
        settings, served_model_name=settings.served_model_name or config.model or "swiftserve-demo"
    )
    app = create_app(AsyncLLM(config, str(path), progress=False), settings)
    replica = _replica_id()

    @app.middleware("http")
    async def tag_replica(request: Any, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers["x-swiftserve-replica"] = replica
        return response

    return app


def _replica_id() -> str:
    try:
        from ray import serve

        context = serve.get_replica_context()
        return f"{context.replica_id.unique_id}:{os.getpid()}"
    except Exception:  # outside a replica (tests of the builder)
        return f"local:{os.getpid()}"


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application for ``args`` (what ``serve run ...:app key=value`` calls)."""
    from ray import serve

    engine, server, opts = split_args(args)

    class SwiftServeReplica:
        """One engine + the OpenAI-compatible app (routes come from the ASGI builder)."""

    def builder() -> Any:  # (Serve tells a builder from an ASGI app by its being a plain function)
        return build_asgi_app(engine, server)

    ingress = serve.ingress(builder)(SwiftServeReplica)
    deployment_options: dict[str, Any] = {
        "name": opts.get("name", "swiftserve"),
        "ray_actor_options": {"num_cpus": float(opts.get("num_cpus", 1))},
    }
    if "autoscaling_config" in opts:
        deployment_options["autoscaling_config"] = opts["autoscaling_config"]
    else:
        deployment_options["num_replicas"] = int(opts.get("num_replicas", 1))
    return serve.deployment(ingress, **deployment_options).bind()  # type: ignore[attr-defined]


app = build_app  # ``serve run swiftserve.integrations.ray_serve:app key=value ...``
