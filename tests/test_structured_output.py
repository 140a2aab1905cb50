"""Structured output through a real server and the official openai client: twenty JSON
schemas, regex, choice, Lark grammars, json_object, n > 1, streaming, a length cut, and a
400 naming the field for every spec that cannot compile. Outputs are checked with
``jsonschema``, never against fixed strings."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from server_utils import Server, running_server
from structured_schemas import SCHEMAS


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(
        llama_dir, "--max-model-len", "512", log_dir=tmp_path_factory.mktemp("structured")
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_twenty_schemas_parse_and_validate(client: openai.OpenAI, index: int) -> None:
    schema = SCHEMAS[index]
    resp = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format=_schema_format(schema),
        max_tokens=400,
        temperature=0.9,
        seed=index,
        n=2,
    )
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_structured_outputs_field_on_completions(client: openai.OpenAI) -> None:
    """vLLM's structured_outputs field: json, regex, choice and a Lark grammar."""

    def complete(spec: dict[str, Any], seed: int) -> str:
        resp = client.completions.create(
            model=None,  # type: ignore[arg-type]
            prompt="Value:",
            max_tokens=100,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": spec},
        )
        assert resp.choices[0].finish_reason == "stop"
        return resp.choices[0].text

    for seed in range(4):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", complete({"regex": r"[0-9]{3}-[a-z]{2,4}"}, seed))
        assert complete({"choice": ["yes", "no", 'say "maybe"']}, seed) in ("yes", "no", 'say "maybe"')
        grammar = 'start: "(" num ("," num)* ")"\nnum: /[1-9][0-9]?/'
        assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", complete({"grammar": grammar}, seed))
        schema = SCHEMAS[7]
        jsonschema.validate(json.loads(complete({"json": schema}, seed)), schema)


def test_json_object_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0.7,
        seed=3,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text.startswith("{")
    if finish == "stop":  # an unconstrained object may run past max_tokens; if it closed, it parses
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"


def test_streamed_schema_output_validates(client: openai.OpenAI) -> None:
    schema = SCHEMAS[16]
    stream = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "two points"}],
        response_format=_schema_format(schema),
        max_tokens=200,
        stream=True,
    )
    text = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_length_cut_is_length_not_a_fake_close(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "x"}],
        response_format=_schema_format(SCHEMAS[6]),
        max_tokens=5,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is not None and choice.message.content.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


def test_stop_string_inside_structured_output(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt="v",
        max_tokens=50,
        stop=["-"],
        extra_body={"structured_outputs": {"regex": r"[a-c]{2}-[0-9]{2}"}},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[a-c]{2}", resp.choices[0].text)


BAD_SPECS: list[tuple[str, dict[str, Any], str]] = [
    (
        "a type that is not a JSON type",
        {"response_format": _schema_format({"type": "bogus"})},
        "response_format",
    ),
    (
        "an unsatisfiable schema",
        {"response_format": _schema_format({"type": "string", "minLength": 5, "maxLength": 2})},
        "response_format",
    ),
    (
        "json_schema without a schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
    ),
    ("an invalid regex", {"structured_outputs": {"regex": "a{3"}}, "structured_outputs.regex"),
    (
        "a regex that matches nothing",
        {"structured_outputs": {"regex": r"[^\s\S]"}},
        "structured_outputs.regex",
    ),
    (
        "a grammar with an unknown rule",
        {"structured_outputs": {"grammar": "start: foo"}},
        "structured_outputs.grammar",
    ),
    (
        "two constraints at once",
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
    ),
    ("an empty choice", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    (
        "response_format with structured_outputs",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "response_format",
    ),
    ("an unknown structured_outputs key", {"structured_outputs": {"jsonn": {}}}, None),
    ("a bias on a token outside the vocabulary", {"logit_bias": {"999999": 5}}, "logit_bias"),
]


@pytest.mark.parametrize(("what", "extra", "param"), BAD_SPECS, ids=[b[0] for b in BAD_SPECS])
def test_bad_specs_get_a_400_naming_the_field(
    client: openai.OpenAI, what: str, extra: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            extra_body=extra,
        )
    body = info.value.body
    assert isinstance(body, dict) and body.get("message"), what
    if param is not None:
        assert body["param"] == param, body
    # the server goes on serving: a good structured request right after works
    ok = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "x"}],
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["ok", "fine"]}},
    )
    assert ok.choices[0].message.content in ("ok", "fine")
