"""Classify on the encoded-data cache (issue 35): start-up to step 1 and peak RSS of ``surefit train --task classify``
on SST-2 rows, the first run a miss (reads, types the labels, splits, tokenizes, writes the store), the second a hit
(opens the store; nothing read or tokenized).

Each run is its own process (peak RSS is the kernel's ``ru_maxrss`` of that child, from ``os.wait4``): the embedded
all-MiniLM-L6-v2, ``--max_steps 1``, the first 100 SST-2 dev rows as ``--val_data`` (the same evaluation before
training at every size), ``OMP_NUM_THREADS=1``, one start-up cache per size (so the second run also finds the
doctor's and the planner's work: the phases in the table tell the parts apart). The load average is read before each
run.

    PYTHONPATH=src .venv/bin/python benchmarks/classify_store.py [--sizes 16000,67349] [--shared ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchlib import loadavg, machine_info  # noqa: E402


def head(src: Path, dst: Path, rows: int) -> None:
    """The header and the first ``rows`` rows of a TSV file."""
    with src.open(encoding="utf-8") as f, dst.open("w", encoding="utf-8") as out:
        for i, line in enumerate(f):
            if i > rows:
                break
            out.write(line)


def wait(proc: subprocess.Popen, timeout: float) -> tuple[int, Any]:
    deadline = time.time() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"timed out: {proc.args}")
        time.sleep(0.2)


def run_train(data: Path, val: Path, out: Path, cache: Path, src: Path, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "SUREFIT_STARTUP_CACHE": str(cache)}
    argv = [sys.executable, "-m", "surefit", "train", "--task", "classify", "--data", str(data), "--val_data", str(val),
            "--max_steps", "1", "--output_dir", str(out)]
    t0 = time.time()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    status, usage = wait(proc, timeout)
    if status != 0:
        raise SystemExit(f"failed ({status}): {' '.join(argv)}\n{log[-3000:]}")
    startup = json.loads((out / "startup.json").read_text(encoding="utf-8"))
    report = json.loads((out / "data_report.json").read_text(encoding="utf-8"))
    return {"peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "startup_s": startup["seconds"],
            "store": report["encoded_store"]["status"], "phases": startup["phases"], "wall_s": round(time.time() - t0, 1),
            "train_rows": report["train_rows"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16000,67349", help="training rows: the first N of SST-2's train.tsv")
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"))
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--src", default=str(HERE.parent / "src"))
    ap.add_argument("--out", default=str(HERE / "results" / "classify_store"))
    args = ap.parse_args()
    sst2, src = Path(args.shared) / "sst2", Path(args.src).resolve()
    result: dict[str, Any] = {"machine": machine_info(), "command": " ".join(sys.argv), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        val = work / "dev100.tsv"
        head(sst2 / "dev.tsv", val, 100)
        for n in (int(s) for s in args.sizes.split(",")):
            data = work / f"train_{n}.tsv"
            head(sst2 / "train.tsv", data, n)
            for attempt in ("first", "second"):
                load = loadavg()
                rec = run_train(data, val, work / f"out_{n}_{attempt}", work / f"cache_{n}", src, args.timeout)
                rec.update(rows=n, run=attempt, load_before=load, load_after=loadavg())
                result["runs"].append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "phases"}), flush=True)
                Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
