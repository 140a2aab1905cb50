"""Replay issue 18's bench trace through the real Scheduler on a simulated clock.

The trace is `swiftserve bench serve`'s own (same seeds: 60 requests, 64/1,024-token prompts
3:1, 64 output tokens, gamma arrivals with burstiness 0.3); the step cost is a fit of the
SmolLM-shape server's step log on the 2-core AMX Xeon (decode 11.3 ms + 1.1 ms a row + 1.5 ms
of loop turn; a step with prompt tokens 15 ms more + 0.24 ms a token; +-5% noise). Policies
compare in a second without the machine's noise; real runs decide.

    python docs/slo/sim_trace.py [TPOT_TARGET_S] [SEEDS]
    python docs/slo/sim_trace.py uniform [SEEDS]   # 64 x 128/128 at 4 req/s: TTFT / TPOT p50, p99
"""
import os, random, sys
from swiftserve.bench.datasets import random_dataset
from swiftserve.bench.serve import intervals
from swiftserve.core.block_manager import BlockManager
from swiftserve.core.messages import RunnerOutput
from swiftserve.core.request import Request
from swiftserve.core.scheduler import Scheduler
from swiftserve.core.slo import SLOTargets
from swiftserve.sampling_params import SamplingParams

COST = os.environ.get("SIM_COST", "slow")  # "fast": the step log of a faster hour (2026-12-06, late)


def cost(k, rows, noise):
    if COST == "fast":  # decode 13.1 ms + 0.71 ms a row; with prompt tokens 17.6 + 1.03 a row + 0.236 a token
        c = 0.0131 + 0.00071 * rows + 0.0015
        if k:
            c += 0.0045 + 0.00032 * rows + 0.000236 * k
        return c * noise
    c = 0.0113 + 0.0011 * rows + 0.0015  # decode step + the loop's turn overhead
    if k:
        c += 0.015 + 0.00024 * k
    return c * noise

def run(rate, seed, targets, budget, slo=(1.0, 0.025), n=60, verbose=False, uniform=False):
    if uniform:  # the 128/128 trace, Poisson arrivals
        reqs = random_dataset(n, "128", "128", 8000, seed)
        gaps = intervals(n, rate, 1.0, seed)
    else:
        reqs = random_dataset(n, "64:0.75,1024:0.25", "64", 8000, seed)
        gaps = intervals(n, rate, 0.3, seed)
    arrivals, t = [], 0.0
    for g in gaps:
        t += g; arrivals.append(t)
    now = [0.0]
    sched = Scheduler(BlockManager(8192, 16, enable_prefix_caching=False), max_num_seqs=256,
                      max_num_batched_tokens=budget, max_model_len=4096, targets=targets,
                      clock=lambda: now[0])
    rng = random.Random(1)
    live, done, i = {}, {}, 0
    while len(done) < n:
        while i < n and arrivals[i] <= now[0]:
            r = reqs[i]
            rq = Request(str(i), r.prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                         arrival_time=arrivals[i], max_tokens=r.output_len)
            sched.add_request(rq); live[str(i)] = rq; i += 1
        if not sched.has_unfinished():
            now[0] = arrivals[i]; continue
        out = sched.schedule()
        rows = sum(1 for it in out.scheduled if len(it.token_ids) == 1)
        s = cost(out.num_batched_tokens - rows, rows, rng.uniform(0.95, 1.08))
        now[0] += s
        sched.observe_step(out, s)
        res = RunnerOutput(sampled_token_ids={it.request_id: 7 for it in out.scheduled if it.sample})
        for o in sched.update(out, res):
            if o.finish_reason is not None:
                done[o.request_id] = live[o.request_id]
    good = 0
    ttfts, tpots = [], []
    for rq in done.values():
        ttft = rq.first_token_time - rq.arrival_time
        tpot = (rq.finished_time - rq.first_token_time) / (rq.num_output_tokens - 1)
        ttfts.append(ttft); tpots.append(tpot)
        good += ttft <= slo[0] and tpot <= slo[1]
    nt = sum(1 for r in done.values() if r.first_token_time - r.arrival_time > slo[0])
    np_ = sum(1 for r in done.values() if (r.finished_time - r.first_token_time) / (r.num_output_tokens - 1) > slo[1])
    if verbose:
        print('  fail ttft', nt, 'fail tpot', np_)
    dur = max(r.finished_time for r in done.values())
    ttfts.sort(); tpots.sort()
    return good / dur, n / dur, ttfts[n // 2], ttfts[int(0.99 * n)], tpots[n // 2], tpots[int(0.99 * n)]

def uniform_table(seeds):
    """TTFT and TPOT p50 / p99 (ms, pooled over seeds) on the uniform trace at 4 req/s."""
    configs = [("fixed2048", None), ("adaptive 300/30", SLOTargets(0.3, 0.03)),
               ("adaptive 1000/30", SLOTargets(1.0, 0.03))]
    for name, targets in configs:
        rows = [run(4.0, 1000 * s, targets, 2048, slo=(1.0, 0.03), n=64, uniform=True) for s in seeds]
        cols = [sum(r[i] for r in rows) / len(rows) * 1e3 for i in (2, 3, 4, 5)]
        worst = max(r[3] for r in rows) * 1e3
        print(f"{name:18s} TTFT p50 {cols[0]:.0f} p99 {cols[1]:.0f} (worst seed {worst:.0f}) "
              f"TPOT p50 {cols[2]:.1f} p99 {cols[3]:.1f} ms")

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "uniform":
        uniform_table(range(int(sys.argv[2]) if len(sys.argv) > 2 else 8))
        sys.exit(0)
    tp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.025
    seeds = range(int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    configs = [("fixed256", None, 256), ("fixed512", None, 512), ("fixed2048", None, 2048),
               ("adaptive", SLOTargets(1.0, tp), 2048)]
    for rate in (2.0, 4.0):
        for name, targets, budget in configs:
            # the bench's seeds: --bench-seed 0 + 1000 per rate of the sweep (2 then 4 req/s)
            gs = [run(rate, 1000 * s + (0 if rate == 2.0 else 1000), targets, budget, slo=(1.0, tp))[0] for s in seeds]
            print(f"{rate} req/s {name:10s} goodput mean {sum(gs) / len(gs):.2f} over seeds: " + " ".join(f"{g:.2f}" for g in gs))
