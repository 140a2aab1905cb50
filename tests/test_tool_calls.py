"""Tool calling through a real server and the official openai client: two-turn conversations
(call, tool result, answer) with "required" and a named function, streamed and not; "auto"
parsed by the Hermes parser; bad tool requests get a 400. Parsers and the delta stream are
also checked on their own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from server_utils import Server, running_server
from swiftserve.server.tool_calls import HermesParser, Llama3JsonParser, ToolRequest, ToolStream, tool_request
from swiftserve.tools.demo import write_random_checkpoint

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["offset"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # the tiny preset's 512-token vocabulary spells the tools' system prompt in ~700 tokens
    model = write_random_checkpoint(tmp_path_factory.mktemp("tools-model"), max_position_embeddings=2048)
    args = ("--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with running_server(model, *args, log_dir=tmp_path_factory.mktemp("tools")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _check_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _second_turn(client: openai.OpenAI, message: Any, stream: bool) -> tuple[str, str | None, int]:
    """Send the calls back with a result each; the model answers in text."""
    history: list[Any] = [*QUESTION, message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'} for c in message.tool_calls]
    kwargs: dict[str, Any] = dict(model=None, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    if not stream:
        resp = client.chat.completions.create(**kwargs)
        assert resp.choices[0].message.tool_calls is None
        assert resp.usage is not None
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason, resp.usage.prompt_tokens
    text, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            assert c.delta.tool_calls is None
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, 0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_two_turn_tool_conversation(client: openai.OpenAI, choice: str, stream: bool) -> None:
    tool_choice: Any = (
        "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    )
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    kwargs: dict[str, Any] = dict(
        model=None,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=200,
        temperature=0.8,
        seed=5,
    )
    if stream:
        with client.chat.completions.stream(**kwargs) as s:  # the client reassembles the deltas
            first = s.get_final_completion()
    else:
        first = client.chat.completions.create(**kwargs)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert not message.content
    _check_calls(message.tool_calls, names)
    text, finish, prompt_tokens = _second_turn(client, message, stream)
    assert finish in ("stop", "length") and (text or finish == "stop")
    if not stream:  # the tool call and its result went through the chat template
        assert first.usage is not None and prompt_tokens > first.usage.prompt_tokens


def test_required_without_parallel_calls_is_one_call(client: openai.OpenAI) -> None:
    for seed in range(3):
        resp = client.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=QUESTION,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        calls = resp.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1
        _check_calls(calls, set(SCHEMAS))


HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[a-z]{1,8}", "unit": "celsius"\}\}\n</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_auto_choice_parses_hermes_calls(client: openai.OpenAI, stream: bool) -> None:
    """A regex makes the random model write a Hermes call after some text; the auto parser
    turns it into tool_calls and keeps the text as content."""
    kwargs: dict[str, Any] = dict(
        model=None,
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=200,
        extra_body={"structured_outputs": {"regex": "Let me check[.]\\n" + HERMES_CALL}},
    )
    if stream:
        with client.chat.completions.stream(**kwargs) as s:
            resp = s.get_final_completion()
    else:
        resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or "").strip() == "Let me check."
    _check_calls(choice.message.tool_calls, {"get_weather"})


def test_auto_choice_without_a_call_is_plain_text(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=QUESTION,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "It is sunny in [A-Z][a-z]{2,6}[.]"}},
    )
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert (choice.message.content or "").startswith("It is sunny in ")


BAD_TOOL_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    (
        "an unknown tool in tool_choice",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("duplicate tool names", {"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    (
        "a parameter schema that cannot compile",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        "a named tool with response_format",
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    ("a bad tool type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
]


@pytest.mark.parametrize(("what", "extra", "param"), BAD_TOOL_REQUESTS, ids=[b[0] for b in BAD_TOOL_REQUESTS])
def test_bad_tool_requests_get_a_400(
    client: openai.OpenAI, what: str, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body=extra,
        )
    body = info.value.body
    assert isinstance(body, dict) and body.get("message"), what
    assert str(body.get("param", "")).startswith(param), body


# ---- parsers and the delta stream on their own ----------------------------------------------
def test_auto_needs_the_parser_flags() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser"):
        tool_request(TOOLS, "auto", True, None, False)
    assert tool_request(TOOLS, "none", True, None, False) is not None
    assert tool_request(None, None, True, None, False) is None


def test_hermes_parser() -> None:
    text = (
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    )
    content, calls = HermesParser().parse(text)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert HermesParser().parse("<tool_call>\n{not json\n</tool_call>") == (
        "<tool_call>\n{not json\n</tool_call>",
        [],
    )
    assert HermesParser().parse("plain") == ("plain", [])


def test_llama3_json_parser() -> None:
    content, calls = Llama3JsonParser().parse(
        '<|python_tag|>{"name": "a", "parameters": {"x": 2}}; {"name": "b", "parameters": {}}'
    )
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 2}),
        ("b", {}),
    ]
    assert Llama3JsonParser().parse("Hello {") == ("Hello {", [])


def test_auto_stream_holds_back_only_what_may_be_a_call() -> None:
    stream = ToolStream(ToolRequest(TOOLS, "auto", None, True, HermesParser()))
    pieces = [
        "Hi <to",
        "day",
        " <tool_",
        'call>\n{"name": "get_time", "arguments": {"offset": 2}}',
        "\n</tool_call>",
    ]
    deltas: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        deltas += stream.feed(piece, i == len(pieces) - 1)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert content == "Hi <today "
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"offset": 2}
    assert stream.finish_reason("stop") == "tool_calls" and stream.finish_reason("length") == "length"


def test_offline_chat_offers_tools_and_can_force_a_call(tmp_path_factory: pytest.TempPathFactory) -> None:
    """LLM.chat(tools=...) renders the tools into the template (vLLM's signature); a
    "required"-style grammar makes even a random model produce a valid call."""
    from swiftserve import LLM, SamplingParams

    model = write_random_checkpoint(tmp_path_factory.mktemp("chat-tools"), max_position_embeddings=2048)
    llm = LLM(model=str(model), max_model_len=2048)
    request = ToolRequest(TOOLS, "required", parallel=False)
    params = SamplingParams(max_tokens=200, temperature=0.8, seed=2, structured_outputs=request.constraint())
    out = llm.chat(QUESTION, params, use_tqdm=False, tools=TOOLS)
    assert out[0].prompt is not None and "<tools>" in out[0].prompt and "get_weather" in out[0].prompt
    content, calls = request.parse(out[0].outputs[0].text)
    assert content is None and len(calls) == 1
    assert calls[0].name in SCHEMAS
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    template = "Q: {{ messages[0]['content'] }}\nA:"
    custom = llm.chat(QUESTION, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template)
    assert custom[0].prompt == "Q: What is the weather in Paris?\nA:"
