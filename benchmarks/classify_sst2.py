"""Classification benchmark: the embedded all-MiniLM-L6-v2 fine-tuned on the first 4,000 SST-2 training rows for one
epoch, scored on the 872 SST-2 dev rows. Goal (issue 3): dev accuracy >= 0.80; the time it took is recorded.

    .venv/bin/python benchmarks/classify_sst2.py [--shared ../shared/data] [--rows 4000]

Writes benchmarks/results/classify_sst2.json and .md. Timings are wall-clock on whatever machine runs it (recorded);
compare them only with timings taken on the same machine in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"), help="the shared data folder")
    ap.add_argument("--rows", type=int, default=4000, help="training rows (the first N of train.tsv)")
    ap.add_argument("--out", default=str(HERE / "results"), help="where the results go")
    args = ap.parse_args()

    import torch

    import surefit

    sst2 = Path(args.shared) / "sst2"
    settings = dict(task="classify", data=str(sst2 / "train.tsv"), val_data=str(sst2 / "dev.tsv"), limit=args.rows,
                    epochs=1, batch_size=32, lr=1e-4, max_seq_length=128, seed=0, log_every=25)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        # --limit applies to both files; the dev set has 872 rows, below any limit used here, so all of it is scored.
        result = surefit.train(settings, output_dir=str(Path(tmp) / "run"))
        seconds = time.perf_counter() - t0
    final = result.history[-1]
    record = {
        "benchmark": "classify_sst2",
        "model": "all-MiniLM-L6-v2 (embedded, full fine-tuning)",
        "train_rows": result.data_report["train_rows"],
        "dev_rows": result.data_report["val_rows"],
        "settings": settings,
        "epoch0_accuracy": result.history[0]["eval_accuracy"],
        "dev_accuracy": final["eval_accuracy"],
        "dev_macro_f1": final["eval_macro_f1"],
        "train_loss": final["train_loss"],
        "seconds_total": round(seconds, 1),
        "seconds_training_epoch": round(final["time_per_epoch"], 1),
        "goal": "dev accuracy >= 0.80",
        "goal_met": final["eval_accuracy"] >= 0.80,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "cuda": torch.cuda.is_available()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "classify_sst2.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    md = [
        "# classify_sst2",
        "",
        f"all-MiniLM-L6-v2 (embedded), full fine-tuning, {record['train_rows']} SST-2 training rows, 1 epoch, "
        f"batch 32, lr 1e-4, max length 128; scored on the {record['dev_rows']} SST-2 dev rows.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| dev accuracy before training (epoch 0) | {record['epoch0_accuracy']:.4f} |",
        f"| dev accuracy after 1 epoch | {record['dev_accuracy']:.4f} |",
        f"| dev macro-F1 | {record['dev_macro_f1']:.4f} |",
        f"| goal (>= 0.80) | {'met' if record['goal_met'] else 'NOT met'} |",
        f"| training epoch | {record['seconds_training_epoch']} s |",
        f"| whole run (load, tokenize, 2 evaluations, train, save) | {record['seconds_total']} s |",
        "",
        f"Machine: {record['machine']['cpu_count']} CPUs, {record['machine']['platform']}, torch "
        f"{record['machine']['torch']}, CUDA {'yes' if record['machine']['cuda'] else 'no'}.",
        "Command: `.venv/bin/python benchmarks/classify_sst2.py`",
        "",
    ]
    (out / "classify_sst2.md").write_text("\n".join(md), encoding="utf-8")
    print("\n".join(md))


if __name__ == "__main__":
    main()
