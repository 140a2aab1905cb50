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
from typing import Any

from swiftserve.config import EngineConfig
from swiftserve.core.messages import EngineCoreOutput
from swiftserve.core.scheduler import fits_in_kv_pool
from swiftserve.engine.core import EngineCoreRequest
from swiftserve.engine.core_client import Abort, Add, ProcessCoreClient, ThreadCoreClient
from swiftserve.engine.generation_config import default_sampling
from swiftserve.engine.inputs import InputProcessor, InvalidRequestError, ProcessedPrompt, Prompt
from swiftserve.engine.llm import child_seed
from swiftserve.engine.output_processor import OutputProcessor
from swiftserve.engine.tokenizer import load_tokenizer
from swiftserve.model.config import ModelConfig
from swiftserve.outputs import RequestOutput
from swiftserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped with an error; no request can complete."""


class RequestDeadlineError(RuntimeError):
    """A request's deadline (queue time included) passed before it finished."""


class AsyncLLM:
    """Async generation: ``async for out in engine.generate(prompt, params, request_id)``."""

    def __init__(
        self, config: EngineConfig, model_path: str, *, progress: bool = True, engine_process: bool = False
    ):
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or model_path)
        self.model_config = ModelConfig.from_dir(model_path)
        self.default_sampling = default_sampling(model_path)
        # The core runs in its own process (msgspec over a pipe) or in a thread of this one.
        self.client: ThreadCoreClient | ProcessCoreClient = (
            ProcessCoreClient(config, model_path, progress)
            if engine_process
            else ThreadCoreClient(config, model_path, progress)
        )
        self.max_model_len = self.client.info.max_model_len
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.eos_token_ids = self.model_config.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        self.processor = OutputProcessor(self.tokenizer)
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
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
        touched, stopped = self.processor.process(item)
        if stopped:
            self.client.send(Abort(stopped, stopped=True))
        for state in touched:
            rq = self._queues.get(state.request_id)
            if rq is not None:
                rq.put_nowait(self.processor.to_request_output(state, delta=True))

    # ---- requests ------------------------------------------------------------------------
    async def process_prompt(self, prompt: Prompt, add_special_tokens: bool = True) -> ProcessedPrompt:
        """Tokenize and validate off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize_pool,
            lambda: self.inputs.process(prompt, add_special_tokens=add_special_tokens),
        )

    async def generate(
        self,
        prompt: Prompt | ProcessedPrompt,
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        deadline: float | None = None,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield incremental outputs (``text`` holds only the new text of each step).

        ``deadline`` is an absolute time.monotonic() value; past it the request is aborted
        and RequestDeadlineError is raised. Cancelling the consumer aborts the request.
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
        children = self.processor.add_request(request_id, processed.prompt, processed.token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        core_requests = [
            EngineCoreRequest(
                child,
                processed.token_ids,
                params if params.n == 1 else params.replace(n=1, seed=child_seed(params.seed, i, params.n)),
                max_tokens,
                self.eos_token_ids,
                priority,
                arrival,
            )
            for i, child in enumerate(children)
        ]
        self.client.send(Add(core_requests))
        finished = False
        try:
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

    def check_fits(self, request_id: str, num_tokens: int) -> None:
        """ValueError if a request of num_tokens could never fit in the engine's KV pool."""
        info = self.client.info
        fits_in_kv_pool(request_id, num_tokens, info.max_model_len, info.num_blocks, info.block_size)

    def stats(self) -> dict[str, Any]:
        """Scheduler and cache state for /metrics (the latest the engine reported)."""
        return self.client.stats() if self._started else {}
