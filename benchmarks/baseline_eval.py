"""The evaluation before training reused: a second `surefit train` on the same model and data, with another learning
rate, with and without the stored epoch-0 evaluation.

The job: the embedded SmolLM2-135M-Instruct, LoRA r16 on every linear layer, batch 4, one optimizer step
(``--max_steps 1``), validation loss plus greedy answers at epoch 0 and at the end. Workloads:

* ``squad``: the first ``--rows`` rows of ``../shared/data/squad/dev-v1.1-part-a.json`` to train, its last
  ``--val-rows`` to validate (extractive answers, SQuAD F1);
* ``chat``: conversations of ``../shared/data/chat/glaive_toolcall_en_demo.json`` as ``messages`` rows (the first
  user turn and the assistant's reply, under the model's chat template; ROUGE-L).

Per workload a first run fills the start-up cache (doctor, planner, encoded data, epoch 0). Then, ``--repeats``
times, interleaved: ``before``: the same command with ``--lr 1e-4`` into a new folder after removing only the
cache's ``evaluation/`` entries (what a second run did before this change: everything else reused, epoch 0
computed); ``after``: the same with the entry there (epoch 0 reused). Each run is its own process with
``OMP_NUM_THREADS=1``; measured: seconds to step 1 (``startup.json``), the process's wall time and its CPU seconds
(``os.wait4``); the epoch-0 records of both are compared (timings aside).

    .venv/bin/python benchmarks/baseline_eval.py [--workloads squad chat] [--rows 16] [--val-rows 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def squad_files(shared: Path, work: Path, rows: int, val_rows: int) -> tuple[Path, Path]:
    from surefit.data.readers import read_rows

    problems: list[Any] = []
    read = read_rows(shared / "squad" / "dev-v1.1-part-a.json", problems)
    assert not problems, problems
    return (_jsonl(work / "train.jsonl", [{k: r.fields[k] for k in ("input", "target", "answers")} for r in read[:rows]]),
            _jsonl(work / "val.jsonl", [{k: r.fields[k] for k in ("input", "target", "answers")}
                                        for r in read[-val_rows:]]))


def chat_files(shared: Path, work: Path, rows: int, val_rows: int) -> tuple[Path, Path]:
    convs = json.loads((shared / "chat" / "glaive_toolcall_en_demo.json").read_text(encoding="utf-8"))
    out, seen = [], set()
    for c in convs:
        t = c["conversations"]
        if len(t) < 2 or t[0]["from"] != "human" or t[1]["from"] != "gpt" or t[0]["value"] in seen:
            continue
        seen.add(t[0]["value"])
        out.append({"messages": [{"role": "user", "content": t[0]["value"]},
                                 {"role": "assistant", "content": t[1]["value"]}]})
    return _jsonl(work / "train.jsonl", out[:rows]), _jsonl(work / "val.jsonl", out[rows:rows + val_rows])


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run(files: tuple[Path, Path], out: Path, cache: Path, lr: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "surefit", "train", "--data", str(files[0]), "--val_data", str(files[1]),
           "--lora_r", "16", "--batch_size", "4", "--max_seq_length", "384", "--max_steps", "1", "--lr", lr,
           "--output_dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SUREFIT_STARTUP_CACHE": str(cache),
           "PYTHONPATH": str(REPO / "src") + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise SystemExit(f"surefit failed ({status}):\n{text[-3000:]}")
    startup = json.loads((out / "startup.json").read_text(encoding="utf-8"))
    first = json.loads((out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()[0])
    return {"to_step1_s": startup["seconds"], "eval_before_training_s": startup["phases"].get("evaluation before training", 0.0),
            "process_wall_s": round(wall, 2), "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "cache": startup["cache"], "epoch0": {k: v for k, v in first.items() if k not in ("eval_seconds", "time")},
            "predictions0": (out / "predictions" / "epoch_0.jsonl").read_bytes().decode("utf-8")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["squad", "chat"])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--val-rows", type=int, default=32)
    ap.add_argument("--chat-val-rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shared", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--out", default=str(HERE / "results" / "baseline_eval"))
    args = ap.parse_args()
    results: dict[str, Any] = {"command": " ".join(sys.argv), "workloads": {}}
    for name in args.workloads:
        work = Path(tempfile.mkdtemp(prefix=f"baseline_{name}_"))
        make = squad_files if name == "squad" else chat_files
        files = make(Path(args.shared), work, args.rows, args.val_rows if name == "squad" else args.chat_val_rows)
        cache = work / "startup_cache"
        prime = run(files, work / "prime", cache, "2e-4")
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for i in range(args.repeats):
            for which in (("before", "after") if i % 2 == 0 else ("after", "before")):
                if which == "before":
                    shutil.rmtree(cache / "evaluation", ignore_errors=True)
                r = run(files, work / f"{which}{i}", cache, "1e-4")  # a "before" writes the entry back
                runs[which].append(r)
                print(name, which, i, {k: r[k] for k in ("to_step1_s", "eval_before_training_s", "process_wall_s",
                                                        "process_cpu_s", "cache")}, flush=True)
        same = all(r["epoch0"] == prime["epoch0"] and r["predictions0"] == prime["predictions0"]
                   for r in runs["before"] + runs["after"])
        med = {w: {k: statistics.median(r[k] for r in rs) for k in ("to_step1_s", "eval_before_training_s",
                                                                     "process_wall_s", "process_cpu_s")}
               for w, rs in runs.items()}
        ratios = {k: statistics.median(b[k] / a[k] for b, a in zip(runs["before"], runs["after"], strict=True))
                  for k in ("to_step1_s", "process_wall_s", "process_cpu_s")}
        results["workloads"][name] = {
            "rows": args.rows, "val_rows": len(files[1].read_text(encoding="utf-8").splitlines()),
            "median": med, "before_over_after_median_ratio": ratios, "epoch0_identical": same,
            "epoch0": prime["epoch0"], "cache_status": {w: [r["cache"].get("evaluation") for r in rs] for w, rs in runs.items()},
            "runs": {w: [{k: v for k, v in r.items() if k not in ("epoch0", "predictions0")} for r in rs]
                     for w, rs in runs.items()}}
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(json.dumps({n: {k: w[k] for k in ("median", "before_over_after_median_ratio", "epoch0_identical")}
                      for n, w in results["workloads"].items()}, indent=2))


if __name__ == "__main__":
    main()
