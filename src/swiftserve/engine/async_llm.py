"""AsyncLLM: an asyncio front over EngineCore, which runs in its own process or a thread.

The boundary is two plain message streams (engine/core_client.py): commands (add / abort)
go to the engine; lists of EngineCoreOutput come back to the event loop through
``call_soon_threadsafe``. One output-handler task detokenizes them and feeds per-request
asyncio queues. Tokenization runs in a thread pool so a 1 MB prompt never blocks the loop.
If the engine thread dies, every in-flight request gets the error and ``is_dead`` turns on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from swiftserve import startup
from swiftserve.config import EngineConfig
from swiftserve.core.block_manager import fits_in_kv_pool
from swiftserve.core.messages import FINISH_DEADLINE, FINISH_REJECTED, Abort, Add, EngineCoreOutput
from swiftserve.engine.core_client import ProcessCoreClient, ThreadCoreClient, start_core_client
from swiftserve.engine.frontend import Frontend
from swiftserve.engine.inputs import InvalidRequestError, ProcessedPrompt, Prompt
from swiftserve.engine.tokenizer import load_tokenizer
from swiftserve.outputs import RequestOutput
from swiftserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
LARGE_PROMPT_CHARS = 32_768  # prompts longer than this tokenize on their own lane

if TYPE_CHECKING:
    from swiftserve.engine.dp_client import DataParallelCoreClient


class EngineDeadError(RuntimeError):
    """The engine thread stopped with an error; no request can complete."""


class RequestDeadlineError(RuntimeError):
    """A request's deadline (queue time included) passed before it finished."""


class ServerShutdownError(RuntimeError):
    """The server is shutting down and ended the request before it finished."""


