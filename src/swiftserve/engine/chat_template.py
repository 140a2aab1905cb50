"""Chat templates rendered the way ``transformers`` renders them, without importing it.

Importing transformers costs ~1.5-2 s of start-up; the template itself is a few lines of
Jinja. The environment mirrors ``transformers.utils.chat_template_utils`` (sandboxed,
``trim_blocks``/``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception``,
``strftime_now``, and the special tokens as variables); tests/test_tokenizer.py checks the
output is identical to transformers' for the templates we ship and common public ones.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; templates read the first one (as transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any):
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (assistant-mask tracking unused)."""

    tags = {"generation"}  # noqa: RUF012 (Jinja reads it from the class)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template text (the server renders the same one for every request)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def load_template(spec: str) -> str:
    """A template given as a file path or as its text; compiled here so a broken one fails
    at start with the reason, not at the first request."""
    path = Path(spec)
    text = path.read_text() if path.is_file() else spec
    if not path.is_file() and "{" not in spec:
        raise ValueError(f"--chat-template: {spec!r} is neither a file nor a Jinja template")
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not compile: {e}") from e
    return text


def _normalize(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys (templates handle a missing key, not "None") and alias reasoning."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    special_tokens: dict[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render one conversation; raises ``jinja2.TemplateError`` when the template refuses it."""
    variables = {**(special_tokens or {}), **kwargs}
    return compile_template(source).render(
        messages=_normalize(messages),
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
