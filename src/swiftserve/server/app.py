"""The FastAPI application: routes, strict validation (400, never 422), auth, body limits."""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swiftserve import __version__
from swiftserve.engine.async_llm import AsyncLLM
from swiftserve.engine.chat_template import load_template
from swiftserve.server.embeddings import EmbeddingRequest, EmbeddingService
from swiftserve.server.errors import APIError, error_body
from swiftserve.server.formatting import ChatFormatter, CompletionFormatter
from swiftserve.server.metrics import ServerMetrics
from swiftserve.server.protocol import ChatCompletionRequest, CompletionRequest
from swiftserve.server.serving import OpenAIServing, to_api_error
from swiftserve.server.settings import ServerSettings
from swiftserve.server.tokenize import add_tokenize_routes
from swiftserve.server.tool_calls import with_tools
from swiftserve.server.web_ui import add_web_routes, public_paths, sampling

logger = logging.getLogger(__name__)


class GuardMiddleware:
    """Pure ASGI, before routing: header size (431), Host/Origin allow-list (403), API key
    (401, constant-time compare) and body size (413, counted as it arrives, chunked or not).

    The body is read here, in full, before the app sees the request: a chunked body over the
    limit is a 413 (the app's own body parser would turn the error into a 400), and the app
    then reads the buffered copy; later receive() calls go to the server (disconnects).
    """

    def __init__(self, app: ASGIApp, settings: ServerSettings):
        self.app = app
        self.settings = settings
        self.allowed_hosts = {h.lower() for h in settings.allowed_hosts or ()}
        self.public_paths = public_paths(not settings.disable_web_ui)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal.response()(scope, receive, send)
        limit = self.settings.max_body_bytes
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived
            body += message.get("body", b"")
            if len(body) > limit:
                return await _too_large(limit)(scope, receive, send)
            if not message.get("more_body", False):
                break
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        raw_headers = scope["headers"]
        size = sum(len(k) + len(v) + 4 for k, v in raw_headers)
        if size > self.settings.max_header_bytes:
            return APIError(
                431,
                f"Request headers exceed {self.settings.max_header_bytes} bytes.",
                code="headers_too_large",
            )
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}
        if self.allowed_hosts and not self._host_allowed(headers):
            return APIError(403, "Host or Origin not allowed.", code="host_not_allowed")
        key = self.settings.api_key
        if key and scope["path"] not in self.public_paths:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return APIError(
                    401, "Invalid or missing API key.", type_="authentication_error", code="invalid_api_key"
                )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.settings.max_body_bytes:
            return _too_large_error(self.settings.max_body_bytes)
        return None

    def _host_allowed(self, headers: dict[str, str]) -> bool:
        """DNS-rebinding guard: the Host (and Origin, when sent) must name an allowed host."""
        host = urlsplit("//" + headers.get("host", "")).hostname or ""
        if host not in self.allowed_hosts:
            return False
        origin = headers.get("origin")
        return origin is None or (urlsplit(origin).hostname or "") in self.allowed_hosts


def _too_large_error(limit: int) -> APIError:
    return APIError(413, f"Request body exceeds {limit} bytes.", code="request_too_large")


