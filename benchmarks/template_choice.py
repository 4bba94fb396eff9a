"""Which prompt template for single-turn input -> target rows on a chat model: its chat template or the plain one.

Trains the embedded SmolLM2-135M-Instruct with the seeds' flags (``--augmentation_factor 2 --lora_r 8 --batch_size 4``,
1 epoch) on two kinds of rows, each with ``--chat_template true`` and ``false``, and records the held-out scores
before and after training:

- extractive QA: the first ``--rows`` questions of ``../shared/data/squad/dev-v1.1-part-a.json``;
- open answers: the first human turn -> first assistant answer of ``../shared/data/chat/glaive_toolcall_en_demo.json``
  (answers up to 400 characters, no tool calls).

Both are input/target rows, so both are scored with token F1 (``--metric auto``), and the eval loss.

Runs one training at a time (the machine is shared); writes ``results/template_choice.{json,md}``.

    OMP_NUM_THREADS=2 python benchmarks/template_choice.py --rows 40 --val-fraction 0.25
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data"
SEEDS_FLAGS = ["--augmentation_factor", "2", "--lora_r", "8", "--batch_size", "4", "--epochs", "1"]


def open_answer_rows(n: int) -> list[dict[str, str]]:
    """Single-turn rows from the shipped chat set: a user's first message and the assistant's plain-text answer."""
    rows = json.loads((DATA / "chat" / "glaive_toolcall_en_demo.json").read_text())
    out = []
    for r in rows:
        c = r["conversations"]
        if len(c) >= 2 and c[0]["from"] == "human" and c[1]["from"] == "gpt" and len(c[1]["value"]) <= 400:
            out.append({"input": c[0]["value"], "target": c[1]["value"]})
    return out[:n]


def run(data: str, chat: bool, rows: int, val_fraction: float, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "surefit", "train", "--data", data, "--limit", str(rows), "--val_fraction",
           str(val_fraction), *SEEDS_FLAGS, "--chat_template", str(chat).lower(), "--output_dir", str(out),
           "--overwrite", "true", *extra]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    epochs = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"epoch (\d+)/\d+\s+(.*)", line)
        if m and "eval_" in m.group(2):
            epochs[int(m.group(1))] = {k: float(v) for k, v in re.findall(r"(eval_\w+)=([\d.]+)", m.group(2))}
    return {"command": " ".join(["surefit", *cmd[3:]]), "seconds": round(time.time() - start), "epochs": epochs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=60)
    ap.add_argument("--val-fraction", type=float, default=1 / 3)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        chat_file = Path(tmp) / "open_answers.jsonl"
        chat_file.write_text("".join(json.dumps(r) + "\n" for r in open_answer_rows(args.rows)))
        sets = [("extractive QA (SQuAD)", str(DATA / "squad" / "dev-v1.1-part-a.json"), "eval_f1"),
                ("open answers (glaive first turns)", str(chat_file), "eval_f1")]
        for name, data, metric in sets:
            for chat in (True, False):
                print(f"{name}, chat_template {chat} ...", file=sys.stderr, flush=True)
                r = run(data, chat, args.rows, args.val_fraction, Path(tmp) / "run", [])
                r.update(set=name, chat_template=chat, metric=metric)
                results.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    load = os.getloadavg()
    out = {"rows": args.rows, "val_fraction": args.val_fraction, "threads": os.environ.get("OMP_NUM_THREADS"),
           "loadavg_at_end": load, "results": results}
    (HERE / "results" / "template_choice.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = ["| rows | template | before | after 1 epoch | eval loss after | seconds |", "|---|---|---|---|---|---|"]
    for r in results:
        e0, e1 = r["epochs"].get(0, {}), r["epochs"].get(1, {})
        m = r["metric"]
        lines.append(f"| {r['set']} | {'chat template' if r['chat_template'] else 'plain'} | {m[5:]} {e0.get(m)} | "
                     f"{m[5:]} {e1.get(m)} | {e1.get('eval_loss')} | {r['seconds']} |")
    (HERE / "results" / "template_choice.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
