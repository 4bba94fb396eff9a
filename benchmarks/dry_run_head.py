"""The doctor's measured dry run with the fused head's gradient math done or skipped: seconds and saved bytes.

The dry run on a CPU (``training/plan.py: MeasuringDryRun``) is one training-mode forward that is measured and never
backpropagated. Inside it the fused head used to compute its gradients (a softmax and a matmul per chunk) as in a
training forward; since 2026-11-28 it keeps the gradient tensors without computing them
(``training/speedups/fused_head.py: gradients_unused``), so the bytes counted are the same. This script prepares a
surefit sft run on a ``cpu_sft.py --keep`` work folder once and calls the dry run on the doctor's batch, alternating
the two ways (the order swapped every pair), in one process:

    python benchmarks/cpu_sft.py --workload chat --only surefit --keep --workdir /tmp/chat
    python benchmarks/dry_run_head.py --workdir /tmp/chat --pairs 6

Prints one line per call: pair, way, seconds, [saved bytes, tokens].
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, help="a cpu_sft.py work folder (train.jsonl, val.jsonl, spec.json)")
    ap.add_argument("--pairs", type=int, default=6)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    import torch

    import surefit.tasks.sft.train_sft as sft
    import surefit.training.plan as plan
    import surefit.training.speedups.fused_head as fused_head
    from surefit.cli import parse_train_config
    from surefit.doctor.core import Setup
    from surefit.training.precision import precision_name

    work = Path(args.workdir)
    spec = json.loads((work / "spec.json").read_text(encoding="utf-8"))
    cfg = parse_train_config(["--task", "sft", "--data", str(work / "train.jsonl"), "--val_data", str(work / "val.jsonl"),
                              "--lora_r", "16", "--batch_size", "4", "--max_seq_length", "384", "--template",
                              spec["template"], "--output_dir", str(work / "dry_run_head"), "--no_cache"])
    p = sft.prepare(cfg, say=lambda s: None)
    batch, _ = Setup(p.model, None, p.work.features, None, p.work.collate, {"batch_size": 4},
                     sample=sft.DRY_RUN_ROWS).batch()
    precision = precision_name(p.accelerator)
    for i in range(args.pairs):
        for way in (("computed", "unused") if i % 2 == 0 else ("unused", "computed")):
            into: dict = {}
            no_backward = fused_head.gradients_unused if way == "unused" else contextlib.nullcontext
            dry = plan.MeasuringDryRun(p.work.plan.loss_fn, True, precision, torch.device("cpu"),
                                       p.work.activation_store, into, no_backward=no_backward)
            with p.accelerator.autocast():
                t = time.perf_counter()
                dry(p.model, batch)
                seconds = time.perf_counter() - t
            print(json.dumps({"pair": i, "way": way, "seconds": round(seconds, 3),
                              "saved_activations": into["saved_activations"]}), flush=True)


if __name__ == "__main__":
    main()
