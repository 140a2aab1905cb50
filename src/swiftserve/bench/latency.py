"""``swiftserve bench latency``: one request at a time, in process: TTFT and TPOT over repeats.

Every repeat sends a fresh random prompt: a repeated prompt would hit the prefix cache and
report a TTFT below what the machine can compute.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any


def main(args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from swiftserve import LLM, SamplingParams

    llm = LLM(args.model, **{"warm_up": True, **engine})  # steady state, as vLLM's profile run gives it
    vocab = llm.engine.model_info.vocab_size
    rng = random.Random(args.bench_seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = [rng.randrange(16, vocab) for _ in range(8)]
    llm.generate({"prompt_token_ids": warm}, SamplingParams(max_tokens=4), use_tqdm=False)
    ttft, tpot = [], []
    for _ in tqdm(range(args.repeats), desc="repeats"):
        prompt = [rng.randrange(16, vocab) for _ in range(args.input_len)]  # fresh: no cache hit
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        ttft.append((m.first_token_time - m.arrival_time) * 1000)
        tpot.append((m.finished_time - m.first_token_time) * 1000 / max(args.output_len - 1, 1))
    report = {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "ttft_ms": {"mean": statistics.fmean(ttft), "p50": statistics.median(ttft), "min": min(ttft)},
        "tpot_ms": {"mean": statistics.fmean(tpot), "p50": statistics.median(tpot), "min": min(tpot)},
    }
    print(json.dumps(report, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
