"""The fast tokenizer path (``tokenizers`` + our Jinja chat templates) against transformers.

Start-up loads tokenizers without importing transformers (engine/tokenizer.py); these tests
pin that it changes nothing a request can observe: ids, text, special ids, chat prompts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from jinja2 import TemplateError
from transformers import AutoTokenizer

from swiftserve.engine.chat_template import render_chat
from swiftserve.engine.model_source import DEMO_MODEL_DIR
from swiftserve.engine.tokenizer import FastTokenizer, fast_path_refusal, load_tokenizer

TEXTS = [
    "",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Hello, world!  Two  spaces,\ttabs and\r\nnewlines.",
    "<|im_start|>user\nspecial tokens inside text<|im_end|><|endoftext|>",
    "naïve café, 東京, emoji 🙂🧪, combining e\u0301, zero\u200bwidth",
    " leading space and trailing space ",
    "x" * 500,
]

# A Llama-3.1-style template: namespace, loop controls, strftime_now, tojson, raise_exception.
LLAMA3_STYLE = """{{- bos_token }}
{%- set ns = namespace(system="") %}
{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content'] %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + strftime_now("%Y") + "\\n\\n" }}
{{- ns.system }}
{%- if tools is not none %}{{- tools | tojson(indent=4) }}{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{%- continue %}{%- endif %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# A Qwen-style template that reads reasoning_content and a missing (None) content.
QWEN_STYLE = """{%- for message in messages %}
{%- if message.content is defined %}{% set content = message.content %}
{%- else %}{% set content = '' %}{% endif %}
<|im_start|>{{ message.role }}
{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>
{% endif %}{{ content }}<|im_end|>
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": 'Be brief. "quotes" & <tags>'},
        {"role": "user", "content": "  padded  "},
        {"role": "assistant", "content": "ok", "reasoning": "thought about it"},
        {"role": "user", "content": "東京 🙂"},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}],
]


@pytest.fixture(scope="module")
def pair() -> tuple[FastTokenizer, object]:
    fast = load_tokenizer(DEMO_MODEL_DIR)
    assert isinstance(fast, FastTokenizer), "the demo tokenizer must take the fast path"
    return fast, AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


def test_ids_and_text_match_transformers(pair: tuple[FastTokenizer, object]) -> None:
    fast, hf = pair
    for text in TEXTS:
        for special in (True, False):
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text  # type: ignore[attr-defined]
            assert fast(text, add_special_tokens=special)["input_ids"] == ids
            for skip in (True, False):
                assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(  # type: ignore[attr-defined]
                    ids, skip_special_tokens=skip
                )


def test_special_ids_and_vocab_match_transformers(pair: tuple[FastTokenizer, object]) -> None:
    fast, hf = pair
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "vocab_size", "eos_token"):
        assert getattr(fast, name) == getattr(hf, name), name
    assert len(fast) == len(hf)  # type: ignore[arg-type]
    assert fast.get_vocab() == hf.get_vocab()  # type: ignore[attr-defined]
    tokens = ["<|im_end|>", "<|endoftext|>", "def"]
    assert fast.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)  # type: ignore[attr-defined]


@pytest.mark.parametrize("template", ["checkpoint", LLAMA3_STYLE, QWEN_STYLE])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_prompts_match_transformers(
    pair: tuple[FastTokenizer, object], template: str, generation_prompt: bool
) -> None:
    fast, hf = pair
    source = fast.chat_template if template == "checkpoint" else template
    assert source is not None
    for conv in CONVERSATIONS:
        expected = hf.apply_chat_template(  # type: ignore[attr-defined]
            conv, chat_template=source, tokenize=False, add_generation_prompt=generation_prompt
        )
        ours = render_chat(
            source, conv, add_generation_prompt=generation_prompt, special_tokens=fast.special_tokens_map
        )
        assert ours == expected
        if template == "checkpoint":
            text = fast.apply_chat_template(conv, tokenize=False, add_generation_prompt=generation_prompt)
            assert text == ours
            assert fast.apply_chat_template(conv, add_generation_prompt=generation_prompt) == fast.encode(
                ours, add_special_tokens=False
            )


def test_tools_render_like_transformers(pair: tuple[FastTokenizer, object]) -> None:
    fast, hf = pair
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "str <b>"}}}]
    conv = CONVERSATIONS[0]
    expected = hf.apply_chat_template(  # type: ignore[attr-defined]
        conv, chat_template=LLAMA3_STYLE, tools=tools, tokenize=False
    )
    assert render_chat(LLAMA3_STYLE, conv, tools=tools, special_tokens=fast.special_tokens_map) == expected


def test_template_errors_and_sandbox() -> None:
    with pytest.raises(TemplateError, match="unknown role"):
        render_chat(LLAMA3_STYLE, [{"role": "robot", "content": "x"}])
    # the sandbox refuses attribute escapes, as transformers' does
    with pytest.raises(TemplateError):
        render_chat("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError):
        render_chat("{% set ns = namespace(_x=1) %}", [])


def test_checkpoints_needing_transformers_fall_back(tmp_path: Path) -> None:
    assert fast_path_refusal(DEMO_MODEL_DIR) is None
    cases = {
        "class": {"tokenizer_class": "LlamaTokenizerFast"},
        "bos": {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True},
        "cleanup": {"clean_up_tokenization_spaces": True},
    }
    for name, extra in cases.items():
        folder = tmp_path / name
        shutil.copytree(DEMO_MODEL_DIR, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **extra}))
        assert fast_path_refusal(folder) is not None, name
        assert not isinstance(load_tokenizer(folder), FastTokenizer), name
    assert not isinstance(load_tokenizer(DEMO_MODEL_DIR, "hf"), FastTokenizer)
    with pytest.raises(ValueError, match="tokenizer_mode"):
        load_tokenizer(DEMO_MODEL_DIR, "slow")


def test_no_template_is_a_clear_error(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    (folder / "chat_template.jinja").unlink()
    tok = load_tokenizer(folder)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
