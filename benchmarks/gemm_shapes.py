"""What the CPU's matmuls give at the shapes a SmolLM2-135M forward runs, and what its memory streams.

Where generation and evaluation time goes on a CPU is bound by two numbers: the GEMM rate at the prompts' shapes
(thousands of rows: compute-bound) and at a decode step's (one row per sequence being generated: the weights are
read once per step, so memory-bound). This measures both for each linear layer shape of the model (q, k/v, o, gate/up,
down; the weight in ``nn.Linear``'s [out, in] layout as ``F.linear`` runs it), with as many distinct weights as the
model has (30 layers: more than the last-level cache holds, as in a real step), and the memory rate of a plain sum
over the same bytes. Each at 1 thread and at every core.

    .venv/bin/python benchmarks/gemm_shapes.py --out benchmarks/results/epyc/gemm_shapes

Reading it: GFLOP/s near the core's peak at the prompts' rows means the prompts' forward cannot get faster without
computing fewer tokens; "weight GB/s" of a decode-sized matmul far below the sum's GB/s means each decode step reads
the weights at a fraction of the memory's speed (the BLAS kernel's small-row path), so a decode step costs that
much whatever surrounds it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {"q, o (576 -> 576)": (576, 576), "k, v (576 -> 192)": (576, 192), "gate, up (576 -> 1536)": (576, 1536),
          "down (1536 -> 576)": (1536, 576)}
ROWS = (1, 8, 24, 200, 1576)
LAYERS = 30


def _worker(threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)

    def timed(fn, n: int) -> float:
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n

    out: dict = {"threads": torch.get_num_threads(), "linear": {}}
    for name, (i, o) in SHAPES.items():
        weights = [torch.randn(o, i) for _ in range(LAYERS)]
        at = [0]

        def nxt() -> torch.Tensor:
            at[0] = (at[0] + 1) % LAYERS
            return weights[at[0]]

        for m in ROWS:
            x = torch.randn(m, i)
            dt = timed(lambda x=x: F.linear(x, nxt()), max(5, min(200, int(2e9 / (2 * m * i * o)))))
            out["linear"][f"{name}, {m} rows"] = {"us": round(dt * 1e6, 1), "gflops": round(2 * m * i * o / dt / 1e9, 1),
                                                   "weight_gbs": round(i * o * 4 / dt / 1e9, 2)}
    big = torch.randn(100_000_000)  # 400 MB: beyond any cache
    out["sum_gbs"] = round(0.4 / timed(big.sum, 5), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker)))
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    runs = []
    for threads in sorted({1, cores}):
        # each thread count in its own process: OpenMP's pool is sized once per process
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run([sys.executable, __file__, "--worker", str(threads)], env=env, capture_output=True,
                              text=True, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?") if Path("/proc/cpuinfo").is_file() else "?"
    import torch

    lines = [f"# GEMM rate at SmolLM2-135M's shapes, and memory rate ({cpu}, {cores} cores, torch {torch.__version__})",
             "", "`.venv/bin/python benchmarks/gemm_shapes.py`: `F.linear` over 30 distinct fp32 weights per shape "
             "(one per layer, as a step reads them), microseconds per call, GFLOP/s, and the weight's bytes per "
             "second; the last line is a plain sum over 400 MB.", "",
             "| shape, rows | " + " | ".join(f"{r['threads']} thread(s): us / GFLOP/s / weight GB/s" for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for key in runs[0]["linear"]:
        cells = [f"{r['linear'][key]['us']} / {r['linear'][key]['gflops']} / {r['linear'][key]['weight_gbs']}"
                 for r in runs]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| sum over 400 MB, GB/s | " + " | ".join(str(r["sum_gbs"]) for r in runs) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps({"cpu": cpu, "cores": cores, "runs": runs},
                                                                  indent=1) + "\n", encoding="utf-8")
        Path(args.out).with_suffix(".md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
