"""The keyed dropout mask on a CPU: its hash in int64 words (before) against int32 words (after), one process.

``training/dropout.keep_mask`` hashes each pair of elements of a LoRA layer's input: the (row, position) key xor the
pair's hash, times a constant, modulo 2^32. Before 2026-11-27 the CPU ran that in int64 and cast the product to
int32 before comparing its 16-bit words; now it runs in int32 words, whose wrapping product has the same low 32 bits
(half the bytes per pass, one pass fewer). The masks must be the same bits: this script checks that on every shape
it times, then times both, alternating, on SmolLM2-135M's LoRA inputs (width 576 for q/k/v/o/gate/up, 1536 for
down_proj) for a chat micro-batch (4 x 347 tokens) and a SQuAD one (2 x 284, rows packed by shared prefixes).

``before`` is the old function, copied here as it was. One layer's masks = 6 calls at width 576 + 1 at 1536.

    PYTHONPATH=src .venv/bin/python benchmarks/keyed_mask_words.py --threads 1,2 --out results/keyed_mask_words.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def keep_mask_before(shape: tuple[int, ...], p: float, salt: int) -> Any:
    """``dropout.keep_mask`` on a CPU as it was before (int64 product, cast to int32), for ``[batch, length, width]``."""
    import torch

    from surefit.training import dropout as d

    batch, length, width = shape
    salted = d._current[0].salted_keys(batch, length, salt, "cpu")
    pairs = (width + 1) // 2
    h = salted.reshape(batch, length)[..., None] ^ d._feature_hashes(pairs, "cpu")
    h.mul_(d._MUL)
    halves = h.to(torch.int32).view(torch.int16).view(batch, length, pairs, 2)
    halves[..., 0].bitwise_xor_(halves[..., 1])
    keep = (halves >= d._LOWEST + round(p * d._SPAN)).reshape(batch, length, 2 * pairs)
    return keep[..., :width] if 2 * pairs != width else keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per timed round")
    ap.add_argument("--out", default=None, help="write the JSON here (relative to benchmarks/)")
    args = ap.parse_args()
    import torch

    from surefit.training import dropout as d

    batches = {"chat (4 x 347)": (4, 347), "squad (2 x 284)": (2, 284)}
    salt, p = d.module_salt("model.layers.0.self_attn.q_proj.lora_dropout.default"), 0.05
    results: list[dict] = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name, (batch, length) in batches.items():
            with d.training_rows(0, 1, list(range(batch))):
                row: dict[str, Any] = {"threads": threads, "batch": name}
                for width in (576, 1536):
                    shape = (batch, length, width)
                    assert torch.equal(keep_mask_before(shape, p, salt), d.keep_mask(shape, p, salt, "cpu"))
                    best = {"before": float("inf"), "after": float("inf")}
                    for _ in range(args.rounds):
                        for side in ("before", "after"):
                            t0 = time.perf_counter()
                            for _ in range(args.calls):
                                if side == "before":
                                    keep_mask_before(shape, p, salt)
                                else:
                                    d.keep_mask(shape, p, salt, "cpu")
                            best[side] = min(best[side], (time.perf_counter() - t0) / args.calls * 1e3)
                    row[f"width {width} ms"] = {k: round(v, 3) for k, v in best.items()}
                row["one layer ms"] = {side: round(6 * row["width 576 ms"][side] + row["width 1536 ms"][side], 2)
                                       for side in ("before", "after")}
                results.append(row)
                print(json.dumps(row))
    out = {"benchmark": "keyed_mask_words", "masks_equal": True, "command": " ".join(sys.argv),
           "torch": torch.__version__, "results": results}
    if args.out:
        path = HERE / args.out
        path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