class AsyncLLM:
    """Async generation: ``async for out in engine.generate(prompt, params, request_id)``."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        *,
        progress: bool = True,
        engine_process: bool = False,
        client: ThreadCoreClient | ProcessCoreClient | DataParallelCoreClient | None = None,
    ):
        """``client``: an engine already being started (see ``start_core_client``)."""
        self.config = config
        # The core runs in its own process (msgspec over a pipe) or in a thread of this one.
        self.client = client or start_core_client(config, model_path, progress, engine_process)
        timeline = startup.current()
        with timeline.phase("tokenizer"):  # while the engine process loads the model
            self.tokenizer = load_tokenizer(config.tokenizer or model_path, config.tokenizer_mode)
        with timeline.phase("wait for engine"):
            info = self.client.wait_ready()
        self.frontend = Frontend(self.tokenizer, model_path, info)
        self.max_model_len = self.frontend.max_model_len
        self.inputs = self.frontend.inputs
        self.processor = self.frontend.processor
        self.default_sampling = self.frontend.default_sampling
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # Two lanes: long prompts tokenize one at a time on their own thread, so that a few
        # big ones can never occupy every worker while two-token requests wait behind them.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self._tokenize_large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-large")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self.dead_callbacks: list[Callable[[BaseException], None]] = []

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.client.start(self._emit_threadsafe)
        self._started = True

    async def shutdown(self) -> None:
        if self._started:
            await asyncio.get_running_loop().run_in_executor(None, self.client.stop)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._tokenize_large.shutdown(wait=False, cancel_futures=True)

    @property
    def is_dead(self) -> bool:
        return self.client.error is not None

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    def _emit_threadsafe(self, item: list[EngineCoreOutput] | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._handle, item)

    # ---- output handling (on the event loop) ---------------------------------------------
    def _handle(self, item: list[EngineCoreOutput] | BaseException) -> None:
        if isinstance(item, BaseException):
            if self.is_dead:
                error = EngineDeadError(f"engine died: {item!r}")
                for q in self._queues.values():
                    q.put_nowait(error)
                for callback in self.dead_callbacks:
                    callback(error)
            return
        for out in item:
            if out.finish_reason in (FINISH_REJECTED, FINISH_DEADLINE):  # fail that request alone
                parent = self.processor.parent_of(out.request_id)
                rq = self._queues.get(parent) if parent is not None else None
                if rq is not None:
                    rq.put_nowait(
                        InvalidRequestError(f"rejected by the engine: {out.stop_reason}")
                        if out.finish_reason == FINISH_REJECTED
                        else RequestDeadlineError(f"deadline exceeded: {out.stop_reason}")
                    )
        touched, stopped = self.processor.process(item)
        if stopped:
            self.client.send(Abort(stopped, stopped=True))
        for state in touched:
            rq = self._queues.get(state.request_id)
            if rq is not None:
                rq.put_nowait(self.processor.to_request_output(state, delta=True))

    # ---- requests ------------------------------------------------------------------------
    async def process_prompt(self, prompt: Prompt, add_special_tokens: bool = True) -> ProcessedPrompt:
        """Tokenize and validate off the event loop (text over the character budget: refused at once)."""
        if isinstance(prompt, str):
            self.inputs.check_chars(len(prompt))
        large = isinstance(prompt, str) and len(prompt) > LARGE_PROMPT_CHARS
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize_large if large else self._tokenize_pool,
            lambda: self.inputs.process(prompt, add_special_tokens=add_special_tokens),
        )

    async def check_structured(self, params: SamplingParams, field: str = "structured_outputs") -> None:
        """Compile the request's grammar off the event loop; InvalidRequestError if it is bad."""
        if params.structured_outputs is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._tokenize_pool, self.frontend.check_structured, params, field)

    async def generate(
        self,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        deadline: float | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield incremental outputs (``text`` holds only the new text of each step).

        ``deadline`` is an absolute time.monotonic() value; the core serves it earliest
        deadline first and fails it early when it cannot make it; past it the request is
        aborted here too; either way RequestDeadlineError is raised. Cancelling the
        consumer aborts the request.
        """
        if self.is_dead or not self._started:
            raise EngineDeadError("engine is not running")
        processed = prompt if isinstance(prompt, ProcessedPrompt) else await self.process_prompt(prompt)
        max_tokens = self.inputs.max_tokens(len(processed.token_ids), params)
        self.check_fits(request_id, len(processed.token_ids) + max_tokens)
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = q
        finished = False
        # Everything from here on is undone in the finally, whatever step fails (an encode
        # error once leaked the queue and the processor state of every such request).
        try:
            arrival = arrival_time if arrival_time is not None else time.monotonic()
            requests = self.frontend.add_request(
                request_id, processed, params, max_tokens, priority, arrival, deadline, cache_salt
            )
            self.client.send(Add(requests))
            while True:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    raise RequestDeadlineError("request deadline exceeded")
                try:
                    item = await asyncio.wait_for(q.get(), timeout)
                except TimeoutError:
                    raise RequestDeadlineError("request deadline exceeded") from None
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)
            self.processor.pop(request_id)

    def _abort_now(self, request_id: str) -> None:
        children = self.processor.abort(request_id)
        if children and self._started and not self.is_dead:
            self.client.send(Abort(children))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its generator finishes with finish_reason "abort"."""
        state = self.processor.requests.get(request_id)
        self._abort_now(request_id)
        q = self._queues.get(request_id)
        if state is not None and q is not None:
            q.put_nowait(self.processor.to_request_output(state, delta=True))

    def fail_all(self, error: BaseException) -> None:
        """End every unfinished request with ``error`` (their generators raise it and abort)."""
        for q in self._queues.values():
            q.put_nowait(error)

    def check_fits(self, request_id: str, num_tokens: int) -> None:
        """ValueError if a request of num_tokens could never fit in the engine's KV pool."""
        info = self.client.info
        fits_in_kv_pool(request_id, num_tokens, info.max_model_len, info.num_blocks, info.block_size)

    def stats(self) -> dict[str, Any]:
        """Scheduler and cache state for /metrics (the latest the engine reported)."""
        if not self._started:
            return {}
        stats = self.client.stats()
        return {**stats, "frontend_requests": len(self.processor.requests)} if stats else {}
