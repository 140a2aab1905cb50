"""Sync vs async scheduling vs async + busy-poll, side by side, rounds interleaved.

    .venv/bin/python docs/async/compare.py --model /tmp/smol --rounds 3

Every (round, mode) runs in a fresh process: two engines in one process interfere (each
thread that computes keeps its own OpenMP team, spinning after its parallel regions).
Per mode: single-stream TPOT (fresh prompts), offline throughput (N x in/out, ignore_eos),
and the engine thread's wake-up delay after a step ends (async modes only).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

MODES = {
    "sync": {},
    "async": {"async_scheduling": True},
    "async+busy-poll": {"async_scheduling": True, "busy_poll": True},
}


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One mode in this process: TPOT (median of repeats), throughput, wake-up delays."""
    from swiftserve import LLM, SamplingParams

    llm = LLM(args.model, progress=False, num_threads=args.num_threads, **MODES[args.one])  # type: ignore[arg-type]
    vocab = llm.engine.model_info.vocab_size
    rng = random.Random(args.bench_seed)  # the same prompts for every mode within a round
    llm.generate({"prompt_token_ids": [20] * 8}, SamplingParams(max_tokens=4), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    tpots = []
    for _ in range(args.repeats):
        prompt = [rng.randrange(16, vocab) for _ in range(args.input_len)]
        m = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        tpots.append((m.finished_time - m.first_token_time) * 1000 / (args.output_len - 1))
    prompts = [
        {"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(args.input_len)]}
        for _ in range(args.batch)
    ]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    tok_s = args.batch * args.output_len / (time.perf_counter() - start)
    return {"tpot_ms": statistics.median(tpots), "tok_s": tok_s, **llm.engine.wakeup_stats()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args)))
        return
    modes = args.modes.split(",")
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else list(reversed(modes)):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", mode, "--bench-seed", str(1000 + r)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(mode, r, rows[mode][-1], flush=True)
    report = {}
    for mode, runs in rows.items():
        report[mode] = {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]} | {
            "tpot_ms_rounds": [round(run["tpot_ms"], 3) for run in runs]
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
