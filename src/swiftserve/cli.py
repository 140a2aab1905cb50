"""``swiftserve`` command line: serve | generate | bench | eval | train-demo | random-model."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from swiftserve.cli_args import add_engine_args, add_server_args, engine_kwargs, server_settings


def _generate(args: argparse.Namespace) -> int:
    from swiftserve import LLM, SamplingParams

    llm = LLM(args.model, **{k: v for k, v in engine_kwargs(args).items() if k != "model"})
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        print(f"--- prompt: {out.prompt!r}")
        print(out.outputs[0].text)
        done = out.outputs[0]
        print(f"--- finish_reason: {done.finish_reason}, tokens: {len(done.token_ids)}")
    return 0


def _random_model(args: argparse.Namespace) -> int:
    from swiftserve.tools.demo import write_random_checkpoint

    path = write_random_checkpoint(
        args.out,
        preset=args.preset,
        architecture=args.arch,
        dtype=args.model_dtype,
        seed=args.model_seed,
    )
    print(f"wrote {args.preset} ({args.arch}, {args.model_dtype}) to {path}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from swiftserve.bench import throughput

    engine = {k: v for k, v in engine_kwargs(args).items() if k not in ("model", "dtype")}
    throughput.main(args, engine)
    return 0


def _eval_perplexity(args: argparse.Namespace) -> int:
    from swiftserve.tools import evaluate

    evaluate.main(args, {k: v for k, v in engine_kwargs(args).items() if k != "model"})
    return 0


def _train_demo(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from swiftserve.engine.model_source import demo_model_dir
    from swiftserve.tools.train_demo import PRESETS, train_demo

    cfg = PRESETS[args.preset]
    overrides = {k: getattr(args, k) for k in ("steps", "seed", "threads") if getattr(args, k) is not None}
    target = args.target or (str(demo_model_dir()) if args.preset == "draft" else None)
    train_demo(args.out, replace(cfg, **overrides), tokenizer_from=target)
    if args.preset == "draft":
        spec = json.dumps({"model": str(args.out), "num_speculative_tokens": 3})
        print(f"use it with: swiftserve serve --model {target} --speculative-config '{spec}'")
    else:
        print(f"use it with: swiftserve serve --model {args.out}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from swiftserve.server.launcher import run_server

    kwargs = engine_kwargs(args)
    if kwargs.get("node_rank"):  # another machine of a pipeline: its stages only, no API
        from swiftserve.config import EngineConfig
        from swiftserve.worker.stage_process import run_headless

        return run_headless(EngineConfig(**kwargs))
    return run_server(server_settings(args), kwargs)


def _bench_latency(args: argparse.Namespace) -> int:
    from swiftserve.bench import latency

    latency.main(args, {k: v for k, v in engine_kwargs(args).items() if k != "model"})
    return 0


def _bench_entry(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A handler that imports ``swiftserve.bench.<module>`` only when run, then calls ``function``."""

    def run(args: argparse.Namespace) -> int:
        getattr(importlib.import_module(f"swiftserve.bench.{module}"), function)(args)
        return 0

    return run


# (subcommand, module in swiftserve.bench with add_args(parser), help,
#  handler or the name of the module's function that takes the parsed args, engine flags?)
_BENCHES: list[tuple[str, str, str, Callable[[argparse.Namespace], int] | str, bool]] = [
    ("throughput", "throughput", "offline throughput, ours or transformers", _bench, True),
    ("latency", "latency", "single request in process: TTFT and TPOT over repeats", _bench_latency, True),
    ("serve", "serve", "load generator against an OpenAI-compatible server", "main", False),
    ("reliability", "reliability", "overload, cancellation, death and loop-lag figures", "run", False),
    ("batcher", "batching", "adaptive vs fixed batching windows on a bursty trace", "run", False),
    ("quant", "quant", "float32 / bfloat16 / INT8 / INT4: memory, perplexity, speed", "run", False),
    ("startup", "startup", "cold start: serve to healthy / first token, LLM(...)", "run", False),
    ("dashboard", "dashboard", "serving latency with the dashboard open vs closed", "main", False),
    ("embed", "embed", "/v1/embeddings load (bursty, steady) against several servers", "main", False),
    ("spec", "spec_decode", "TPOT with and without n-gram speculation (copy-heavy or random)", "run", True),
    ("structured", "structured", "tokens/s free vs under a JSON schema; schema compile time", "run", True),
]


def _wanted(argv: list[str] | None, command: str, name: str | None = None) -> bool:
    """Whether argv may select ``command`` (and subcommand ``name``): the flags of other
    subcommands are not built, so ``serve`` never imports the benchmark modules (httpx,
    numpy...), which took ~0.5 s of every server's start."""
    if argv is None:
        return True
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] != command:
        return not words  # no subcommand yet: build everything for the help text
    return name is None or len(words) < 2 or words[1] == name


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line; with ``argv``, only the selected subcommand's flags are built."""
    parser = argparse.ArgumentParser(prog="swiftserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=_generate)

    rnd = sub.add_parser("random-model", help="write a seeded random checkpoint (HF layout)")
    rnd.add_argument("out")
    rnd.add_argument("--preset", default="smollm-135m")
    rnd.add_argument("--arch", default="llama", choices=("llama", "qwen2", "mistral"))
    rnd.add_argument("--model-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    rnd.add_argument("--model-seed", type=int, default=0)
    rnd.set_defaults(func=_random_model)

    train = sub.add_parser("train-demo", help="train the demo model on the stdlib (about 13 min, 2 cores)")
    train.add_argument("--out", required=True, help="checkpoint directory to write")
    train.add_argument(
        "--preset",
        choices=("demo", "draft"),
        default="demo",
        help="demo: the 12M demo model; draft: a 2-layer draft for speculative decoding (its tokenizer "
        "taken from --target, default the bundled demo model)",
    )
    train.add_argument("--target", default=None, help="draft preset: the target checkpoint (tokenizer)")
    train.add_argument("--steps", type=int, default=None, help="optimiser steps (default 600)")
    train.add_argument("--seed", type=int, default=None)
    train.add_argument(
        "--threads", type=int, default=None, help="torch threads (default 2; results depend on it)"
    )
    train.set_defaults(func=_train_demo)

    evl = sub.add_parser("eval", help="evaluations")
    eval_sub = evl.add_subparsers(dest="eval_command", required=True)
    ppl = eval_sub.add_parser("perplexity", help="perplexity from the engine's prompt logprobs")
    add_engine_args(ppl)
    if _wanted(argv, "eval"):
        importlib.import_module("swiftserve.tools.evaluate").add_args(ppl)
    ppl.set_defaults(func=_eval_perplexity)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(srv)
    add_server_args(srv)
    srv.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, help_text, func, engine_flags in _BENCHES:
        parser_ = bench_sub.add_parser(name, help=help_text)
        if not _wanted(argv, "bench", name):
            continue
        if engine_flags:
            add_engine_args(parser_)
        importlib.import_module(f"swiftserve.bench.{module}").add_args(parser_)
        parser_.set_defaults(func=_bench_entry(module, func) if isinstance(func, str) else func)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "dtype", None) is None and hasattr(args, "dtype"):
        args.dtype = "auto"
    try:
        return int(args.func(args))
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
