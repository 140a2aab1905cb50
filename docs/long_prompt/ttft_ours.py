import json, random, sys, time

if __name__ == "__main__":
    from swiftserve import LLM, SamplingParams

    # optional: key=value engine options after the output path, e.g. prompt_tiles=0
    opts = {k: int(v) if v.isdigit() else v for k, v in (a.split("=", 1) for a in sys.argv[2:])}
    llm = LLM(model="/tmp/smol16k", dtype="bfloat16", max_model_len=16384, enable_prefix_caching=False, **{"warm_up": True, **opts})
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 64}], sp, use_tqdm=False)
    out = {}
    for n in (1024, 4096, 12000, 16000):
        times = []
        for r in range(2):
            rng = random.Random(1000 * n + r)
            p = {"prompt_token_ids": [rng.randrange(16, 8000) for _ in range(n)]}
            t = time.perf_counter()
            llm.generate([p], sp, use_tqdm=False)
            times.append(time.perf_counter() - t)
        out[n] = times
        print("ours", n, [f"{x:.2f}" for x in times], flush=True)
    json.dump(out, open(sys.argv[1], "w"))
