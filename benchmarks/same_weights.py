"""A tiny sft run (a rejected row, LoRA, two epochs, evaluation) and the sha256 of its final adapter: run it before
and after a refactor that must not change behaviour, and compare (issue 30 recorded 24f45b5e... on both sides; issue
35's sampler v2, a new epoch order for new runs, gives fd4e7382..., unchanged by every later change of that round).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/same_weights.py
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import conftest  # noqa: E402 - the tests' tiny model and rows
from surefit.cli import main  # noqa: E402


def run() -> dict[str, object]:
    tmp = Path(tempfile.mkdtemp())
    tok = conftest.build_tokenizer()
    lm = tmp / "lm"
    conftest.build_tiny_lm(tok).save_pretrained(lm)
    tok.save_pretrained(lm)
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conftest.qa_rows(40)) + '{"input": 3}\n', encoding="utf-8")
    out = tmp / "run"
    rc = main(["train", "--task", "sft", "--model", str(lm), "--data", str(data), "--epochs", "2", "--lora_r", "8",
               "--batch_size", "4", "--grad-accum", "2", "--max_seq_length", "128", "--lr", "1e-2",
               "--val_fraction", "0.2", "--log_every", "2", "--output_dir", str(out), "--on_bad_rows", "skip"])
    epochs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"epoch"' in x]
    return {"rc": rc, "final_sha256": hashlib.sha256((out / "final" / "adapter_model.safetensors").read_bytes()).hexdigest(),
            "eval_loss": [e.get("eval_loss") for e in epochs if e.get("type") == "epoch"]}


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
