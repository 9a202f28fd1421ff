"""Launch configurations of qwen3_triton's matrix-vector products, swept on a CUDA GPU.

    python bench/sweep_gemv.py --store int4            # every kind of product, int4 weights
    python bench/sweep_gemv.py --store float --kinds routed --out sweep.json

For each kind of product (what it fuses into its input: norm, plain, gated; MoE's picked and routed)
and each shape of the presets that have it, every configuration of a grid (BN rows a program, BK
weight words a block, warps) is timed as 16 launches in one CUDA graph, the weights rotated through
300 MB so that L2 holds none of them. A kind's best configuration is the one of least time summed
over its shapes, each preset's shapes weighted by their count in a decode step and the preset's sum
taken relative to its best (0.6B counts half). Prints one JSON line a kind: the best, its score
(presets' times over their best, summed: 1.0 a preset is perfect), and each shape's time against the
configuration in GEMV_CONFIGS now. Compile the grid first in parallel with --compile-only WORKER
COUNT (Triton caches the kernels on disk).
"""
import argparse
import itertools
import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
try:
    import qwen3_triton as fast
except ImportError:
    fast = None

# (preset, kind, N, K, count a step, experts): the products of a decode step, their input size K
SHAPES = [
    ("8B", "norm", 6144, 4096, 36, 0), ("8B", "norm", 24576, 4096, 36, 0),
    ("8B", "norm", 151936, 4096, 1, 0), ("8B", "plain", 4096, 4096, 36, 0),
    ("8B", "gated", 4096, 12288, 36, 0),
    ("30B-A3B", "norm", 5120, 2048, 48, 0), ("30B-A3B", "plain", 2048, 4096, 48, 0),
    ("30B-A3B", "norm", 151936, 2048, 1, 0),
    ("30B-A3B", "picked", 1536, 2048, 48, 128), ("30B-A3B", "routed", 2048, 768, 48, 128),
    ("235B-A22B", "norm", 9216, 4096, 94, 0), ("235B-A22B", "plain", 4096, 8192, 94, 0),
    ("235B-A22B", "picked", 3072, 4096, 94, 128), ("235B-A22B", "routed", 4096, 1536, 94, 128),
    ("0.6B", "norm", 4096, 1024, 28, 0), ("0.6B", "norm", 6144, 1024, 28, 0),
    ("0.6B", "plain", 1024, 2048, 28, 0), ("0.6B", "gated", 1024, 3072, 28, 0),
]
KINDS = ["norm", "plain", "gated", "picked", "routed"]
# bytes a stored weight
BYTES = {"int4": 0.5, "int8": 1, "float": 2}
TOP_K = 8


def grid(store: str) -> list[dict]:
    """The configurations tried: 4 to 32 weight words a thread."""
    if store == "float":
        axes = [2, 4, 8, 16], [256, 512, 1024], [1, 2, 4, 8]
    else:
        axes = [4, 8, 16, 32], [64, 128, 256, 512], [2, 4, 8]
    return [dict(BN=bn, BK=bk, num_warps=warps) for bn, bk, warps in itertools.product(*axes)
            if 4 <= bn * bk / (32 * warps) <= 32]


