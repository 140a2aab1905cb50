"""Tool calling on /v1/chat/completions: constraints, parsers, and streamed tool-call deltas.

``tool_choice`` decides how calls come out (as in vLLM):

- a named function: the output is constrained to that function's parameter schema, and the
  whole output is the call's ``arguments`` (streamed as argument deltas as it is produced);
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}``
  objects, one per call (one only when ``parallel_tool_calls`` is false);
- ``"auto"``: free text, parsed by the server's ``--tool-call-parser`` (Hermes / Qwen2.5
  ``<tool_call>{...}</tool_call>`` or Llama-3 JSON); text before a call stays ``content``;
- ``"none"``: plain text.

So even a tiny random model returns a valid call for "required" and named functions.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from swiftserve.sampling_params import SamplingParams, StructuredOutputsParams
from swiftserve.server.protocol import ChatCompletionRequest
from swiftserve.server.settings import ServerSettings


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolParser(Protocol):
    """Finds tool calls in free model output."""

    def start(self, text: str) -> int | None:
        """Where the first call may begin in ``text`` (a partial marker at the end counts)."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content without the calls, calls); no calls when nothing parses."""


def _call_from(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _partial_marker_at(text: str, marker: str) -> int | None:
    """Index of ``marker`` in text, or of a prefix of it that ends the text."""
    found = text.find(marker)
    if found >= 0:
        return found
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return None


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5)."""

    marker = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def start(self, text: str) -> int | None:
        return _partial_marker_at(text, self.marker)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        begin = text.find(self.marker)
        if begin < 0:
            return text, []
        calls = []
        for body in self._call.findall(text[begin:]):
            try:
                call = _call_from(json.loads(body))
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        content = text[:begin].strip()
        return content or None, calls


class Llama3JsonParser:
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, ``;``-separated, maybe
    after ``<|python_tag|>``; output that does not start with one is content."""

    tag = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return None
        if stripped.startswith("{") or self.tag.startswith(stripped[: len(self.tag)]):
            return len(text) - len(stripped)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.tag).strip()
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call_from(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while pos < len(body) and body[pos] in "; \n\t":
                pos += 1
        return (None, calls) if calls else (text, [])


PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and how its calls come out."""

    tools: list[dict[str, Any]]
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the named function
    parallel: bool = True
    parser: ToolParser | None = None

    def _parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def constraint(self) -> StructuredOutputsParams | None:
        """The output grammar for "required" and named functions; None otherwise."""
        if self.choice == "function":
            return StructuredOutputsParams(json=self._parameters(self.function or ""))
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": self._parameters(t["function"]["name"]),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Content and calls of a finished output."""
        if self.choice == "function":
            return None, [ToolCall(self.function or "", text)]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:  # cut by max_tokens: what there is stays text
                return text, []
            calls = [c for c in (_call_from(i, "parameters") for i in items) if c is not None]
            return (None, calls) if calls else (text, [])
        if self.choice == "auto" and self.parser is not None:
            return self.parser.parse(text)
        return text, []


class ToolStream:
    """Turns one choice's text deltas into chat-completion deltas with ``tool_calls``."""

    def __init__(self, request: ToolRequest):
        self.request = request
        self.text = ""
        self.sent = 0  # characters of text already sent as content (auto) or arguments (named)
        self.named_call = ToolCall(request.function or "", "") if request.choice == "function" else None
        self.num_calls = 0

    def feed(self, delta: str, finished: bool) -> list[dict[str, Any]]:
        """Deltas to send for this piece of text (the last piece when ``finished``)."""
        self.text += delta
        req = self.request
        if self.named_call is not None:
            return self._named(delta)
        if req.choice == "required" or (req.choice == "auto" and req.parser is not None):
            return self._parsed(finished)
        return [{"content": delta}] if delta else []

    def _named(self, delta: str) -> list[dict[str, Any]]:
        assert self.named_call is not None
        out = []
        if not self.num_calls:
            self.num_calls = 1
            head = self.named_call.to_dict()
            out.append(
                {"tool_calls": [{**head, "index": 0, "function": {**head["function"], "arguments": ""}}]}
            )
        if delta:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
        return out

    def _parsed(self, finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        req = self.request
        if req.choice == "auto" and req.parser is not None:
            # content goes out until a call may begin; from there on the text is held back
            start = req.parser.start(self.text[self.sent :])
            upto = len(self.text) if start is None else self.sent + start
            if upto > self.sent:
                out.append({"content": self.text[self.sent : upto]})
                self.sent = upto
        if not finished:
            return out
        content, calls = req.parse(self.text[self.sent :] if req.choice == "auto" else self.text)
        if not calls:
            rest = self.text[self.sent :]
            return out + ([{"content": rest}] if rest else [])
        if content and req.choice == "auto":
            out.append({"content": content})
        for i, call in enumerate(calls):
            out.append({"tool_calls": [{**call.to_dict(), "index": i}]})
        self.num_calls = len(calls)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """ "tool_calls" when calls came out of a generation that ended normally."""
        return "tool_calls" if reason == "stop" and self.num_calls else reason


def tool_request(
    tools: list[dict[str, Any]] | None,
    choice: str | dict[str, Any] | None,
    parallel: bool,
    parser_name: str | None,
    auto_enabled: bool,
) -> ToolRequest | None:
    """The request's ToolRequest (None without tools); ValueError naming the field when the
    combination is invalid (tool_choice without tools, an unknown function, auto without a
    parser, duplicate names)."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice: only allowed when tools are given")
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise ValueError(f"tool_choice: no tool named {name!r} in tools")
        return ToolRequest(tools, "function", name, parallel)
    choice = choice or "auto"
    if choice == "auto":
        if not auto_enabled or parser_name is None:
            raise ValueError(
                'tool_choice: "auto" tool choice requires the server to run with '
                "--enable-auto-tool-choice and --tool-call-parser"
            )
        return ToolRequest(tools, "auto", None, parallel, PARSERS[parser_name]())
    return ToolRequest(tools, choice, None, parallel)


def with_tools(
    body: ChatCompletionRequest, params: SamplingParams, settings: ServerSettings
) -> tuple[ToolRequest | None, SamplingParams, str]:
    """The request's tools, its params with the tool-call grammar added, and the field that
    set the grammar (named in the 400 if it does not compile). ValueError if invalid."""
    choice = (
        body.tool_choice.model_dump()
        if body.tool_choice is not None and not isinstance(body.tool_choice, str)
        else body.tool_choice
    )
    tools = tool_request(
        [t.model_dump(exclude_none=True) for t in body.tools or ()],
        choice,
        body.parallel_tool_calls,
        settings.tool_call_parser,
        settings.enable_auto_tool_choice,
    )
    constraint = tools.constraint() if tools is not None else None
    if constraint is None:
        return tools, params, body.structured_spec()[1]
    if params.structured_outputs is not None:
        raise ValueError("tool_choice: a required or named tool cannot be combined with response_format")
    return tools, params.replace(structured_outputs=constraint), "tools"
