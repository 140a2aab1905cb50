"""``swiftserve bench quant``: float32 / bfloat16 / INT8 / INT4 side by side, in one run.

For each variant: weight memory, held-out perplexity (optional), single-stream time per output
token, and output throughput at batch 32; beside them the physical limit of decode, i.e. the
weight bytes one step must stream divided by the memory bandwidth measured here. All variants
are loaded together and timed in turns (round-robin), because this machine's speed drifts
by 10-30% over minutes and the ratios are what matter.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int8-lm-head": {"dtype": "bfloat16", "quantization": "int8", "quantize_lm_head": True},
    "int4-g32": {"dtype": "bfloat16", "quantization": "int4", "quant_group_size": 32},
    "int4-g64": {"dtype": "bfloat16", "quantization": "int4", "quant_group_size": 64},
    "int4-g128": {"dtype": "bfloat16", "quantization": "int4", "quant_group_size": 128},
}


def read_bandwidth_gbs(mib: int = 1024, repeats: int = 5) -> float:
    """Best-of-N read bandwidth (GB/s) of a reduction over a buffer far larger than the caches."""
    import torch

    buf = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def _single_stream(llm: Any, prompt: list[int], output_len: int, repeats: int) -> float:
    """Median time per output token (ms) of one request decoding alone."""
    from swiftserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tpots = []
    for _ in range(repeats):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        m = out.metrics
        tpots.append((m.finished_time - m.first_token_time) * 1e3 / (output_len - 1))
    return statistics.median(tpots)


def _batch_throughput(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    from swiftserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def _build(args: argparse.Namespace, name: str) -> Any:
    from swiftserve import LLM

    max_len = max(args.context_len + 1, args.input_len + args.output_len)  # a window + 1 token
    return LLM(
        args.model, progress=False, max_num_seqs=args.batch_size, max_model_len=max_len, **VARIANTS[name]
    )


def measure(
    args: argparse.Namespace, names: list[str], windows: list[list[int]] | None
) -> list[dict[str, Any]]:
    """Every variant loaded at once; timings taken round-robin so machine drift hits all alike."""
    import random

    from tqdm.auto import tqdm

    from swiftserve.tools.evaluate import engine_nll

    llms = {name: _build(args, name) for name in tqdm(names, desc="loading variants")}
    vocab = next(iter(llms.values())).engine.model_info.vocab_size
    rng = random.Random(args.bench_seed)
    prompts = [[rng.randrange(16, vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)]
    rows = {
        name: {"variant": name, "weight_bytes": llm.engine.model_info.weight_bytes}
        for name, llm in llms.items()
    }
    for name, llm in llms.items():
        llm.generate({"prompt_token_ids": prompts[0][:8]}, use_tqdm=False)  # warm-up
        if windows:
            nll, count = engine_nll(llm, windows, progress=False)
            rows[name].update(perplexity=math.exp(nll / count), perplexity_tokens=count)
    tpots: dict[str, list[float]] = {name: [] for name in names}
    for _ in tqdm(range(args.repeats), desc="single stream, round-robin"):
        for name, llm in llms.items():
            tpots[name].append(_single_stream(llm, prompts[0], args.output_len, 1))
    rates: dict[str, list[float]] = {name: [] for name in names}
    for _ in tqdm(range(args.batch_rounds), desc=f"batch {args.batch_size}, round-robin"):
        for name, llm in llms.items():
            rates[name].append(_batch_throughput(llm, prompts, args.output_len))
    for name in names:
        rows[name]["tpot_ms"] = statistics.median(tpots[name])
        rows[name]["tpot_ms_all"] = tpots[name]
        rows[name]["batch_output_tokens_per_s"] = statistics.median(rates[name])
    del llms
    gc.collect()
    return [rows[name] for name in names]


def _heldout_windows(args: argparse.Namespace) -> list[list[int]] | None:
    if args.perplexity_tokens <= 0:
        return None
    from swiftserve.engine.model_source import resolve_model
    from swiftserve.engine.tokenizer import load_tokenizer
    from swiftserve.tools.evaluate import load_text, windows_of

    tokenizer = load_tokenizer(resolve_model(args.model))
    ids = tokenizer.encode(load_text("held-out"), add_special_tokens=False)
    return windows_of(ids, args.context_len, args.perplexity_tokens)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    names = [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    from swiftserve.engine.model_source import resolve_model
    from swiftserve.model.config import ModelConfig

    # Perplexity windows of 512 tokens, or shorter where the model's positions end sooner.
    args.context_len = min(512, ModelConfig.from_dir(resolve_model(args.model)).max_position_embeddings - 1)
    bandwidth = read_bandwidth_gbs()
    windows = _heldout_windows(args)
    rows = measure(args, names, windows)
    base = next((r for r in rows if r["variant"] == "bfloat16"), rows[0])
    table = Table(title=f"bench quant: {args.model or 'demo model'} (read bandwidth {bandwidth:.1f} GB/s)")
    for col in (
        "variant",
        "weights MB",
        "perplexity",
        "ms/token",
        "limit ms",
        "speed-up*",
        f"tok/s @{args.batch_size}",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        r["limit_ms"] = r["weight_bytes"] / (bandwidth * 1e9) * 1e3
        # Paired by round: each round's ratio sees the same machine state on both sides.
        per_round = [b / v for b, v in zip(base["tpot_ms_all"], r["tpot_ms_all"], strict=True)]
        r["speedup_vs_bf16"] = statistics.median(per_round)
        r["speedup_per_round"] = per_round
        ppl = f"{r['perplexity']:.3f}" if "perplexity" in r else "-"
        table.add_row(
            r["variant"],
            f"{r['weight_bytes'] / 1e6:.1f}",
            ppl,
            f"{r['tpot_ms']:.2f}",
            f"{r['limit_ms']:.2f}",
            f"{r['speedup_vs_bf16']:.2f}x",
            f"{r['batch_output_tokens_per_s']:.0f}",
        )
    Console().print(table)
    Console().print("* speed-up vs bfloat16: median over rounds of the per-round ratio of ms/token")
    report = {
        "model": args.model,
        "read_bandwidth_gbs": bandwidth,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batch_size": args.batch_size,
        "rows": rows,
    }
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--variants", default="float32,bfloat16,int8,int4-g32,int4-g128")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="single-stream rounds (median)")
    parser.add_argument("--batch-rounds", type=int, default=2, help="batch rounds (median)")
    parser.add_argument("--perplexity-tokens", type=int, default=0, help="held-out tokens scored (0: skip)")
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