def random_weights(store: str, N: int, K: int, experts: int) -> tuple:
    """(weight, scale, offset) as quantize.py stores them (int4 in groups of 128), random."""
    lead = (experts,) if experts else ()
    if store == "float":
        return torch.randn(*lead, N, K, device="cuda").bfloat16() * 0.02, None, None
    if store == "int8":
        weight = torch.randint(-127, 128, (*lead, N, K), dtype=torch.int8, device="cuda")
        return weight, torch.rand(*lead, N, device="cuda").bfloat16() * 0.01, None
    weight = torch.randint(0, 256, (*lead, N, K // 2), dtype=torch.uint8, device="cuda")
    scale = torch.rand(*lead, N, K // 128, device="cuda").bfloat16() * 0.01
    return weight, scale, -7.5 * scale


def inputs(kind: str, N: int, K: int, experts: int) -> tuple[dict, list]:
    """gemv's other arguments for a kind of product, and 16 routers that pick 16 sets of experts."""
    rows = TOP_K if kind == "routed" else 1
    width = 2 * K if kind in ("gated", "routed") else K
    args = dict(x=torch.randn(rows, 1, width, device="cuda").bfloat16())
    if kind in ("norm", "picked"):
        args.update(norm=torch.rand(K, device="cuda").bfloat16() + 0.5, eps=1e-6)
    if kind in ("plain", "gated", "routed"):
        args.update(residual=torch.randn(1, 1, N, device="cuda").bfloat16())
    if kind in ("gated", "routed"):
        args.update(gated=True)
    routers = [None]
    if experts:
        args.update(top_k=TOP_K, norm_topk_prob=True, routed=kind == "routed")
        routers = [torch.randn(experts, device="cuda") for _ in range(16)]
        for i, router in enumerate(routers):
            router[TOP_K * i + torch.arange(TOP_K)] += 10
        routers = [router.bfloat16() for router in routers]
    return args, routers


def call(weights: tuple, args: dict, router) -> torch.Tensor:
    weight, scale, offset = weights
    return fast.gemv(weight=weight, scale=scale, offset=offset, router=router, **args)


def time_us(store: str, shape: tuple, config: dict, launches: int = 16) -> float:
    """us a launch of gemv with `config`, best of 3 replays of a graph of `launches`."""
    _, kind, N, K, _, experts = shape
    fast.GEMV_CONFIGS[kind, store] = config
    read = N * K * BYTES[store] * (TOP_K / experts if experts else 1)
    copies = 1 if experts else max(1, min(launches, math.ceil(300e6 / read)))
    weights = [random_weights(store, N, K, experts) for _ in range(copies)]
    args, routers = inputs(kind, N, K, experts)
    call(weights[0], args, routers[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            call(weights[i % copies], args, routers[i % len(routers)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / launches)
    return best


def best_of(times: dict, shapes: list, configs: list) -> tuple[dict, float]:
    """The configuration of least summed relative time over the presets, and that sum."""
    scores = [0.0] * len(configs)
    for preset in {shape[0] for shape in shapes}:
        mine = [shape for shape in shapes if shape[0] == preset]
        ideal = sum(min(times[shape].values()) * shape[4] for shape in mine)
        weight = 0.5 if preset == "0.6B" else 1.0
        for i in range(len(configs)):
            spent = sum(times[shape].get(i, math.inf) * shape[4] for shape in mine)
            scores[i] += weight * spent / ideal
    best = min(range(len(configs)), key=scores.__getitem__)
    return configs[best], scores[best]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", choices=list(BYTES), default="int4",
                    help="how the weights are stored (default int4)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"comma-separated, of {', '.join(KINDS)} (default: all)")
    ap.add_argument("--compile-only", nargs=2, type=int, metavar=("WORKER", "COUNT"),
                    help="compile this worker's share of the grid (0 <= WORKER < COUNT), no timing")
    ap.add_argument("--out", help="also write every time to this new file, as JSON")
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds {a.kinds}: each of {', '.join(KINDS)}")
    if a.compile_only and not 0 <= a.compile_only[0] < a.compile_only[1]:
        ap.error("--compile-only WORKER COUNT: 0 <= WORKER < COUNT")
    if a.out and pathlib.Path(a.out).exists():
        ap.error(f"--out {a.out} exists: name a new file")
    if fast is None or not torch.cuda.is_available():
        sys.exit("error: the sweep needs a CUDA GPU, Triton and qwen3_triton.py")
    configs = grid(a.store)
    now = dict(fast.GEMV_CONFIGS)
    if a.compile_only:
        worker, count = a.compile_only
        jobs = [(kind, config) for kind in kinds for config in configs]
        for kind, config in jobs[worker::count]:
            _, _, N, K, _, experts = next(shape for shape in SHAPES if shape[1] == kind)
            fast.GEMV_CONFIGS[kind, a.store] = config
            args, routers = inputs(kind, N, K, experts)
            call(random_weights(a.store, N, K, experts), args, routers[0])
        torch.cuda.synchronize()
        return
    everything = {}
    for kind in kinds:
        shapes = [shape for shape in SHAPES if shape[1] == kind]
        if a.store == "float":  # 235B-A22B's experts in bf16: 3 GB a copy, and not a use
            shapes = [shape for shape in shapes if shape[0] != "235B-A22B"]
        times = {shape: {i: time_us(a.store, shape, config) for i, config in enumerate(configs)}
                 for shape in shapes}
        current = {shape: time_us(a.store, shape, now[kind, a.store]) for shape in shapes}
        best, score = best_of(times, shapes, configs)
        at = configs.index(best)
        rows = [{"shape": shape[:4], "us": round(times[shape][at], 1),
                 "now_us": round(current[shape], 1)} for shape in shapes]
        print(json.dumps({"kind": kind, "store": a.store, "best": best, "score": round(score, 3),
                          "shapes": rows}), flush=True)
        everything[kind] = {str(shape): times[shape] for shape in shapes}
    if a.out:
        with open(a.out, "x") as out:
            json.dump({"configs": configs, "times": everything}, out)


if __name__ == "__main__":
    main()
