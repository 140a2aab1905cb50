"""LLM: the offline API (vLLM's names): ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from swiftserve import startup
from swiftserve.config import EngineConfig
from swiftserve.core.messages import FINISH_REJECTED, Abort, Add
from swiftserve.engine.core import EngineCore
from swiftserve.engine.core_loop import CoreLoop, core_info
from swiftserve.engine.frontend import Frontend
from swiftserve.engine.inputs import InvalidRequestError, ProcessedPrompt, Prompt, normalize_prompts
from swiftserve.engine.model_source import resolve_model
from swiftserve.engine.tokenizer import load_tokenizer
from swiftserve.outputs import RequestOutput
from swiftserve.sampling_params import SamplingParams
from swiftserve.startup import Timeline

Message = dict[str, Any]


class LLM:
    """Generate text offline from a Hugging Face checkpoint directory.

    Every keyword is an ``EngineConfig`` option; unknown names raise ``ValueError``.
    Without ``model`` the built-in demo model is used.
    """

    def __init__(self, model: str | None = None, *, progress: bool = True, **options: Any):
        timeline = Timeline("LLM", anchor=time.time())
        startup.set_current(timeline)  # the worker's phases land on this timeline
        self.config = EngineConfig(model=model, **options)
        if self.config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 runs behind the server (swiftserve serve); LLM runs one engine"
            )
        path = resolve_model(model)
        self.model_path = Path(path)
        with timeline.phase("tokenizer"):
            tokenizer = load_tokenizer(self.config.tokenizer or path, self.config.tokenizer_mode)
        self.loop = CoreLoop(EngineCore(self.config, path, progress=progress))
        self.frontend = Frontend(tokenizer, path, core_info(self.loop.core))
        timeline.mark("ready")
        self.startup = timeline
        self.tokenizer = tokenizer
        self.max_model_len = self.frontend.max_model_len
        self.inputs = self.frontend.inputs
        self.processor = self.frontend.processor
        self.eos_token_ids = self.frontend.eos_token_ids
        self._ids = itertools.count()

    @property
    def engine(self) -> EngineCore:
        """The engine core (scheduler, block manager, runner) this LLM steps."""
        return self.loop.core

    def shutdown(self) -> None:
        """Stop the engine's workers (pipeline stages are processes of their own)."""
        self.loop.core.shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        *,
        add_special_tokens: bool = True,
        timeout: float | Sequence[float | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        ``timeout`` (seconds from now, one or one per prompt): a request that cannot finish
        in time ends early with ``finish_reason == "deadline_exceeded"``; requests with a
        deadline are served earliest-deadline-first.
        """
        items = normalize_prompts(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(items), "sampling_params")
        prios = _per_prompt(list(priority) if priority is not None else 0, len(items), "priority")
        timeouts = _per_prompt(
            list(timeout) if isinstance(timeout, Sequence) else timeout, len(items), "timeout"
        )
        now = time.monotonic()
        deadlines = [None if t is None else now + _check_timeout(t) for t in timeouts]
        # Validate everything before queueing anything: all-or-nothing.
        processed = [self.inputs.process(p, add_special_tokens=add_special_tokens) for p in items]
        for sp in {id(sp): sp for sp in params}.values():
            self.frontend.check_structured(sp)
        max_tokens = [
            self.inputs.max_tokens(len(p.token_ids), sp) for p, sp in zip(processed, params, strict=True)
        ]
        request_ids = [str(next(self._ids)) for _ in items]
        for rid, proc, sp, prio, mt, dl in zip(
            request_ids, processed, params, prios, max_tokens, deadlines, strict=True
        ):
            self._add(rid, proc, sp, prio, mt, dl)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the checkpoint's, or ``chat_template``) to one or more
        conversations and generate. ``tools`` (OpenAI's shape) and ``chat_template_kwargs``
        reach the template as in vLLM's ``LLM.chat``; constrain the output with
        ``SamplingParams(structured_outputs=...)`` to force a call. Parsing the calls out of
        the text is the server's job (server/tool_calls.py)."""
        if not messages:
            raise InvalidRequestError("messages: must not be empty", "messages")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conv in conversations:
            if not conv:
                raise InvalidRequestError("messages: must not be empty", "messages")
            text = self.tokenizer.apply_chat_template(
                conv,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **({"chat_template": chat_template} if chat_template else {}),
                **(chat_template_kwargs or {}),
            )
            prompts.append(text)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, add_special_tokens=False)

    def _add(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        priority: int,
        max_tokens: int,
        deadline: float | None = None,
    ) -> None:
        requests = self.frontend.add_request(
            request_id, processed, params, max_tokens, priority, time.monotonic(), deadline
        )
        rejected = self.loop.apply(Add(requests))
        if rejected:
            self.processor.pop(request_id)
            raise InvalidRequestError(f"rejected by the engine: {rejected[0].stop_reason}")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        core = self.loop.core
        with tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while pending and core.has_unfinished():
                outputs = self.loop.step()
                assert all(o.finish_reason != FINISH_REJECTED for o in outputs)
                touched, stopped = self.processor.process(outputs)
                if stopped:
                    self.loop.apply(Abort(stopped, stopped=True))
                for state in touched:
                    if state.finished and state.request_id in pending:
                        done[state.request_id] = self.processor.to_request_output(state)
                        self.processor.pop(state.request_id)
                        pending.discard(state.request_id)
                        bar.update(1)
        if pending:
            raise RuntimeError(f"engine stopped with unfinished requests: {sorted(pending)}")
        return [done[rid] for rid in request_ids]


def _check_timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1e7:
        raise InvalidRequestError(
            f"timeout: must be a number of seconds in (0, 1e7], got {value!r}", "timeout"
        )
    return float(value)


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != count:
            raise InvalidRequestError(f"{name}: got {len(value)} values for {count} prompts", name)
        return list(value)
    return [value] * count
