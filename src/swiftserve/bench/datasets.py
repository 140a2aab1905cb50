"""Request datasets for ``bench serve``: random, synthetic-chat, shared-prefix, JSONL.

Prompts are token-id lists (exact lengths, sent as OpenAI ``prompt`` token arrays) except for
JSONL files, whose text is sent as is. All generation is seeded.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    output_len: int
    priority: int = 0
    timeout: float | None = None  # seconds, sent as the request's ``timeout``


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(16, vocab) for _ in range(n)]


def _length(spec: str, rng: random.Random) -> int:
    """'128', a range '64-256' (uniform), or a weighted mix '64:0.8,1024:0.2' of either."""
    if ":" in spec:
        parts = [part.split(":") for part in spec.split(",")]
        lengths, weights = [p[0] for p in parts], [float(p[1]) for p in parts]
        return _length(rng.choices(lengths, weights)[0], rng)
    if "-" in spec:
        lo, hi = (int(x) for x in spec.split("-", 1))
        return rng.randint(lo, hi)
    return int(spec)


def random_dataset(n: int, input_len: str, output_len: str, vocab: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i, o = _length(input_len, rng), _length(output_len, rng)
        out.append(BenchRequest(_ids(rng, i, vocab), i, o))
    return out


def synthetic_chat(
    n: int, mean_in: float, mean_out: float, vocab: int, seed: int, sigma: float = 0.8, max_len: int = 1024
) -> list[BenchRequest]:
    """Lognormal lengths with the given means (ShareGPT-like shape)."""
    rng = random.Random(seed)

    def draw(mean: float) -> int:
        mu = math.log(mean) - sigma**2 / 2
        return max(1, min(max_len, int(rng.lognormvariate(mu, sigma))))

    return [
        BenchRequest(_ids(rng, i, vocab), i, o)
        for i, o in ((draw(mean_in), draw(mean_out)) for _ in range(n))
    ]


def shared_prefix(
    n: int, groups: int, prefix_len: int, suffix_len: int, output_len: int, vocab: int, seed: int
) -> list[BenchRequest]:
    """G groups; every prompt is its group's P-token prefix plus a random suffix."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(groups)]
    out = []
    for k in range(n):
        prompt = prefixes[k % groups] + _ids(rng, suffix_len, vocab)
        out.append(BenchRequest(prompt, len(prompt), output_len))
    rng.shuffle(out)
    return out


def jsonl_dataset(path: str, n: int, output_len: int) -> list[BenchRequest]:
    """Lines of {"prompt": str, "output_len"?: int}; cycled to n requests."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no prompts")
    out = []
    for k in range(n):
        row = rows[k % len(rows)]
        text = row["prompt"]
        out.append(BenchRequest(text, len(text.split()), int(row.get("output_len", output_len))))
    return out


def parse_priority_mix(spec: str | None) -> list[tuple[float, int]]:
    """'0.2:0,0.8:5' -> [(0.2, 0), (0.8, 5)] (fractions must sum to 1)."""
    if not spec:
        return [(1.0, 0)]
    mix = []
    for part in spec.split(","):
        frac, prio = part.split(":")
        mix.append((float(frac), int(prio)))
    if abs(sum(f for f, _ in mix) - 1.0) > 1e-6:
        raise ValueError(f"--priority-mix fractions must sum to 1, got {spec!r}")
    return mix


def assign_priorities(
    requests: list[BenchRequest], mix: list[tuple[float, int]], seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed + 1)
    out = []
    for r in requests:
        x, acc, prio = rng.random(), 0.0, mix[-1][1]
        for frac, p in mix:
            acc += frac
            if x < acc:
                prio = p
                break
        out.append(BenchRequest(r.prompt, r.prompt_len, r.output_len, prio, r.timeout))
    return out


def assign_timeouts(requests: list[BenchRequest], spec: str | None, seed: int) -> list[BenchRequest]:
    """``FRACTION:SECONDS``: that share of requests (drawn with the seed) carry that timeout."""
    if not spec:
        return requests
    fraction, seconds = (float(x) for x in spec.split(":"))
    rng = random.Random(seed + 2)
    return [
        BenchRequest(r.prompt, r.prompt_len, r.output_len, r.priority, seconds)
        if rng.random() < fraction
        else r
        for r in requests
    ]
