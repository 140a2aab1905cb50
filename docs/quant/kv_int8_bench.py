"""INT8 KV cache vs the bfloat16 cache: held-out perplexity and decode TPOT at long context.

    .venv/bin/python docs/quant/kv_int8_bench.py --ppl-model src/swiftserve/demo_model \
        --speed-model /tmp/smol16k --context 4096 --rounds 3

Perplexity: prompt logprobs over held-out windows, chunked 16 tokens a step so that every
chunk after the first attends to the context through the cache (a whole window in one step
would read only its own fresh K/V and show no effect of the cache's precision). Speed: one or
more requests with a fresh random prompt of ``--context`` tokens (run once first for one token,
so the timed run finds it in the prefix cache and decodes alone), 64 tokens decoded; TPOT from
the engine's timestamps; the two caches alternate round by round in one process.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics

from swiftserve import LLM, SamplingParams

CACHES = ("auto", "int8")


def perplexity(model: str, tokens: int, context: int) -> dict[str, float]:
    from swiftserve.engine.model_source import resolve_model
    from swiftserve.engine.tokenizer import load_tokenizer
    from swiftserve.tools.evaluate import engine_nll, load_text, windows_of

    ids = load_tokenizer(resolve_model(model)).encode(load_text("held-out"), add_special_tokens=False)
    windows = windows_of(ids, context, tokens)
    out = {}
    for kv in CACHES:
        llm = LLM(model, dtype="bfloat16", kv_cache_dtype=kv, max_num_batched_tokens=16, progress=False)
        nll, count = engine_nll(llm, windows, progress=False)
        out[kv] = math.exp(nll / count)
    return out


def tpot(llm: LLM, rng: random.Random, context: int, batch: int) -> float:
    vocab = llm.engine.model_info.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(context)]} for _ in range(batch)]
    # the prompts once first (one token): the timed run finds them in the prefix cache, so its
    # decode steps do not share the machine with other requests' prompt chunks
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    values = []
    for o in outs:
        m = o.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        values.append((m.finished_time - m.first_token_time) * 1000 / 63)
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ppl-model", default=None)
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--ppl-context", type=int, default=256)
    parser.add_argument("--speed-model", default=None)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", default=None, help="weights too (int8: the KV share grows)")
    args = parser.parse_args()
    report: dict[str, object] = {}
    if args.ppl_model:
        report["perplexity"] = perplexity(args.ppl_model, args.ppl_tokens, args.ppl_context)
        print(report, flush=True)
    if args.speed_model:
        batches = [int(b) for b in args.batches.split(",")]
        llms = {
            kv: LLM(args.speed_model, dtype="bfloat16", kv_cache_dtype=kv, quantization=args.quantization,
                    max_model_len=args.context + 128, max_num_seqs=max(batches), progress=False,
                    kv_cache_memory=4 * 2**30)
            for kv in CACHES
        }  # fmt: skip
        rows: dict[str, list[float]] = {f"{kv} b{b}": [] for kv in CACHES for b in batches}
        for r in range(args.rounds):
            for kv in CACHES if r % 2 == 0 else reversed(CACHES):
                for b in batches:
                    rows[f"{kv} b{b}"].append(tpot(llms[kv], random.Random(r * 10 + b), args.context, b))
                    print(kv, b, r, rows[f"{kv} b{b}"][-1], flush=True)
        report["tpot_ms"] = {k: statistics.median(v) for k, v in rows.items()}
        report["tpot_ms_rounds"] = rows
        report["ratio_int8_vs_auto"] = {
            f"b{b}": report["tpot_ms"][f"int8 b{b}"] / report["tpot_ms"][f"auto b{b}"]
            for b in batches  # type: ignore[index]
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
