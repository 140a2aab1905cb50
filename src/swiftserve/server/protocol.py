"""OpenAI request shapes (pydantic), strict: wrong types, NaN and unknown fields are 400s.

Every numeric field has bounds here, at the protocol layer, so the engine never sees an
out-of-range value (an integer past 2**63 once killed the engine process). Types are strict:
``"max_tokens": "5"`` is a 400, not a 5. Strings with lone surrogates (``"\ud800"``, legal in
JSON, not encodable as UTF-8) are refused before anything tokenizes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swiftserve.sampling_params import MAX_SEED, SamplingParams, StructuredOutputsParams

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_TOKEN_IDS = 256
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        bad = find_unencodable(data)
        if bad is not None:
            raise ValueError(f"{bad}: string is not valid UTF-8 (lone surrogate)")
        return data


def find_unencodable(value: Any, path: str = "body") -> str | None:
    """The path of the first string in ``value`` that cannot be encoded as UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = find_unencodable(item, f"{path}.{key}")
        if found is not None:
            return found
    return None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``."""

    name: str = Field(default="response", min_length=1, max_length=128)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` request field (one of json, regex, choice, grammar)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=4096)
    choice: list[str] | None = Field(default=None, max_length=1024)
    grammar: str | None = Field(default=None, max_length=65536)
    json_object: bool = False
    disable_any_whitespace: bool = True


MAX_SCHEMA_CHARS = 65536


class _SamplingFields(_Strict):
    """Fields shared by completions and chat (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(default=0, ge=-INT32_MAX, le=INT32_MAX)
    timeout: float | None = Field(default=None, gt=0, le=1e7)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None, max_length=1024
    )
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=1 << 20)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(
        default=None, max_length=128
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    def structured_spec(self) -> tuple[StructuredOutputsParams | None, str]:
        """The output constraint this request asks for and the field that asked (for errors)."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise ValueError("response_format: cannot be combined with structured_outputs")
        if so is not None:
            try:
                spec = StructuredOutputsParams(
                    json=so.json_,
                    json_object=so.json_object,
                    regex=so.regex,
                    choice=tuple(so.choice) if so.choice is not None else None,
                    grammar=so.grammar,
                    disable_any_whitespace=so.disable_any_whitespace,
                )
            except ValueError as e:
                raise ValueError(f"structured_outputs: {e}") from e
            return _bounded(spec, "structured_outputs"), "structured_outputs"
        if fmt is None or fmt.type == "text":
            return None, "response_format"
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if fmt.json_schema is None or not fmt.json_schema.schema_:
            raise ValueError("response_format: json_schema.schema is required for type json_schema")
        return _bounded(
            StructuredOutputsParams(json=fmt.json_schema.schema_), "response_format"
        ), "response_format"

    def _bias(self) -> tuple[tuple[int, float], ...]:
        """OpenAI's logit_bias: token ids as decimal strings."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) > INT32_MAX:
                raise ValueError(f"logit_bias: keys must be token ids, got {key!r}")
            out.append((int(key), bias))
        return tuple(out)

    def sampling_kwargs(self, defaults: Mapping[str, float]) -> dict[str, Any]:
        """SamplingParams keywords; unset sampling fields take ``defaults`` (the checkpoint's)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        out: dict[str, Any] = {
            "n": self.n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            # OpenAI's seed is any int64; the generator takes an unsigned 64-bit value.
            "seed": None if self.seed is None else self.seed % (MAX_SEED + 1),
            "stop": tuple(stop),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": self._bias(),
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": tuple(self.bad_words or ()),
            "structured_outputs": self.structured_spec()[0],
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)  # the checkpoint's generation_config.json
            if value is not None:
                out[name] = value
        return out


def _bounded(spec: StructuredOutputsParams, field: str) -> StructuredOutputsParams:
    if spec.json is not None and len(spec.json) > MAX_SCHEMA_CHARS:  # json is text by now
        raise ValueError(f"{field}: the JSON schema is over {MAX_SCHEMA_CHARS} characters")
    return spec


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def to_sampling_params(self, defaults: Mapping[str, float]) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else 16
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **self.sampling_kwargs(defaults))


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=128)
    arguments: str = Field(max_length=1 << 20)


class ToolCallMessage(_Strict):
    """A call in an assistant message that the client sends back."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = Field(default=None, ge=0, le=INT32_MAX)  # kept by streamed reassembly


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, max_length=256)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (tool-call arguments as objects, as in HF)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = Field(default=None, max_length=65536)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1, max_length=128)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=64)

    def to_sampling_params(self, defaults: Mapping[str, float]) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self.sampling_kwargs(defaults))
