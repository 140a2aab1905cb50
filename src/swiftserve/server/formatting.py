"""Turning RequestOutput deltas into OpenAI response bodies and SSE chunks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from swiftserve.outputs import PositionLogprobs, RequestMetrics, RequestOutput
from swiftserve.sampling_params import SamplingParams
from swiftserve.server.metrics import ServerMetrics
from swiftserve.server.tool_calls import ToolRequest, ToolStream


@dataclass
class _Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False
    finish_sent: bool = False


@dataclass
class _Delta:
    choice: _Choice
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs]
    newly_finished: bool


class _Formatter:
    """Accumulates outputs of all prompts and choices of one HTTP request."""

    id_prefix = "req"

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        params: SamplingParams,
        metrics: ServerMetrics | None = None,
    ):
        self.id = request_id
        self.created = created
        self.model = model
        self.n = params.n
        self.want_logprobs = params.logprobs is not None
        self.num_top = params.logprobs or 0
        self.choices: dict[int, _Choice] = {}
        self.prompt_lengths: dict[int, int] = {}
        self.last_metrics: RequestMetrics | None = None
        self.metrics = metrics
        self._last_time: dict[int, float] = {}

    def _update(self, index: int, out: RequestOutput) -> list[_Delta]:
        self.prompt_lengths[index] = len(out.prompt_token_ids)
        self.last_metrics = out.metrics or self.last_metrics
        deltas = []
        now = time.monotonic()
        for comp in out.outputs:
            ci = index * self.n + comp.index
            ch = self.choices.setdefault(ci, _Choice(ci))
            new_ids = comp.token_ids[len(ch.token_ids) :]
            if new_ids:
                last = self._last_time.get(ci)
                if last is not None and self.metrics is not None:
                    self.metrics.itl.observe(now - last)
                self._last_time[ci] = now
            new_lps = (comp.logprobs or [])[len(ch.logprobs) :]
            ch.token_ids.extend(new_ids)
            ch.logprobs.extend(new_lps)
            ch.text += comp.text
            newly = comp.finish_reason is not None and ch.finish_reason is None
            ch.finish_reason = comp.finish_reason
            ch.stop_reason = comp.stop_reason
            deltas.append(_Delta(ch, comp.text, new_ids, new_lps, newly))
        return deltas

    def add(self, index: int, out: RequestOutput) -> None:
        self._update(index, out)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lengths.values())

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def finish_reasons(self) -> list[str]:
        return [c.finish_reason for c in self.choices.values() if c.finish_reason]

    def usage_chunk(self) -> str:
        return json.dumps({**self._envelope(self.chunk_object, []), "usage": self.usage()})

    chunk_object = "chunk"
    continuous_usage = False  # stream_options.continuous_usage_stats: usage in every chunk

    def _chunk_json(self, choice: dict[str, Any]) -> str:
        body = self._envelope(self.chunk_object, [choice])
        if self.continuous_usage:
            body["usage"] = self.usage()
        return json.dumps(body)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """The fields every response body and chunk shares."""
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _sorted(self) -> list[_Choice]:
        return [self.choices[i] for i in sorted(self.choices)]


def _token_text(lp: PositionLogprobs, token_id: int) -> str:
    entry = lp.get(token_id)
    return (entry.decoded_token or "") if entry is not None else ""


def _top(lp: PositionLogprobs, num_top: int) -> list[tuple[str, float]]:
    """The top-N alternatives (by rank) as (text, logprob)."""
    ranked = sorted((e for e in lp.values() if e.rank <= num_top), key=lambda e: e.rank)
    return [(e.decoded_token or "", e.logprob) for e in ranked]


class CompletionFormatter(_Formatter):
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # echo: each prompt's text (set by the server), how to spell a prompt token whose
        # logprob the engine does not give (the first one), and each prompt's ids and logprobs
        self.echo: list[str] | None = None
        self.decode: Any = None
        self._prompts: dict[int, tuple[list[int], list[Any]]] = {}

    def _echo_text(self, choice: _Choice) -> str:
        return self.echo[choice.index // self.n] if self.echo is not None else ""

    def _echo_logprobs(self, choice: _Choice) -> dict[str, list[Any]]:
        """The prompt's part of an echoed choice's logprobs (empty without echo)."""
        empty: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        prompt = self._prompts.get(choice.index // self.n)
        if self.echo is None or not self.want_logprobs or prompt is None:
            return empty
        ids, lps = prompt
        offset = 0
        for token_id, lp in zip(ids, lps, strict=True):
            text = (
                _token_text(lp, token_id)
                if lp is not None
                else (self.decode([token_id]) if self.decode else "")
            )
            empty["tokens"].append(text)
            empty["token_logprobs"].append(lp[token_id].logprob if lp is not None else None)
            empty["top_logprobs"].append(dict(_top(lp, self.num_top)) if lp is not None else None)
            empty["text_offset"].append(offset)
            offset += len(text)
        return empty

    def add(self, index: int, out: RequestOutput) -> None:
        self._remember_prompt(index, out)
        super().add(index, out)

    def _remember_prompt(self, index: int, out: RequestOutput) -> None:
        # prompt logprobs can arrive over several outputs (chunked prefill): keep the longest
        known = self._prompts.get(index)
        if (
            self.echo is not None
            and out.prompt_logprobs
            and (known is None or len(out.prompt_logprobs) > len(known[1]))
        ):
            self._prompts[index] = (list(out.prompt_token_ids), list(out.prompt_logprobs))

    def _with_echo(self, choice: _Choice, text: str, logprobs: dict[str, Any] | None) -> tuple[str, Any]:
        """Prefix the prompt (and its logprobs) to a choice's first text."""
        prompt_text = self._echo_text(choice)
        if logprobs is None:
            return prompt_text + text, None
        head = self._echo_logprobs(choice)
        shift = len(prompt_text)
        return prompt_text + text, {
            "tokens": head["tokens"] + logprobs["tokens"],
            "token_logprobs": head["token_logprobs"] + logprobs["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + logprobs["top_logprobs"],
            "text_offset": head["text_offset"] + [o + shift for o in logprobs["text_offset"]],
        }

    def _logprobs(
        self, token_ids: list[int], lps: list[PositionLogprobs], offset: int
    ) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, lps, strict=False):
            text = _token_text(lp, token_id)
            tokens.append(text)
            token_lps.append(lp[token_id].logprob)
            tops.append(dict(_top(lp, self.num_top)))
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chunks(self, index: int, out: RequestOutput) -> list[str]:
        result = []
        self._remember_prompt(index, out)
        for d in self._update(index, out):
            if not d.text and not d.newly_finished and not d.token_ids:
                continue
            start = len(d.choice.token_ids) - len(d.token_ids)
            lp = self._logprobs(d.choice.token_ids[start:], d.logprobs, len(d.choice.text) - len(d.text))
            text = d.text
            if self.echo is not None and not d.choice.started:
                d.choice.started = True
                text, lp = self._with_echo(d.choice, text, lp)
            choice = {
                "index": d.choice.index,
                "text": text,
                "logprobs": lp,
                "finish_reason": d.choice.finish_reason if d.newly_finished else None,
                "stop_reason": d.choice.stop_reason if d.newly_finished else None,
            }
            result.append(self._chunk_json(choice))
        return result

    def final(self) -> dict[str, Any]:
        choices = []
        for c in self._sorted():
            text, lp = c.text, self._logprobs(c.token_ids, c.logprobs, 0)
            if self.echo is not None:
                text, lp = self._with_echo(c, text, lp)
            choices.append(
                {
                    "index": c.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {**self._envelope("text_completion", choices), "usage": self.usage()}


class ChatFormatter(_Formatter):
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    tools: ToolRequest | None = None  # set when the request offers tools (server/tool_calls.py)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tool_streams: dict[int, ToolStream] = {}

    def _logprobs(self, token_ids: list[int], lps: list[PositionLogprobs]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        content = []
        for token_id, lp in zip(token_ids, lps, strict=False):
            text = _token_text(lp, token_id)
            content.append(
                {
                    "token": text,
                    "logprob": lp[token_id].logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": v, "bytes": list(t.encode())}
                        for t, v in _top(lp, self.num_top)
                    ],
                }
            )
        return {"content": content}

    def chunks(self, index: int, out: RequestOutput) -> list[str]:
        result = []
        for d in self._update(index, out):
            ch = d.choice
            if not ch.started:
                ch.started = True
                result.append(self._chunk(ch.index, {"role": "assistant", "content": ""}, None, None))
            if not d.text and not d.newly_finished and not d.token_ids:
                continue
            start = len(ch.token_ids) - len(d.token_ids)
            lp = self._logprobs(ch.token_ids[start:], d.logprobs)
            if self.tools is not None:
                result.extend(self._tool_chunks(d, lp))
                continue
            delta = {"content": d.text} if d.text or not d.newly_finished else {}
            result.append(self._chunk(ch.index, delta, lp, ch.finish_reason if d.newly_finished else None))
        return result

    def _tool_chunks(self, d: _Delta, logprobs: Any) -> list[str]:
        """Content and tool-call deltas of one step (logprobs ride on the first chunk sent)."""
        assert self.tools is not None
        ch = d.choice
        stream = self._tool_streams.setdefault(ch.index, ToolStream(self.tools))
        deltas = stream.feed(d.text, d.newly_finished)
        out = [
            self._chunk(ch.index, delta, logprobs if i == 0 else None, None) for i, delta in enumerate(deltas)
        ]
        if d.newly_finished:
            out.append(self._chunk(ch.index, {}, None, stream.finish_reason(ch.finish_reason)))
        return out

    def _message(self, c: _Choice) -> tuple[dict[str, Any], str | None]:
        """The final assistant message (with parsed tool calls) and its finish reason."""
        if self.tools is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        content, calls = self.tools.parse(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_dict() for call in calls]
        return message, ("tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason)

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: Any, finish: str | None) -> str:
        return self._chunk_json(
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        )

    def final(self) -> dict[str, Any]:
        choices = []
        for c in self._sorted():
            message, finish = self._message(c)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        return {**self._envelope("chat.completion", choices), "usage": self.usage()}
