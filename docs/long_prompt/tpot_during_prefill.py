"""TPOT of running requests while a long prompt is prefilled (issue 24's last figure).

Against a running server (``swiftserve serve --model /tmp/smol16k --dtype bfloat16
--max-model-len 16384 --served-model-name smollm --port PORT``): four streaming requests
decode; two seconds in, one prompt of N random tokens arrives; inter-token gaps of the four
are split into before it arrived and while it was being prefilled (until its first token).
Usage: python tpot_during_prefill.py http://127.0.0.1:PORT [N] [OUT.json]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import threading
import time

import httpx


def stream(url: str, prompt: list[int], max_tokens: int, stamps: list[float]) -> None:
    body = {"model": "smollm", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())


def main() -> None:
    url = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 12000
    rng = random.Random(0)
    runners: list[list[float]] = [[] for _ in range(4)]
    threads = [
        threading.Thread(target=stream, args=(url, [rng.randrange(16, 8000) for _ in range(128)], 2000, s))
        for s in runners
    ]
    for t in threads:
        t.start()
    time.sleep(2.0)
    sent = time.perf_counter()
    first: list[float] = []
    stream(url, [rng.randrange(16, 8000) for _ in range(n)], 1, first)
    done = first[0] if first else time.perf_counter()
    time.sleep(1.0)

    def gaps(lo: float, hi: float) -> list[float]:
        out = []
        for stamps in runners:
            out += [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:]) if lo <= a and b <= hi]
        return out

    before, during = gaps(sent - 1.5, sent), gaps(sent, done)
    report = {
        "prompt_tokens": n,
        "ttft_s": done - sent,
        "before_ms": {"mean": statistics.fmean(before), "max": max(before), "n": len(before)},
        "during_ms": {"mean": statistics.fmean(during), "max": max(during), "n": len(during)},
    }
    print(json.dumps(report, indent=1))
    if len(sys.argv) > 3:
        json.dump(report, open(sys.argv[3], "w"), indent=1)
    os._exit(0)  # the four streams are still running; the server ends them when we go


if __name__ == "__main__":
    main()
