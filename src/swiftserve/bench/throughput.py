"""``swiftserve bench throughput``: offline generation throughput, ours vs transformers.

Random-token prompts (seeded), fixed input and output lengths (ignore_eos), the whole set
submitted at once. The transformers baseline runs ``generate`` in static batches with
left padding, the usual way people serve with it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids where the special tokens live.
    return [[rng.randrange(16, vocab_size) for _ in range(length)] for _ in range(num)]


def run_swiftserve(
    model: str, prompts: list[list[int]], output_len: int, engine: dict[str, Any]
) -> dict[str, Any]:
    from swiftserve import LLM, SamplingParams

    llm = LLM(model, **{"warm_up": True, **engine})  # steady state, as vLLM's profile run gives it
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    ttft, tpot = [], []
    for out in outs:
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        assert n == output_len, f"expected {output_len} tokens, got {n}"
        if m and m.first_token_time is not None and m.finished_time is not None:
            ttft.append((m.first_token_time - m.arrival_time) * 1e3)
            if n > 1:
                tpot.append((m.finished_time - m.first_token_time) * 1e3 / (n - 1))
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
        "ttft_ms_p50": statistics.median(ttft) if ttft else None,
        "tpot_ms_mean": statistics.fmean(tpot) if tpot else None,
        "num_preemptions": llm.engine.scheduler.num_preemptions,
    }


def run_hf(
    model: str, prompts: list[list[int]], output_len: int, dtype: str, batch_size: int
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    pad = 0

    def run_batch(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad,
            )
        return int((out.shape[1] - width) * len(batch))

    run_batch([prompts[0][:8]])  # warm-up
    start = time.perf_counter()
    produced = 0
    for i in tqdm(range(0, len(prompts), batch_size), desc="transformers batches"):
        produced += run_batch(prompts[i : i + batch_size])
    return {
        "elapsed_s": time.perf_counter() - start,
        "output_tokens": produced,
        "hf_batch_size": batch_size,
    }


def main(args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    """Run each backend named in --backend (comma-separated) on the same prompts, in one run."""
    backends = [b.strip() for b in args.backend.split(",")]
    unknown = set(backends) - {"swiftserve", "hf"}
    if unknown:
        raise ValueError(f"--backend: unknown {sorted(unknown)}; use swiftserve, hf or both")
    # Rounds alternate the backends (A B A B ...): this machine's speed drifts by tens of
    # percent within minutes, so one A-then-B pair can land on either side of a drift.
    rounds = [[_run_one(args, engine, backend) for backend in backends] for _ in range(args.rounds)]
    if len(backends) == 1 and args.rounds == 1:
        result = rounds[0][0]
    else:
        ratios = [r[0]["output_tokens_per_s"] / r[-1]["output_tokens_per_s"] for r in rounds]
        result = {
            "runs": [run for r in rounds for run in r],
            "ratio_output_tokens_per_s": statistics.median(ratios),
            "ratios_per_round": ratios,
        }
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


def _run_one(args: argparse.Namespace, engine: dict[str, Any], backend: str) -> dict[str, Any]:
    from swiftserve.engine.model_source import resolve_model
    from swiftserve.model.config import ModelConfig

    model = str(resolve_model(args.model))
    vocab = ModelConfig.from_dir(model).vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    if backend == "swiftserve":
        result = run_swiftserve(model, prompts, args.output_len, {**engine, "dtype": args.dtype})
    else:
        result = run_hf(model, prompts, args.output_len, args.dtype, args.hf_batch_size)
    total_tokens = result["output_tokens"] + args.num_prompts * args.input_len
    return {
        "backend": backend,
        "model": model,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        **result,
        "output_tokens_per_s": result["output_tokens"] / result["elapsed_s"],
        "total_tokens_per_s": total_tokens / result["elapsed_s"],
        "requests_per_s": args.num_prompts / result["elapsed_s"],
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--backend",
        default="swiftserve",
        help="swiftserve, hf, or both comma-separated (run side by side, with a ratio)",
    )
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="alternate the backends this many times")
    parser.add_argument("--bench-seed", dest="seed", type=int, default=0)
    parser.add_argument("--output-json", type=str, default=None)
