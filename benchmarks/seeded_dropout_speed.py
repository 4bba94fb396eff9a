"""What do split-independent dropout masks and fp32 adapter gradients cost? A relative micro-benchmark, one process.

On SmolLM2-135M's LoRA shapes (a micro-batch of 4 x 287 tokens; inputs of width 576 for q/k/v/o/gate/up, 1536 for
down_proj; rank 16), per call:
- the mask: keyed by example (``training/dropout.keep_mask``, a hash per element) vs torch's generator
  (``speedups/lora_fast.keep_mask``, what the fused forward drew before) vs ``nn.Dropout``'s whole forward;
- the adapter's two weight-gradient reductions: in fp32 (now) vs 16-bit matmuls rounded to bf16 (before);
- for scale, the frozen base matmul those layers run anyway (bf16, forward only).
Goal: the keyed mask costs at most 2x torch's, and mask + fp32 reductions stay a small fraction of the base matmul.

    PYTHONPATH=src .venv/bin/python benchmarks/seeded_dropout_speed.py [--repeats 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(batch: int, length: int, rank: int, p: float, width: int, out_width: int,
             repeats: int) -> dict[str, float]:
    """Milliseconds per call of each piece, for one LoRA layer of ``width`` -> ``out_width``."""
    import torch

    from surefit.training.dropout import keep_mask as keyed_mask
    from surefit.training.dropout import module_salt, training_rows
    from surefit.training.speedups.lora_fast import keep_mask as torch_mask

    shape = (batch, length, width)
    x = torch.randn(shape).bfloat16()
    w = torch.randn(out_width, width).bfloat16()
    g = torch.randn(batch, length, out_width)
    u = torch.randn(batch, length, rank).bfloat16()
    gu = torch.randn(batch, length, rank).bfloat16()
    drop = torch.nn.Dropout(p).train()
    salt = module_salt("layers.0.mlp.down_proj.lora_dropout.default")
    with training_rows(seed=0, step=0, rows=list(range(batch))):
        keyed = _time(lambda: keyed_mask(shape, p, salt, "cpu"), repeats)
    return {
        "keyed_mask_ms": keyed * 1e3,
        "torch_mask_ms": _time(lambda: torch_mask(shape, p, "cpu"), repeats) * 1e3,
        "nn_dropout_ms": _time(lambda: drop(x), repeats) * 1e3,
        "grads_fp32_ms": _time(lambda: (g.reshape(-1, out_width).t() @ u.reshape(-1, rank).float(),
                                        gu.reshape(-1, rank).t().float() @ x.reshape(-1, width).float()),
                               repeats) * 1e3,
        "grads_bf16_ms": _time(lambda: (g.reshape(-1, out_width).bfloat16().t() @ u.reshape(-1, rank),
                                        gu.reshape(-1, rank).t() @ x.reshape(-1, width)), repeats) * 1e3,
        "base_matmul_ms": _time(lambda: x @ w.t(), repeats) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--quick", action="store_true", help="smoke mode: 2 repeats, no results written")
    args = ap.parse_args()
    repeats = 2 if args.quick else args.repeats

    import torch
    from benchlib import machine_info

    batch, length, rank, p = 4, 287, 16, 0.05
    rows: dict[str, dict[str, float]] = {}
    for width, out_width in ((576, 576), (1536, 576)):
        r = _measure(batch, length, rank, p, width, out_width, repeats)
        rows[f"{width}->{out_width}"] = r
        print(width, {k: round(v, 3) for k, v in r.items()}, flush=True)

    lines = ["# seeded_dropout_speed: the cost of split-independent masks and fp32 adapter gradients", "",
             f"Per call, best of {repeats}, micro-batch {batch} x {length} tokens, rank {rank}, p {p}; torch "
             f"{torch.__version__}, {torch.get_num_threads()} threads. Command: "
             "`PYTHONPATH=src .venv/bin/python benchmarks/seeded_dropout_speed.py`.", "",
             "| input -> output | keyed mask ms | torch mask ms | ratio (goal <= 2) | nn.Dropout ms | adapter grads "
             "fp32 ms | bf16 ms | base bf16 matmul ms | (keyed mask + fp32 grads - before) / base |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        ratio = r["keyed_mask_ms"] / r["torch_mask_ms"]
        extra = (r["keyed_mask_ms"] + r["grads_fp32_ms"] - r["torch_mask_ms"] - r["grads_bf16_ms"]) / r["base_matmul_ms"]
        lines.append(f"| {name} | {r['keyed_mask_ms']:.2f} | {r['torch_mask_ms']:.2f} | {ratio:.2f} "
                     f"{'PASS' if ratio <= 2 else 'FAIL'} | {r['nn_dropout_ms']:.2f} | {r['grads_fp32_ms']:.2f} | "
                     f"{r['grads_bf16_ms']:.2f} | {r['base_matmul_ms']:.2f} | {extra:+.2f} |")
    print("\n".join(lines))
    if args.quick:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeded_dropout_speed.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "seeded_dropout_speed.json").write_text(json.dumps({"machine": machine_info(), "rows": rows}, indent=2),
                                                   encoding="utf-8")


if __name__ == "__main__":
    main()
