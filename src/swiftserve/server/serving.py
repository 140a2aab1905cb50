"""Request handling shared by /v1/completions and /v1/chat/completions.

Order of checks, cheapest first: limits and sampling options (400), admission (503 with
Retry-After, before any tokenization), tokenization off the loop, context length (400);
only then is a 200 sent. A client that disconnects aborts its requests at once.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from swiftserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestDeadlineError, ServerShutdownError
from swiftserve.engine.inputs import InvalidRequestError, ProcessedPrompt
from swiftserve.outputs import RequestOutput
from swiftserve.sampling_params import MAX_LOGPROBS, SamplingParams
from swiftserve.server.errors import APIError, bad_request
from swiftserve.server.metrics import ServerMetrics
from swiftserve.server.protocol import _SamplingFields
from swiftserve.server.settings import ServerSettings
from swiftserve.server.tool_calls import ToolRequest

_FIELD = re.compile(r"^(?:SamplingParams\.)?(\w+)")


def to_api_error(error: BaseException) -> APIError:
    """Map engine exceptions to HTTP errors (never a traceback)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return bad_request(str(error), error.param, error.code)
    if isinstance(error, RequestDeadlineError):
        return APIError(
            408,
            f"The request's timeout expired before it finished (queue time included): {error}",
            type_="timeout_error",
            param="timeout",
            code="deadline_exceeded",
        )
    if isinstance(error, ServerShutdownError):
        return APIError(
            503,
            "The server shut down before this request finished.",
            type_="server_error",
            code="shutdown",
            headers={"Retry-After": "5"},
        )
    if isinstance(error, EngineDeadError):
        return APIError(
            500,
            "The engine stopped with an error; this request cannot complete.",
            type_="server_error",
            code="engine_dead",
        )
    if isinstance(error, ValueError):
        match = _FIELD.match(str(error))
        return bad_request(str(error), match.group(1) if match else None)
    return APIError(500, "Internal server error.", type_="server_error")


class Ticket:
    """One admitted HTTP request's seats (one per sequence) in the in-flight count.

    release() is idempotent.
    """

    def __init__(self, serving: OpenAIServing, seats: int):
        self._serving = serving
        self._seats = seats
        serving.in_flight += seats

    def release(self) -> None:
        if self._seats:
            self._serving.in_flight -= self._seats
            self._seats = 0


