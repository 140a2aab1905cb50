"""/v1/embeddings: every request goes through a DynamicBatcher in front of the encoder."""

from __future__ import annotations

import base64
import struct
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from swiftserve.batching import QueueFull, QueueTimeout
from swiftserve.engine.embedding import EmbeddingEngine
from swiftserve.server.errors import APIError
from swiftserve.server.protocol import _Strict


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    priority: int = Field(default=0, ge=0, le=1)


class EmbeddingService:
    """/v1/embeddings over the engine layer's EmbeddingEngine (started with the app)."""

    def __init__(self, path: str | Path, *, max_inputs: int = 256, **batcher_options: Any):
        self.engine = EmbeddingEngine(path, **batcher_options)
        self.max_inputs = max_inputs

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    def inputs(self, body: EmbeddingRequest) -> list[str | list[int]]:
        raw = body.input
        items: list[str | list[int]]
        if isinstance(raw, str):
            items = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [list(raw)]  # type: ignore[arg-type]
        else:
            items = list(raw)  # type: ignore[arg-type]
        if not items:
            raise APIError(400, "input: must not be empty", param="input")
        if len(items) > self.max_inputs:
            raise APIError(400, f"input: at most {self.max_inputs} inputs per request", param="input")
        vocab = self.engine.vocab_size
        for item in items:
            if isinstance(item, str) and not item:
                raise APIError(400, "input: strings must not be empty", param="input")
            if isinstance(item, list) and (not item or any(not 0 <= t < vocab for t in item)):
                raise APIError(400, f"input: token ids must be non-empty and in [0, {vocab})", param="input")
        return items

    async def embed(self, body: EmbeddingRequest, model_name: str) -> dict[str, Any]:
        import asyncio

        items = self.inputs(body)
        try:
            results = await asyncio.gather(*(self.engine.submit(x, priority=body.priority) for x in items))
        except QueueFull as e:
            raise APIError(
                503,
                "Embedding queue is full; retry later.",
                type_="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            ) from e
        except QueueTimeout as e:
            raise APIError(408, str(e), type_="timeout_error", code="deadline_exceeded") from e
        tokens = sum(count for _, count in results)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _b64(v) if body.encoding_format == "base64" else v,
            }
            for i, (v, _) in enumerate(results)
        ]
        return {
            "object": "list",
            "data": data,
            "model": model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _b64(vector: list[float]) -> str:
    """OpenAI's base64 format: little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
