"""Launch configurations of qwen3_triton's product of several tokens (_rows_product), swept on a
CUDA GPU: each candidate set as the configuration for the weights' storage and timed as a preset's
whole fast-path step (bench.step_ms: a CUDA graph, the best of 20 replays), at 16 rows of one
token and at one row of 8.

    python bench/sweep_rows.py                    # 8B: bf16, int8 and int4
    python bench/sweep_rows.py --size 0.6B --quant int8
"""
import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench  # noqa: E402
import qwen3_triton as fast  # noqa: E402

# BN weight rows a program, BK weight words a block, warps, pipeline stages
CANDIDATES = [dict(BN=64, BK=128, num_warps=8),
              dict(BN=64, BK=256, num_warps=4, num_stages=4),
              dict(BN=64, BK=128, num_warps=8, num_stages=5),
              dict(BN=64, BK=128, num_warps=4, num_stages=4),
              dict(BN=128, BK=128, num_warps=8, num_stages=4),
              dict(BN=64, BK=256, num_warps=8, num_stages=4),
              dict(BN=64, BK=64, num_warps=4, num_stages=6)]
# (rows, tokens a row)
SHAPES = [(16, 1), (1, 8)]


def sweep(size: str, quant: str | None) -> None:
    """One JSON line a candidate: ms a step at SHAPES, or the error (out of shared memory)."""
    model = bench.random_model(size, quant)
    model.setup_cache(16, 1024)
    one_token_ms = bench.step_ms(model, 1, 1, 0, 1024)
    kind = quant or "float"
    for config in CANDIDATES:
        fast.ROWS_CONFIGS = {**fast.ROWS_CONFIGS, kind: config}
        row = {"size": size, "quant": quant, **config,
               "one_token_ms": round(one_token_ms, 3)}
        try:
            for rows, tokens in SHAPES:
                ms = bench.step_ms(model, rows, tokens, 0, 1024)
                row[f"{rows}x{tokens}_ms"] = round(ms, 3)
        except Exception as e:  # Triton's OutOfResources
            row["error"] = type(e).__name__
        print(json.dumps(row), flush=True)
    del model
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="8B", choices=list(bench.PRESETS))
    ap.add_argument("--quant", choices=["none", "int8", "int4"], action="append")
    a = ap.parse_args()
    for quant in a.quant or ["none", "int8", "int4"]:
        sweep(a.size, None if quant == "none" else quant)


if __name__ == "__main__":
    main()
