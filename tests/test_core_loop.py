"""The engine loop defends itself: a request it cannot apply fails alone, the loop goes on."""

from __future__ import annotations

from pathlib import Path

import msgspec

from swiftserve import LLM, SamplingParams
from swiftserve.core.messages import FINISH_REJECTED, Add, EngineCoreRequest
from swiftserve.engine.core_loop import decode_command, encode


def test_bad_request_is_rejected_alone_and_the_engine_keeps_serving(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), progress=False, max_model_len=64)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    bad = [  # values the frontend would refuse; here they reach the core directly
        EngineCoreRequest("a#0", [1, 2, 3], params, 2, priority=2**40),
        EngineCoreRequest("a#1", [1, 2, 3], params, 2),
    ]
    rejected = llm.loop.apply(Add(bad))
    assert [(o.request_id, o.finish_reason) for o in rejected] == [
        ("a#0", FINISH_REJECTED),
        ("a#1", FINISH_REJECTED),
    ]
    assert not llm.engine.has_unfinished()  # all or nothing: the good sibling was not left queued
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_undecodable_command_fails_only_the_requests_it_names() -> None:
    good = msgspec.to_builtins(Add([EngineCoreRequest("r1", [1, 2], SamplingParams(), 4)]))
    good["requests"][0]["sampling_params"]["seed"] = -1  # encodes, but SamplingParams refuses it
    command, rejected = decode_command(encode(good))
    assert command is None and [o.request_id for o in rejected] == ["r1"]
    command, rejected = decode_command(b"\xc1 not msgpack")
    assert command is None and rejected == []
