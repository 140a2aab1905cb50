"""``swiftserve bench spec``: TPOT with and without n-gram speculation, side by side in one process.

Two engines on the same model (one with ``speculative_config``), the same fresh prompts for
both in every round (which one runs first alternates), greedy by default. Workloads:

- ``copy``: each prompt quotes a slice of a held-out standard-library file (the demo model
  never trained on it), then starts quoting it again: the continuation is a copy, the case
  prompt lookup is made for;
- ``random``: random token ids, where lookups rarely match: what speculation costs when it
  fails.

Reported per batch size: TPOT mean (per request, first token excluded), output tokens/s, and
the acceptance figures of the speculative engine (rate, mean acceptance length).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from swiftserve.bench.throughput import random_prompts


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("copy", "random"), default="copy")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--quote-chars", type=int, default=900, help="copy: characters quoted from a file")
    parser.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def copy_prompts(num: int, chars: int, seed: int) -> list[str]:
    """A held-out file's slice, then the start of the same slice again (to be continued)."""
    from swiftserve.tools.corpus import split_files

    _, heldout = split_files()
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < num:
        text = rng.choice(heldout).read_text(encoding="utf-8", errors="replace")
        if len(text) < chars + 100:
            continue
        start = rng.randrange(0, len(text) - chars)
        quote = text[start : start + chars]
        prompts.append(f"{quote}\n\n# The same code again:\n{quote[: chars // 4]}")
    return prompts


def _measure(llm: Any, prompts: list[Any], params: Any) -> dict[str, float]:
    before = llm.engine.scheduler.spec.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tpots = []
    for out in outs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if m and m.first_token_time is not None and m.finished_time is not None and n > 1:
            tpots.append((m.finished_time - m.first_token_time) * 1e3 / (n - 1))
    after = llm.engine.scheduler.spec.stats()
    delta = {k: after[k] - before[k] for k in after}
    return {
        "tpot_ms": statistics.fmean(tpots),
        "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
        "drafts": delta["spec_decode_num_drafts"],
        "draft_tokens": delta["spec_decode_num_draft_tokens"],
        "accepted": delta["spec_decode_num_accepted_tokens"],
    }


def run(args: argparse.Namespace) -> None:
    from swiftserve import LLM, SamplingParams
    from swiftserve.cli_args import engine_kwargs

    engine = engine_kwargs(args)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    engines = {"plain": LLM(**engine), "ngram": LLM(**engine, speculative_config=spec)}
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, seed=0)
    vocab = engines["plain"].inputs.vocab_size

    def prompts_for(num: int, seed: int) -> list[Any]:
        if args.workload == "copy":
            return list(copy_prompts(num, args.quote_chars, seed))
        return [{"prompt_token_ids": p} for p in random_prompts(num, args.input_len, vocab, seed)]

    for llm in engines.values():  # warm-up
        llm.generate(prompts_for(2, args.bench_seed + 999), params, use_tqdm=False)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "ngram": []}
        for r in range(args.rounds):
            prompts = prompts_for(batch, args.bench_seed + 1000 * r + batch)
            order = ["plain", "ngram"] if r % 2 == 0 else ["ngram", "plain"]
            for name in order:
                runs[name].append(_measure(engines[name], prompts, params))
        rows.append(_summarise(batch, runs))
        row = rows[-1]
        print(
            f"{args.workload} batch {batch}: TPOT plain {row['tpot_plain_ms']:.2f} ms, ngram "
            f"{row['tpot_ngram_ms']:.2f} ms ({row['tpot_speedup']:.2f}x); tok/s {row['tok_s_plain']:.1f} vs "
            f"{row['tok_s_ngram']:.1f}; acceptance {row['acceptance_rate']:.2f}, mean length "
            f"{row['mean_acceptance_length']:.2f}"
        )
    if args.output_json:
        report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "spec": spec, "rows": rows}
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))


def _summarise(batch: int, runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    spec = runs["ngram"]
    drafts = sum(r["drafts"] for r in spec)
    proposed = sum(r["draft_tokens"] for r in spec)
    accepted = sum(r["accepted"] for r in spec)
    return {
        "batch": batch,
        "tpot_plain_ms": med["plain"]["tpot_ms"],
        "tpot_ngram_ms": med["ngram"]["tpot_ms"],
        "tpot_speedup": med["plain"]["tpot_ms"] / med["ngram"]["tpot_ms"],
        "tok_s_plain": med["plain"]["tok_s"],
        "tok_s_ngram": med["ngram"]["tok_s"],
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "draft_tokens": proposed,
        "runs": runs,
    }
