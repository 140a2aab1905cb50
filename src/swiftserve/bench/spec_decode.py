"""``swiftserve bench spec``: TPOT with and without speculation, side by side in one process.

Engines on the same model: ``plain``, ``ngram`` (prompt lookup) and ``draft`` (a draft model,
``--draft-model DIR``), as ``--methods`` lists them; the same fresh prompts for all in every
round (the order rotates), greedy by default. Workloads:

- ``copy``: each prompt quotes a slice of a held-out standard-library file (the demo model
  never trained on it), then starts quoting it again: the continuation is a copy, the case
  prompt lookup is made for;
- ``heldout``: a slice of a held-out file to be continued (no copy in sight): what a draft
  model trained on the same kind of text predicts;
- ``random``: random token ids, where lookups rarely match: what speculation costs when it
  fails.

Reported per batch size and method: TPOT mean (per request, first token excluded), output
tokens/s, and the acceptance figures (rate, mean acceptance length).
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
    parser.add_argument("--workload", choices=("copy", "heldout", "random"), default="copy")
    parser.add_argument("--methods", default="plain,ngram", help="engines side by side: plain,ngram,draft")
    parser.add_argument("--draft-model", default=None, help="the draft checkpoint (method draft)")
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


def copy_prompts(num: int, chars: int, seed: int, copy: bool = True) -> list[str]:
    """A held-out file's slice, then the start of the same slice again (to be continued);
    ``copy=False``: the slice alone."""
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
        prompts.append(f"{quote}\n\n# The same code again:\n{quote[: chars // 4]}" if copy else quote)
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
    specs = _specs(args)
    engines = {name: LLM(**engine, speculative_config=specs.get(name)) for name in _methods(args)}
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, seed=0)
    vocab = engines["plain"].inputs.vocab_size

    def prompts_for(num: int, seed: int) -> list[Any]:
        if args.workload in ("copy", "heldout"):
            return list(copy_prompts(num, args.quote_chars, seed, args.workload == "copy"))
        return [{"prompt_token_ids": p} for p in random_prompts(num, args.input_len, vocab, seed)]

    for llm in engines.values():  # warm-up
        llm.generate(prompts_for(2, args.bench_seed + 999), params, use_tqdm=False)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        names = list(engines)
        for r in range(args.rounds):
            prompts = prompts_for(batch, args.bench_seed + 1000 * r + batch)
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
                runs[name].append(_measure(engines[name], prompts, params))
        rows.append(_summarise(batch, runs))
        row = rows[-1]
        line = f"{args.workload} batch {batch}: TPOT plain {row['tpot_plain_ms']:.2f} ms"
        line += f", tok/s {row['tok_s_plain']:.1f}"
        for name in names[1:]:
            line += (
                f"; {name} {row[f'tpot_{name}_ms']:.2f} ms ({row[f'tpot_speedup_{name}']:.2f}x), tok/s "
                f"{row[f'tok_s_{name}']:.1f}, acceptance {row[f'acceptance_rate_{name}']:.2f}, mean length "
                f"{row[f'mean_acceptance_length_{name}']:.2f}"
            )
        print(line)
    if args.output_json:
        report = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "spec": specs, "rows": rows}
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))


def _methods(args: argparse.Namespace) -> list[str]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or methods[0] != "plain" or not set(methods) <= {"plain", "ngram", "draft"}:
        raise SystemExit("--methods: 'plain' first, then any of ngram, draft")
    if "draft" in methods and not args.draft_model:
        raise SystemExit("--methods draft needs --draft-model DIR")
    return methods


def _specs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    k = args.num_speculative_tokens
    return {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        },
        "draft": {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k},
    }


def _summarise(batch: int, runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    row: dict[str, Any] = {
        "batch": batch,
        "tpot_plain_ms": med["plain"]["tpot_ms"],
        "tok_s_plain": med["plain"]["tok_s"],
        "runs": runs,
    }
    for name, spec in runs.items():
        if name == "plain":
            continue
        drafts = sum(r["drafts"] for r in spec)
        proposed = sum(r["draft_tokens"] for r in spec)
        accepted = sum(r["accepted"] for r in spec)
        row[f"tpot_{name}_ms"] = med[name]["tpot_ms"]
        row[f"tpot_speedup_{name}"] = med["plain"]["tpot_ms"] / med[name]["tpot_ms"]
        row[f"tok_s_{name}"] = med[name]["tok_s"]
        row[f"acceptance_rate_{name}"] = accepted / proposed if proposed else 0.0
        row[f"mean_acceptance_length_{name}"] = 1 + accepted / drafts if drafts else 0.0
        row[f"draft_tokens_{name}"] = proposed
    return row