class OpenAIServing:
    """Validation, admission, generation and response shaping for both endpoints."""

    def __init__(self, engine: AsyncLLM | None, settings: ServerSettings, metrics: ServerMetrics):
        self._engine = engine
        self.settings = settings
        self.metrics = metrics
        self.in_flight = 0
        self.draining = False

    @property
    def engine(self) -> AsyncLLM:
        assert self._engine is not None, "require_engine() first"
        return self._engine

    @property
    def engine_dead(self) -> bool:
        return self._engine is not None and self._engine.is_dead

    def require_engine(self) -> None:
        if self._engine is None:
            raise APIError(
                404,
                "This server serves only embeddings (/v1/embeddings).",
                param="model",
                code="model_not_found",
            )

    # ---- checks --------------------------------------------------------------------------
    def check_limits(self, body: _SamplingFields, num_prompts: int, top_logprobs: int | None) -> None:
        s = self.settings
        if body.n > s.max_n:
            raise bad_request(f"n must be <= {s.max_n}, got {body.n}", "n")
        if (
            body.priority != 0
            and self._engine is not None
            and self._engine.config.scheduling_policy != "priority"
        ):
            # as vLLM: a priority the scheduler would ignore is refused, not silently dropped
            raise bad_request(
                "priority: only the priority scheduling policy uses it (start the server with "
                "--scheduling-policy priority)",
                "priority",
            )
        if num_prompts > s.max_prompts:
            raise bad_request(f"at most {s.max_prompts} prompts per request, got {num_prompts}", "prompt")
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > s.max_stop_strings or any(len(x) > s.max_stop_length for x in stops):
            raise bad_request(
                f"at most {s.max_stop_strings} stop strings of at most {s.max_stop_length} characters",
                "stop",
            )
        if top_logprobs is not None and top_logprobs > MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be <= {MAX_LOGPROBS}", "top_logprobs")
        if body.model is not None and body.model != s.served_model_name:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist.",
                param="model",
                code="model_not_found",
            )

    def sampling_params(self, build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except ValueError as e:
            raise to_api_error(e) from e

    async def check_structured(self, params: SamplingParams, field: str) -> None:
        """A schema, regex or grammar that cannot compile (or admits nothing) is a 400 naming
        ``field``, before admission and any engine work; compiled off the loop, cached."""
        try:
            await self.engine.check_structured(params, field)
        except ValueError as e:
            raise to_api_error(e) from e

    def admit(self, num_sequences: int) -> Ticket:
        """Refuse fast (503 + Retry-After) when draining, dead, or the queue is full.

        Admission counts sequences (prompts x n), not HTTP requests: one request with 64
        prompts and n=16 is 1,024 sequences of work. The seats are taken here, before
        tokenization, so a burst cannot slip past the limit.
        """
        if self.draining:
            raise APIError(
                503,
                "The server is shutting down.",
                type_="server_error",
                code="draining",
                headers={"Retry-After": "5"},
            )
        if self.engine.is_dead:
            raise APIError(503, "The engine is not available.", type_="server_error", code="engine_dead")
        limit = self.settings.max_queued_requests
        capacity = None if limit is None else self.engine.config.max_num_seqs + limit
        if capacity is not None and num_sequences > capacity:
            raise bad_request(
                f"this request has {num_sequences} sequences (prompts x n); the server admits at most "
                f"{capacity} at a time",
                "n",
            )
        if capacity is not None and self.in_flight + num_sequences > capacity:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise APIError(
                503,
                "The server is overloaded; retry later.",
                type_="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        return Ticket(self, num_sequences)

    def cancel_all(self) -> None:
        """End every request in flight with a shutdown error (the drain's deadline)."""
        if self._engine is not None:
            self._engine.fail_all(ServerShutdownError("the server is shutting down"))

    async def prepare(
        self, prompts: list[Any], params: SamplingParams, add_special_tokens: bool = True
    ) -> list[ProcessedPrompt]:
        processed = []
        for prompt in prompts:
            try:
                p = await self.engine.process_prompt(prompt, add_special_tokens)
                max_tokens = self.engine.inputs.max_tokens(len(p.token_ids), params)
                self.engine.check_fits("request", len(p.token_ids) + max_tokens)
            except ValueError as e:
                raise to_api_error(e) from e
            processed.append(p)
        return processed

    # ---- generation ----------------------------------------------------------------------
    async def run(
        self,
        raw: Request,
        body: _SamplingFields,
        prompts: list[ProcessedPrompt],
        params: SamplingParams,
        formatter: Any,
        ticket: Ticket,
        tools: ToolRequest | None = None,
    ) -> Any:
        """Generate for every prompt; stream SSE chunks or return one JSON body.

        Takes ownership of ``ticket`` and releases it when the response is complete.
        """
        request_id = f"{formatter.id_prefix}-{uuid.uuid4().hex}"
        arrival = time.monotonic()
        deadline = arrival + body.timeout if body.timeout is not None else None
        fmt = formatter(request_id, int(time.time()), self.settings.served_model_name, params, self.metrics)
        if tools is not None:
            fmt.tools = tools
        outputs = self._merged(prompts, params, request_id, body.priority, deadline, arrival, body.cache_salt)
        if getattr(body, "echo", False):
            tokenizer = self.engine.tokenizer
            fmt.echo = [p.prompt if p.prompt is not None else tokenizer.decode(p.token_ids) for p in prompts]
            fmt.decode = tokenizer.decode
        fmt.continuous_usage = bool(
            body.stream_options
            and body.stream_options.include_usage
            and body.stream_options.continuous_usage_stats
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._sse(outputs, fmt, include_usage, ticket),
                media_type="text/event-stream",
                background=BackgroundTask(ticket.release),
            )
        try:
            return await self._collect_or_disconnect(raw, outputs, fmt)
        finally:
            ticket.release()

    async def _merged(
        self,
        prompts: list[ProcessedPrompt],
        params: SamplingParams,
        request_id: str,
        priority: int,
        deadline: float | None,
        arrival: float,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Outputs of all prompts as (prompt index, output), in arrival order."""
        gens = [
            self.engine.generate(
                p,
                params,
                f"{request_id}-{i}",
                priority=priority,
                deadline=deadline,
                arrival_time=arrival,
                cache_salt=cache_salt,
            )
            for i, p in enumerate(prompts)
        ]
        if len(gens) == 1:
            try:
                async for out in gens[0]:
                    yield 0, out
            finally:
                await gens[0].aclose()
            return
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in gen:
                    queue.put_nowait((i, out))
                queue.put_nowait(None)
            except Exception as e:  # forwarded to the consumer
                queue.put_nowait(e)

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect_or_disconnect(
        self, raw: Request, outputs: AsyncIterator[tuple[int, RequestOutput]], fmt: Any
    ) -> Any:
        async def collect() -> Any:
            async for index, out in outputs:
                fmt.add(index, out)
            return fmt.final()

        async def disconnected() -> None:
            while True:
                message = await raw.receive()
                if message["type"] == "http.disconnect":
                    return

        work = asyncio.create_task(collect())
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():  # the client left: cancelling aborts every engine request
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return JSONResponse({}, status_code=499)
        try:
            body = work.result()
        except Exception as e:
            return to_api_error(e).response()
        self._observe(fmt)
        return JSONResponse(body)

    async def _sse(
        self,
        outputs: AsyncGenerator[tuple[int, RequestOutput], None],
        fmt: Any,
        include_usage: bool,
        ticket: Ticket,
    ) -> AsyncIterator[str]:
        try:
            async for index, out in outputs:
                for chunk in fmt.chunks(index, out):
                    yield f"data: {chunk}\n\n"
            if include_usage:
                yield f"data: {fmt.usage_chunk()}\n\n"
            self._observe(fmt)
        except Exception as e:  # after the 200: report in-band, then end the stream
            import json

            yield f"data: {json.dumps(to_api_error(e).body())}\n\n"
        finally:
            ticket.release()
            await outputs.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    def _observe(self, fmt: Any) -> None:
        self.metrics.observe_finished(
            fmt.last_metrics, fmt.finish_reasons(), fmt.prompt_tokens, fmt.completion_tokens
        )
