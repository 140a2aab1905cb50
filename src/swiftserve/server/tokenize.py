"""``/tokenize`` and ``/detokenize`` (also under ``/v1``), in vLLM's request and response shapes."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from jinja2 import TemplateError
from pydantic import Field

from swiftserve.engine.async_llm import AsyncLLM
from swiftserve.server.errors import APIError
from swiftserve.server.protocol import ChatMessage, TokenId, _Strict
from swiftserve.server.serving import OpenAIServing, to_api_error

MAX_DETOKENIZE = 1_000_000


class TokenizeRequest(_Strict):
    """Either ``prompt`` (text) or ``messages`` (rendered by the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE)


def add_tokenize_routes(app: FastAPI, engine: AsyncLLM | None, serving: OpenAIServing) -> None:
    """Register the four paths; each needs the LLM engine's tokenizer (404 on an embeddings-only server)."""

    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        llm = _engine(serving, engine, body.model)
        text, special = await _text_of(llm, body)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(None, lambda: llm.tokenizer.encode(text, add_special_tokens=special))
        out: dict[str, Any] = {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}
        out["token_strs"] = [llm.tokenizer.decode([t]) for t in ids] if body.return_token_strs else None
        return out

    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        llm = _engine(serving, engine, body.model)
        vocab = llm.inputs.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is out of range [0, {vocab})", param="tokens")
        loop = asyncio.get_running_loop()
        return {"prompt": await loop.run_in_executor(None, lambda: llm.tokenizer.decode(body.tokens))}

    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"])
        app.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"])


def _engine(serving: OpenAIServing, engine: AsyncLLM | None, model: str | None) -> AsyncLLM:
    serving.require_engine()
    assert engine is not None
    if model is not None and model != serving.settings.served_model_name:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    return engine


async def _text_of(llm: AsyncLLM, body: TokenizeRequest) -> tuple[str, bool]:
    """(text to tokenize, add special tokens?) for a prompt or a conversation."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    try:
        if body.prompt is not None:
            llm.inputs.check_chars(len(body.prompt))
            return body.prompt, True if body.add_special_tokens is None else body.add_special_tokens
        assert body.messages is not None
        conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        llm.inputs.check_chars(sum(len(m["content"]) for m in conversation))
    except ValueError as e:
        raise to_api_error(e) from e
    try:
        text = await asyncio.get_running_loop().run_in_executor(
            None,
            lambda: llm.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=body.add_generation_prompt
            ),
        )
    except TemplateError as e:
        raise APIError(400, f"messages: chat template failed: {e}", param="messages") from e
    return text, bool(body.add_special_tokens)