def _too_large(limit: int) -> JSONResponse:
    return _too_large_error(limit).response()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def create_app(
    engine: AsyncLLM | None,
    settings: ServerSettings,
    embedder: EmbeddingService | None = None,
    embedding_model_name: str | None = None,
) -> FastAPI:
    """Build the app around a (not yet started) AsyncLLM and/or an embedding service."""
    config = engine.config if engine is not None else None
    metrics = ServerMetrics(
        config.target_ttft_ms / 1000 if config and config.target_ttft_ms else None,
        config.target_tpot_ms / 1000 if config and config.target_tpot_ms else None,
    )
    serving = OpenAIServing(engine, settings, metrics)
    if engine is not None and settings.chat_template:
        engine.tokenizer.chat_template = load_template(settings.chat_template)
    embed_name = embedding_model_name or settings.served_model_name or "swiftserve-embeddings"

    def read_stats() -> tuple[dict[str, Any], dict[str, Any] | None, int]:
        return (
            engine.stats() if engine is not None else {},
            embedder.engine.stats() if embedder is not None else None,
            serving.in_flight,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        if engine is not None:
            await engine.start()
        if embedder is not None:
            await embedder.start()
        async with sampling(metrics.live, read_stats):
            yield
        if embedder is not None:
            await embedder.stop()
        if engine is not None:
            await engine.shutdown()

    app = FastAPI(title="swiftserve", version=__version__, lifespan=lifespan)
    app.state.serving = serving
    app.state.metrics = metrics
    app.add_middleware(GuardMiddleware, settings=settings)  # type: ignore[arg-type]
    _add_error_handlers(app)
    _add_info_routes(app, engine, embedder, serving, settings, embed_name)
    _add_generation_routes(app, engine, serving)
    add_tokenize_routes(app, engine, serving)

    def describe() -> dict[str, Any]:
        return {
            "model": settings.served_model_name if engine is not None else None,
            "embedding_model": embed_name if embedder is not None else None,
        }

    add_web_routes(app, metrics.live, describe, web_ui=not settings.disable_web_ui)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body: 400 for validation, never 422 or a traceback."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return to_api_error(exc).response()


def _add_info_routes(
    app: FastAPI,
    engine: AsyncLLM | None,
    embedder: EmbeddingService | None,
    serving: OpenAIServing,
    settings: ServerSettings,
    embed_name: str,
) -> None:
    """/health, /version, /v1/models, /metrics and /v1/embeddings."""
    metrics: ServerMetrics = app.state.metrics

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        ok = not serving.engine_dead and not serving.draining
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = []
        if engine is not None:
            data.append(
                {
                    "id": settings.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "swiftserve",
                    "max_model_len": engine.max_model_len,
                }
            )
        if embedder is not None:
            data.append(
                {
                    "id": embed_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "swiftserve",
                    "max_model_len": embedder.engine.max_seq_length,
                }
            )
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = engine.stats() if engine is not None else {}
        embed_stats = embedder.engine.stats() if embedder is not None else None
        metrics.sequences_in_flight.set(serving.in_flight)
        return Response(metrics.render(stats, embed_stats), media_type="text/plain; version=0.0.4")

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> Any:
        if embedder is None:
            raise APIError(
                404,
                "This server has no embedding model (use --embedding-model).",
                param="model",
                code="model_not_found",
            )
        if body.model is not None and body.model != embed_name:
            raise APIError(
                404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found"
            )
        if serving.draining:
            raise APIError(503, "The server is shutting down.", type_="server_error", code="draining")
        # msgspec, not FastAPI's encoder: hundreds of floats per input, on the event loop
        return Response(
            msgspec.json.encode(await embedder.embed(body, embed_name)), media_type="application/json"
        )


def _add_generation_routes(app: FastAPI, engine: AsyncLLM | None, serving: OpenAIServing) -> None:
    """/v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        serving.require_engine()
        prompts = _completion_prompts(body.prompt)
        serving.check_limits(body, len(prompts), body.logprobs)
        params = serving.sampling_params(lambda: body.to_sampling_params(serving.engine.default_sampling))
        if body.echo and body.logprobs is not None:  # the prompt's logprobs come back with it
            params = params.replace(prompt_logprobs=body.logprobs)
        await serving.check_structured(params, body.structured_spec()[1])
        ticket = serving.admit(len(prompts) * body.n)
        try:
            processed = await serving.prepare(prompts, params)
        except BaseException:
            ticket.release()
            raise
        return await serving.run(raw, body, processed, params, CompletionFormatter, ticket)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Any:
        serving.require_engine()
        if not body.messages:
            raise APIError(400, "messages: must not be empty", param="messages")
        serving.check_limits(body, 1, body.top_logprobs)
        params = serving.sampling_params(lambda: body.to_sampling_params(serving.engine.default_sampling))
        try:
            tools, params, field = with_tools(body, params, serving.settings)
        except ValueError as e:
            raise to_api_error(e) from e
        await serving.check_structured(params, field)
        conversation = [m.template_dict() for m in body.messages]
        assert engine is not None
        try:  # the character budget, before the template renders anything
            engine.inputs.check_chars(sum(len(m["content"]) for m in conversation))
        except ValueError as e:
            raise to_api_error(e) from e
        template_kwargs = _template_kwargs(body.chat_template_kwargs)
        ticket = serving.admit(body.n)
        try:
            text = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: engine.tokenizer.apply_chat_template(
                    conversation,
                    tokenize=False,
                    add_generation_prompt=body.add_generation_prompt,
                    tools=tools.tools if tools is not None else None,
                    **template_kwargs,
                ),
            )
            processed = await serving.prepare([text], params, add_special_tokens=False)
        except TemplateError as e:  # the conversation breaks the template's rules: the request's fault
            ticket.release()
            raise APIError(400, f"messages: chat template failed: {e}", param="messages") from e
        except BaseException:
            ticket.release()
            raise
        return await serving.run(raw, body, processed, params, ChatFormatter, ticket, tools=tools)


def _completion_prompts(prompt: Any) -> list[Any]:
    """OpenAI's prompt forms: string, list of strings, token ids, list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return list(prompt)


# Names the template receives from us; a request may not replace them.
_RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "add_generation_prompt", "tokenize", "conversation", "chat_template", "tools"}
)


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: extra variables for the chat template."""
    reserved = sorted(_RESERVED_TEMPLATE_NAMES & set(kwargs or {}))
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
            param="chat_template_kwargs",
        )
    return dict(kwargs or {})
