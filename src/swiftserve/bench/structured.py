"""``swiftserve bench structured``: what a JSON schema costs, side by side in one process.

At each batch size the same seeded random prompts run free (``ignore_eos``) and under a JSON
schema whose outputs are longer than ``--output-len`` (an array of at least 64 records), so
both runs produce exactly ``output_len`` tokens per request and tokens/s compare like for
like. Rounds alternate which runs first. Also reported: building a typical schema's grammar
(cold, in a fresh compiler) and handing out a cached one, and the llguidance tokenizer setup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from swiftserve.bench.throughput import random_prompts

# Every request runs to max_tokens: at least 64 records never fit in the default 128 tokens.
LONG_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["id", "name", "tags", "score"],
        "additionalProperties": False,
    },
}
# A typical request schema, for the compile-time figure.
TYPICAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[^@]+@[^@]+$"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "status": {"enum": ["active", "inactive"]},
    },
    "required": ["name", "age", "email", "address", "status"],
}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="free / schema alternations per batch size")
    parser.add_argument("--bench-seed", dest="bench_seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def _tokens_per_s(llm: Any, prompts: list[list[int]], params: Any, output_len: int) -> float:
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for out in outs:  # like for like: every request made exactly output_len tokens
        assert len(out.outputs[0].token_ids) == output_len, out.outputs[0].finish_reason
    return len(prompts) * output_len / elapsed


def compile_times(llm: Any, repeats: int = 5) -> dict[str, float]:
    """ms to set up llguidance's tokenizer, build TYPICAL_SCHEMA cold, and get it cached."""
    from swiftserve.sampling_params import StructuredOutputsParams
    from swiftserve.structured.grammar import GrammarCompiler, tokenizer_json

    tok = llm.get_tokenizer()
    spec = StructuredOutputsParams(json=TYPICAL_SCHEMA)
    cold, setup = [], []
    for _ in range(repeats):
        compiler = GrammarCompiler(
            lambda: tokenizer_json(tok.backend_tokenizer), llm.inputs.vocab_size, llm.eos_token_ids
        )
        t0 = time.perf_counter()
        _ = compiler.tokenizer
        t1 = time.perf_counter()
        compiler.matcher(spec)
        t2 = time.perf_counter()
        setup.append((t1 - t0) * 1e3)
        cold.append((t2 - t1) * 1e3)
    t0 = time.perf_counter()
    for _ in range(100):
        compiler.matcher(spec)
    cached = (time.perf_counter() - t0) * 1e3 / 100
    return {
        "tokenizer_setup_ms": statistics.median(setup),
        "schema_compile_ms": statistics.median(cold),
        "schema_cached_ms": cached,
    }


def run(args: argparse.Namespace) -> None:
    from swiftserve import LLM, SamplingParams
    from swiftserve.cli_args import engine_kwargs
    from swiftserve.sampling_params import StructuredOutputsParams

    llm = LLM(**engine_kwargs(args))
    vocab = llm.inputs.vocab_size
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    schema = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA),
    )
    warm = random_prompts(2, args.input_len, vocab, args.bench_seed + 99)
    _tokens_per_s(llm, warm, free, args.output_len)
    _tokens_per_s(llm, warm, schema, args.output_len)  # the grammar is built once, here
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs: dict[str, list[float]] = {"free": [], "schema": []}
        for r in range(args.rounds):
            prompts = random_prompts(batch, args.input_len, vocab, args.bench_seed + 1000 * r + batch)
            order = [("free", free), ("schema", schema)]
            for name, params in order if r % 2 == 0 else order[::-1]:  # cancel order effects
                runs[name].append(_tokens_per_s(llm, prompts, params, args.output_len))
        f, s = statistics.median(runs["free"]), statistics.median(runs["schema"])
        rows.append(
            {"batch": batch, "free_tok_s": f, "schema_tok_s": s, "cost_pct": (1 - s / f) * 100, "runs": runs}
        )
        print(f"batch {batch:3d}: free {f:8.1f} tok/s  schema {s:8.1f} tok/s  cost {(1 - s / f) * 100:5.1f}%")
    times = compile_times(llm)
    print(
        f"llguidance tokenizer setup {times['tokenizer_setup_ms']:.1f} ms; typical schema: "
        f"compile {times['schema_compile_ms']:.2f} ms, cached {times['schema_cached_ms']:.3f} ms"
    )
    if args.output_json:
        report = {
            "model": args.model,
            "args": {k: v for k, v in vars(args).items() if k != "func"},
            "rows": rows,
            **times,
        }
        Path(args.output_json).write_text(json.dumps(report, indent=2, default=str))
