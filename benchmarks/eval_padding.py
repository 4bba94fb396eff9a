"""Evaluation batches cut by padding against a forward's cost (on a CPU), or full batches: seconds, padded tokens and
the loss of each evaluation.

On a CPU a forward costs its tokens, padding included. Until 2026-11-28 the validation loss ran full batches of
``--eval_batch_size`` rows (8 by default), longest first, each padded to its longest row; on chat rows of 100-380
tokens a third of the evaluated tokens were padding. ``training/loop.py: eval_batches`` now ends a CPU batch before
a row whose padding would take it past 1/8 of its real tokens; since 2026-12-03 it takes the cut with the fewest
padded tokens counting a forward as 32 (``data/collate.length_parts``). ``--mode full`` puts the earlier batches back,
``--mode lean`` runs the code as it is. One surefit run per call (a cold start, ``--max_steps`` steps between the
evaluation before training and the one after), alone on the machine, on a workload that ``cpu_sft.py --keep`` left:

    python benchmarks/cpu_sft.py --workload chat --only surefit --keep --workdir /tmp/chat
    python benchmarks/eval_padding.py --workdir /tmp/chat --mode full
    python benchmarks/eval_padding.py --workdir /tmp/chat --mode lean

Prints one JSON line: each evaluation's seconds, loss, batches and padded/real tokens, and the start-up seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, help="a cpu_sft.py work folder (train.jsonl, val.jsonl, spec.json)")
    ap.add_argument("--mode", choices=["full", "lean"], required=True)
    ap.add_argument("--max_steps", type=int, default=1)
    ap.add_argument("--out", default=None, help="the run folder (default: WORKDIR/eval-MODE)")
    args = ap.parse_args()

    from benchlib import kept_surefit_settings

    import surefit
    import surefit.training.loop as loop

    batches = loop.eval_batches
    seen: list[dict[str, int]] = []

    def counted(order: Any, lengths: Any, batch_size: int, device: Any) -> list[list[int]]:
        parts = (batches(order, lengths, batch_size, device) if args.mode == "lean" else
                 [list(order[s : s + batch_size]) for s in range(0, len(order), batch_size)])
        seen.append({"batches": len(parts), "padded": sum(lengths[p[0]] * len(p) for p in parts),
                     "real": sum(lengths[i] for i in order)})
        return parts

    loop.eval_batches = counted
    work = Path(args.workdir)
    out = Path(args.out) if args.out else work / f"eval-{args.mode}"
    shutil.rmtree(out, ignore_errors=True)
    spec = json.loads((work / "spec.json").read_text(encoding="utf-8"))
    surefit.train(**kept_surefit_settings(work, out, max_steps=args.max_steps))  # no cache: epoch 0 is computed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    epochs = [r for r in records if r.get("type") == "epoch"]
    startup = json.loads((out / "startup.json").read_text(encoding="utf-8"))
    print(json.dumps({
        "workload": spec.get("workload"), "mode": args.mode, "eval_seconds": [e.get("eval_seconds") for e in epochs],
        "eval_loss": [e.get("eval_loss") for e in epochs], "batches": seen,
        "startup_seconds": startup["seconds"], "process_seconds": round(time.perf_counter() - T0, 1)}))


if __name__ == "__main__":
    main()
