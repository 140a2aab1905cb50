"""The offline API end to end: input forms, validation, stops, n > 1, seeds, chat, metrics."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftserve import LLM, SamplingParams
from swiftserve.config import EngineConfig


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), progress=False, max_model_len=128, seed=0)


def test_prompt_forms_and_order(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    text = "import os\n"
    ids = llm.get_tokenizer()(text)["input_ids"]
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, "x = 1"], params, use_tqdm=False)
    assert [o.prompt for o in outs[:1]] == [text]
    assert outs[0].prompt_token_ids == ids == outs[1].prompt_token_ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[3].prompt == "x = 1"
    single = llm.generate(text, params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    m = outs[0].metrics
    assert m is not None and m.arrival_time <= m.first_token_time <= m.finished_time  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"temperature": float("nan")}, "temperature"),
        ({"min_p": float("inf")}, "min_p"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"bogus_option": 1}, "bogus_option"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_engine_options_raise(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_num_seqz"):
        LLM(str(llama_dir), max_num_seqz=4)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="random")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)


def test_bad_prompts_raise(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([], use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens") as info:
        llm.generate("hello", SamplingParams(max_tokens=1000), use_tqdm=False)
    assert "maximum context length is 128 tokens" in str(info.value)
    # Nothing was queued by the failed calls; the engine still works.
    assert not llm.engine.has_unfinished()
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_stop_strings_and_stop_token_ids(llm: LLM) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate("def f(x):", base, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate("def f(x):", base.replace(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    inc = llm.generate(
        "def f(x):", base.replace(stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )
    assert inc[0].outputs[0].text == full.text[: full.text.index(stop) + len(stop)]
    tid = full.token_ids[4]
    by_id = llm.generate("def f(x):", base.replace(stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tid
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(tid) + 1]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_n_greater_than_one_and_seed_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, n=4, seed=11, max_tokens=12, ignore_eos=True)
    first = llm.generate("import", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    # Same seed, same request, different batch neighbours: same output.
    noise = SamplingParams(temperature=1.0, max_tokens=7)
    again = llm.generate(["a = 2", "import", "b"], [noise, params, noise], use_tqdm=False)[1]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]


def test_min_tokens_and_eos(llm: LLM) -> None:
    eos = llm.eos_token_ids[0]
    # Force EOS to be likely by asking a stop at eos; min_tokens keeps generating.
    out = llm.generate(
        "x",
        SamplingParams(temperature=0.0, min_tokens=6, max_tokens=8, stop_token_ids=[eos]),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(out.token_ids) >= 6


def test_prompt_logprobs_match_transformers(llm: LLM, llama_dir: Path) -> None:
    prompt = "for i in range(10):\n    print(i)\n" * 3
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        got = out.prompt_logprobs[pos][ids[pos]].logprob  # type: ignore[index]
        assert math.isclose(got, ref[pos - 1, ids[pos]].item(), abs_tol=1e-4)


def test_chat_applies_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected and out.prompt.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)


def test_request_that_cannot_fit_pool(llama_dir: Path) -> None:
    small = LLM(str(llama_dir), progress=False, num_kv_blocks=2, block_size=4, max_model_len=128)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate("x " * 10, SamplingParams(max_tokens=20), use_tqdm=False)
    assert not small.engine.has_unfinished()


def test_timeouts_end_requests_with_deadline_exceeded(llm: LLM) -> None:
    """The core ends a request whose deadline passed (deadline_exceeded) and serves the rest."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    before = llm.engine.scheduler.slo_stats()["deadline_expired"]
    outs = llm.generate(["a b c", "d e f"], params, timeout=[1e-9, None], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "deadline_exceeded"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 40
    assert llm.engine.scheduler.slo_stats()["deadline_expired"] == before + 1
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="timeout"):
            llm.generate("x", params, timeout=bad, use_tqdm=False)


def test_plain_greedy_rows_take_the_argmax_path_with_the_samplers_tokens(llm: LLM) -> None:
    """Rows that ask for nothing but greedy tokens skip the sampler (the runner takes the argmax
    where the logits are: on a GPU only the ids cross to the host); the tokens are the ones the
    full sampler picks when a row also asks for logprobs, in a batch that mixes both."""
    prompts = [{"prompt_token_ids": [5 + i, 40, 7 * i + 1, 99]} for i in range(6)]
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert plain.plain_greedy and not plain.replace(logprobs=0).plain_greedy
    fast = llm.generate(prompts, plain, use_tqdm=False)
    mixed = llm.generate(
        prompts, [plain.replace(logprobs=0) if i % 2 else plain for i in range(6)], use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in mixed]
