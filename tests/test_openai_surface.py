"""The rest of the OpenAI/vLLM request surface through a real server: priority under fcfs is
refused, cache_salt isolates prefix-cache hits, continuous usage stats, tokenize/detokenize."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server_utils import Server, running_server


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(llama_dir, "--max-model-len", "256", log_dir=tmp_path_factory.mktemp("surface")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_priority_under_fcfs_is_refused_not_dropped(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=None, prompt="x", max_tokens=2, extra_body={"priority": 3})  # type: ignore[arg-type]
    assert info.value.body["param"] == "priority"  # type: ignore[index]
    ok = client.completions.create(model=None, prompt="x", max_tokens=2, extra_body={"priority": 0})  # type: ignore[arg-type]
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def test_cache_salt_isolates_prefix_hits(server: Server, client: openai.OpenAI) -> None:
    prompt = [7 + (i * 13) % 400 for i in range(96)]  # six full blocks of 16

    def hits_after(salt: str | None) -> float:
        before = server.metrics()["swiftserve:prefix_cache_hits"]
        extra = {"cache_salt": salt} if salt is not None else {}
        client.completions.create(model=None, prompt=prompt, max_tokens=1, extra_body=extra)  # type: ignore[arg-type]
        return server.metrics()["swiftserve:prefix_cache_hits"] - before

    assert hits_after("tenant-a") == 0  # first time anywhere
    assert hits_after("tenant-a") > 0  # the same tenant hits its own cache
    assert hits_after("tenant-b") == 0  # another tenant does not see it
    assert hits_after(None) == 0  # nor does an unsalted request
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=None, prompt="x", max_tokens=1, extra_body={"cache_salt": ""})  # type: ignore[arg-type]


def test_continuous_usage_stats_in_every_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6
    plain = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    with_usage = [c for c in plain if c.usage is not None]
    assert len(with_usage) == 1 and not with_usage[0].choices  # only the final usage chunk


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_and_detokenize(server: Server, llama_dir: Path, prefix: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    text = "Hello tokenizer, 12345!"
    reply = httpx.post(
        f"{server.url}{prefix}/tokenize", json={"prompt": text, "return_token_strs": True}
    ).json()
    assert reply["tokens"] == tok.encode(text) and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == 256 and len(reply["token_strs"]) == reply["count"]
    back = httpx.post(f"{server.url}{prefix}/detokenize", json={"tokens": reply["tokens"]}).json()
    assert back["prompt"] == tok.decode(reply["tokens"])
    messages = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(f"{server.url}{prefix}/tokenize", json={"messages": messages}).json()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)  # as /v1/chat/completions


def test_tokenize_bad_input_is_a_400(server: Server) -> None:
    for path, body, param in (
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ):
        reply = httpx.post(f"{server.url}{path}", json=body)
        assert reply.status_code == 400, (path, body, reply.text)
        assert reply.json()["error"]["param"] == param
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "a", "model": "nope"}).status_code == 404


def test_logit_bias_allowed_ids_and_bad_words_through_the_server(
    server: Server, client: openai.OpenAI
) -> None:
    def ids_of(text: str) -> list[int]:
        return httpx.post(
            f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}
        ).json()["tokens"]

    base = {"model": None, "prompt": "The quick", "max_tokens": 6, "temperature": 0.0}
    forced = client.completions.create(**base, logit_bias={"42": 100}, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    assert ids_of(forced.choices[0].text) == [42] * 6
    allowed = client.completions.create(
        **base, extra_body={"allowed_token_ids": [50, 51], "ignore_eos": True, "temperature": 1.0, "seed": 3}
    )  # type: ignore[arg-type]
    assert set(ids_of(allowed.choices[0].text)) <= {50, 51}
    free = client.completions.create(**base, extra_body={"ignore_eos": True})  # type: ignore[arg-type]
    first = httpx.post(
        f"{server.url}/tokenize", json={"prompt": free.choices[0].text, "add_special_tokens": False}
    )
    word = httpx.post(f"{server.url}/detokenize", json={"tokens": first.json()["tokens"][:1]}).json()[
        "prompt"
    ]
    if word.strip():
        banned = client.completions.create(**base, extra_body={"ignore_eos": True, "bad_words": [word]})  # type: ignore[arg-type]
        assert word.strip() not in banned.choices[0].text.split()[:1]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**8]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words.0"),
    ],
)
def test_token_rule_bad_input_is_a_400(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=None, prompt="x", max_tokens=1, extra_body=extra)  # type: ignore[arg-type]
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


def test_echo_returns_the_prompt_with_its_logprobs(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    plain = client.completions.create(model=None, prompt=prompt, max_tokens=4, temperature=0.0)  # type: ignore[arg-type]
    echoed = client.completions.create(model=None, prompt=prompt, max_tokens=4, temperature=0.0, echo=True)  # type: ignore[arg-type]
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    scored = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=prompt,
        max_tokens=4,
        temperature=0.0,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = scored.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    n_prompt = scored.usage.prompt_tokens  # type: ignore[union-attr]
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]).endswith(prompt.split()[-1])
    assert lp.text_offset == sorted(lp.text_offset)  # type: ignore[arg-type]
    streamed = client.completions.create(
        model=None,
        prompt=prompt,
        max_tokens=4,
        temperature=0.0,
        echo=True,
        stream=True,  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_chat_template_file_and_kwargs(llama_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"
        "{% if shout %}!!{% endif %}{% if add_generation_prompt %}>{% endif %}"
    )
    with running_server(
        llama_dir, "--max-model-len", "256", "--chat-template", str(template), log_dir=tmp_path
    ) as s:
        messages = [{"role": "user", "content": "hi"}]

        def rendered(**extra: object) -> list[int]:
            body = {"messages": messages, "max_tokens": 1, **extra}
            reply = httpx.post(f"{s.url}/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            return httpx.post(
                f"{s.url}/tokenize", json={"prompt": "[user|hi]>", "add_special_tokens": False}
            ).json()["tokens"]

        plain = httpx.post(f"{s.url}/tokenize", json={"messages": messages}).json()["tokens"]
        assert plain == rendered()  # the file's template, not the checkpoint's
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        shouted = client.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=messages,  # type: ignore[arg-type]
            max_tokens=1,
            extra_body={"chat_template_kwargs": {"shout": True}},
        )
        plain_reply = client.chat.completions.create(model=None, messages=messages, max_tokens=1)  # type: ignore[arg-type]
        assert shouted.usage.prompt_tokens > plain_reply.usage.prompt_tokens  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=None,  # type: ignore[arg-type]
                messages=messages,  # type: ignore[arg-type]
                max_tokens=1,
                extra_body={"chat_template_kwargs": {"messages": []}},
            )
        assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


def test_broken_chat_template_fails_at_start(llama_dir: Path, tmp_path: Path) -> None:
    broken = running_server(llama_dir, "--chat-template", "{% for x in %}", log_dir=tmp_path, startup_s=60)
    with pytest.raises(RuntimeError, match="does not compile"), broken:
        pass


def test_echo_logprobs_of_a_prompt_prefilled_in_chunks(llama_dir: Path, tmp_path: Path) -> None:
    args = ("--max-model-len", "256", "--max-num-batched-tokens", "32", "--max-num-seqs", "4")
    with running_server(llama_dir, *args, log_dir=tmp_path) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        prompt = [5 + (i * 7) % 300 for i in range(100)]  # four chunks of at most 32
        reply = client.completions.create(
            model=None,  # type: ignore[arg-type]
            prompt=prompt,
            max_tokens=3,
            echo=True,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        lp = reply.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None
        assert len(lp.token_logprobs) == 103 and lp.token_logprobs[0] is None
        assert all(v is not None for v in lp.token_logprobs[1:])
