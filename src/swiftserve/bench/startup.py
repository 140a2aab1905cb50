"""``swiftserve bench startup``: cold start of ``serve`` and of ``LLM(...)``, median of N.

Every run is a fresh process (the OS page cache stays warm: these are process cold starts,
as an autoscaler or a restart sees them, not first-boot disk reads).
- serve: from ``Popen`` to the first 200 on /health, and to the first token of a one-token
  completion; the phase timeline of the median run is taken from the server's log.
- LLM: in a fresh interpreter, ``import torch`` + ``import swiftserve``, the ``LLM(...)``
  constructor, and the first ``generate`` of one token; to-first-token counts from the
  process's creation.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from swiftserve.bench.launch import free_port

# Self-contained (no swiftserve import before the timer starts), so that it also measures
# older checkouts (--pythonpath) that predate swiftserve.startup.
_LLM_SCRIPT = """
import json, os, sys, time
def born():
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
born = born()
t0 = time.time()
import torch
from swiftserve import LLM, SamplingParams
t1 = time.time()
llm = LLM(sys.argv[1], progress=False, **json.loads(sys.argv[2]))
t2 = time.time()
llm.generate(["def fib(n):"], SamplingParams(max_tokens=1), use_tqdm=False)
t3 = time.time()
print(json.dumps({"imports_s": t1 - t0, "llm_init_s": t2 - t1, "first_token_s": t3 - t2,
                  "to_first_token_s": t3 - born, "interpreter_s": t0 - born}))
"""
_PHASE = re.compile(r"startup\[(\w+)\]: (.+?)\s{2,}(?:(\d+) ms\s+\(done at (\d+) ms\)|at (\d+) ms)")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--targets", default="serve,llm", help="comma list of serve, llm")
    parser.add_argument("--serve-args", default="", help="extra flags for serve, e.g. '--max-model-len 512'")
    parser.add_argument(
        "--pythonpath",
        default=None,
        help="run another checkout's code in the measured processes (its src/ folder): before/after",
    )
    parser.add_argument("--output-json", default=None)


def _env(pythonpath: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return env


def _get(port: int, method: str, path: str, body: dict[str, Any] | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def phases(log_text: str) -> list[dict[str, Any]]:
    """The ``startup[...]`` lines of a log: who, phase, duration and end (ms)."""
    out = []
    for m in _PHASE.finditer(log_text):
        who, name, dur, done, at = m.groups()
        out.append(
            {
                "process": who,
                "phase": name.strip(),
                "ms": int(dur) if dur else 0,
                "end_ms": int(done or at),
            }
        )
    return out


def serve_once(
    model: str | None, dtype: str, extra: list[str], log: Path, pythonpath: str | None = None
) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "swiftserve.cli", "serve", "--port", str(port), "--dtype", dtype]
    cmd += (["--model", model] if model else []) + extra
    with open(log, "wb") as out:
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(pythonpath))
        try:
            healthy = _wait_healthy(port, proc, start)
            status = _get(port, "POST", "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 1})
            first = time.time() - start
            if status != 200:
                raise RuntimeError(f"completion answered {status}")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"to_healthy_s": healthy, "to_first_token_s": first, "phases": phases(log.read_text())}


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], start: float) -> float:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            if _get(port, "GET", "/health") == 200:
                return time.time() - start
        except OSError:
            pass
        if time.time() - start > 300:
            raise RuntimeError("server not healthy after 300 s")
        time.sleep(0.01)


def llm_once(model: str | None, dtype: str, pythonpath: str | None = None) -> dict[str, Any]:
    from swiftserve.engine.model_source import resolve_model

    path = str(resolve_model(model))
    proc = subprocess.run(
        [sys.executable, "-c", _LLM_SCRIPT, path, json.dumps({"dtype": dtype})],
        capture_output=True,
        text=True,
        env=_env(pythonpath),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"LLM run failed:\n{proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["phases"] = phases(proc.stderr)
    return result


def _median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[len(ordered) // 2]


def run(args: argparse.Namespace) -> dict[str, Any]:
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(targets) - {"serve", "llm"}
    if unknown or args.runs < 1:
        raise ValueError(f"--targets takes serve,llm (got {sorted(unknown)}); --runs must be >= 1")
    report: dict[str, Any] = {
        "model": args.model or "demo",
        "dtype": args.dtype,
        "runs": args.runs,
        "code": args.pythonpath or "this checkout",
    }
    with tempfile.TemporaryDirectory() as tmp:
        for target in targets:
            runs = []
            for i in tqdm(range(args.runs), desc=f"cold starts ({target})", unit="run"):
                if target == "serve":
                    log = Path(tmp) / f"{i}.log"
                    extra = args.serve_args.split()
                    runs.append(serve_once(args.model, args.dtype, extra, log, args.pythonpath))
                else:
                    runs.append(llm_once(args.model, args.dtype, args.pythonpath))
            keys = [k for k in runs[0] if k.endswith("_s")]
            report[target] = {
                "median": {k: statistics.median(r[k] for r in runs) for k in keys},
                "runs": [{k: r[k] for k in keys} for r in runs],
                "median_run_phases": _median_run(runs, keys[0])["phases"],
            }
    _print(report)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return report


def _print(report: dict[str, Any]) -> None:
    print(
        f"\nmodel {report['model']} ({report['dtype']}), code {report['code']}, "
        f"median of {report['runs']} cold starts"
    )
    for target in ("serve", "llm"):
        if target not in report:
            continue
        medians = report[target]["median"]
        print(
            f"  {target}: "
            + ", ".join(f"{k.removesuffix('_s')} {v * 1000:.0f} ms" for k, v in medians.items())
        )
        for p in report[target]["median_run_phases"]:
            dur = f"{p['ms']:6d} ms" if p["ms"] else "        "
            print(f"      [{p['process']:>6}] {p['phase']:<22} {dur}   done at {p['end_ms']:6d} ms")
