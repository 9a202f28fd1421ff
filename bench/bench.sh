#!/usr/bin/env bash
# Decode speed of qwen3-fast on random weights of a real size, one JSON line per configuration:
#   bash bench/bench.sh SIZE MODE [BATCH] [CACHE_LEN] [int8]      MODE: eager | compile | graph | compile+graph
#   PROFILE=1 bash bench/bench.sh 0.6B compile+graph               # and a per-kernel profile of one decode step
#   KERNELS=0 (PyTorch's ops instead of kernels.py), CDT=1 (inductor's coordinate descent tuning): to compare
#   GREEDY=1: greedy decoding, as the transformers peer (hf_peer.py: do_sample=False)
# Decode tok/s two ways: from two generation lengths in the same process, (n2 - n1) / (t2 - t1), which cancels
# prefill, and generate()'s own clock from the first token to the last. Sampling: Qwen3's defaults (T 0.6, top-k 20,
# top-p 0.95) unless GREEDY=1. Also the time to the first decoded token including compilation (the first call of the
# process).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=$1 MODE=$2 BATCH=${3:-1} CACHE=${4:-1024} INT8=${5:-} PROMPT=${PROMPT:-128} N1=${N1:-64} N2=${N2:-320} python3 - <<'PY'
import json, os, time, torch
import generate as G, kernels
e = os.environ
kernels.ENABLED = kernels.ENABLED and e.get("KERNELS") != "0"  # KERNELS=0: PyTorch's ops only, to compare
size, mode, batch, cache, prompt_len = e["SIZE"], e["MODE"], int(e["BATCH"]), int(e["CACHE"]), int(e["PROMPT"])
n1, n2 = int(e["N1"]), int(e["N2"])
torch._inductor.config.coordinate_descent_tuning = e.get("CDT") == "1"  # CDT=1: inductor tunes its reductions
t0 = time.perf_counter()
model = G.dummy_model(size, e["INT8"] == "int8", "cuda", torch.bfloat16)
sampling = (0, 0, 1) if e.get("GREEDY") else (0.6, 20, 0.95)
gen = G.Generator(model, batch, cache, sampling, "compile" in mode, "graph" in mode)
torch.manual_seed(0)
prompts = [torch.randint(0, 151643, (prompt_len,)).tolist() for _ in range(batch)]
t1 = time.perf_counter()
gen.generate(prompts, 2, set())  # one decode step: compiles and captures
first = time.perf_counter() - t1
gen.generate(prompts, n2, set())  # warms every attended length the timed runs use

def timed(n):
    torch.cuda.synchronize(); t = time.perf_counter()
    _, stats = gen.generate(prompts, n, set())
    return time.perf_counter() - t, stats

rates, direct, ttft = [], [], []
for _ in range(3):
    (ta, _), (tb, sb) = timed(n1), timed(n2)
    rates.append((n2 - n1) / (tb - ta)); direct.append(sb["steps"] / sb["decode_s"]); ttft.append(sb["prefill_s"])
nbytes = G.weight_bytes(model)
best = max(rates)
print(json.dumps({"size": size, "mode": mode, "kernels": kernels.ENABLED,
                  "cdt": torch._inductor.config.coordinate_descent_tuning, "batch": batch, "cache_len": cache,
                  "int8": e["INT8"] == "int8", "greedy": bool(e.get("GREEDY")),
                  "decode_tok_s": round(best, 1), "aggregate_tok_s": round(best * batch, 1),
                  "direct_tok_s": round(max(direct), 1), "all": [round(r, 1) for r in rates],
                  "weights_GB": round(nbytes / 1e9, 3), "GB_s": round(best * nbytes / 1e9, 1),
                  "ttft_s": round(min(ttft), 4), "first_decoded_token_s": round(first, 1),
                  "load_s": round(t1 - t0, 1), "peak_mem_GB": round(torch.cuda.max_memory_allocated() / 1e9, 2)}),
      flush=True)
if e.get("PROFILE") and "graph" in mode:  # kernels of one step, timed without graph replay: where the time goes
    inner, kv = gen.step.step, model.key_positions[:G.attended_length(prompt_len + n2 + 10, cache)]
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            inner(kv)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(f"profile: {sum(k.device_time_total for k in ka) / 10:.0f} us of GPU time per step in "
          f"{sum(k.count for k in ka if k.device_time_total > 0) / 10:.0f} kernels")
    for k in sorted(ka, key=lambda k: -k.device_time_total)[:25]:
        print(f"  {k.device_time_total / 10:8.1f} us {k.count // 10:4d}x  {k.key[:120]}")
PY
