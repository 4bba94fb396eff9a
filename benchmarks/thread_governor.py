"""Whole chat runs alone and two at once, with sleeping OpenMP waits (surefit's earlier default) against spinning
waits with the thread governor (the default now, ``threads.py``).

Each job is ``cpu_sft.py --workload chat --only surefit`` (SmolLM2-135M, LoRA r16, batch 4, length 384, 64 rows, one
epoch, evaluations before and after), a process of its own. "sleeping": ``OMP_WAIT_POLICY=PASSIVE KMP_BLOCKTIME=0``
in the environment (a policy the user sets turns the governor off, so this is exactly the earlier default);
"governed": no OpenMP setting. "pair": a second identical job starts ``--stagger`` seconds after the first, so the
first has its cores to itself until the second arrives, mid-training. Settings alternate within each repeat.

    .venv/bin/python benchmarks/thread_governor.py --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SETTINGS = {"sleeping": {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}, "governed": {}}
OMP = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")


def start(setting: str, work: Path, rows: int) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k not in OMP}
    env.update(SETTINGS[setting])
    work.mkdir(parents=True, exist_ok=True)
    log = work / "job.log"
    cmd = [sys.executable, str(HERE / "cpu_sft.py"), "--workload", "chat", "--only", "surefit", "--rows", str(rows),
           "--out", str(work / "out"), "--workdir", str(work / "wd")]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT), work


def result(work: Path, rows: int) -> dict[str, Any]:
    stem = "cpu_sft_chat" + ("" if rows == 64 else f"_{rows}")
    data = json.loads((work / "out" / f"{stem}.json").read_text())["results"]["surefit"]
    log = Path(data["log"]).read_text(errors="replace") if data.get("log") else ""  # the worker's own output
    said = [ln.strip() for ln in log.splitlines() if "of this machine's" in ln or ln.startswith("threads:")]
    return {"process_s": data.get("process_seconds"), "train_s": round(data["train_seconds"], 1),
            "eval_s": [round(s, 1) for s in data.get("eval_seconds") or []], "loss": round(data["final_loss"], 4),
            "peak_rss_mb": data.get("peak_rss_mb"), "said": said}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--stagger", type=float, default=30.0, help="seconds between the pair's two starts")
    ap.add_argument("--out", default=str(HERE / "results" / "thread_governor"))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="thread_governor-"))
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for mode in ("alone", "pair"):
            for setting in SETTINGS:
                t0 = time.time()
                first, w1 = start(setting, root / f"{rep}-{mode}-{setting}-a", args.rows)
                jobs = [(first, w1)]
                if mode == "pair":
                    time.sleep(args.stagger)
                    jobs.append(start(setting, root / f"{rep}-{mode}-{setting}-b", args.rows))
                for proc, _ in jobs:
                    proc.wait()
                row = {"repeat": rep, "mode": mode, "setting": setting, "wall_s": round(time.time() - t0, 1),
                       "jobs": [result(w, args.rows) for _, w in jobs], "load_after": os.getloadavg()[0]}
                runs.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")
    lines = ["| repeat | mode | setting | wall s (all jobs) | per job: process s / training s / loss | what it said |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        jobs = "; ".join(f"{j['process_s']} / {j['train_s']} / {j['loss']}" for j in r["jobs"])
        said = " / ".join(f"{len(j['said'])} lines" for j in r["jobs"])
        lines.append(f"| {r['repeat'] + 1} | {r['mode']} | {r['setting']} | {r['wall_s']} | {jobs} | {said} |")
    for mode in ("alone", "pair"):
        med = {s: statistics.median(r["wall_s"] for r in runs if r["mode"] == mode and r["setting"] == s)
               for s in SETTINGS}
        lines.append(f"\n{mode}: governed / sleeping wall time = {med['governed'] / med['sleeping']:.2f}x "
                     f"(medians {med['governed']:.1f} / {med['sleeping']:.1f} s)")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
