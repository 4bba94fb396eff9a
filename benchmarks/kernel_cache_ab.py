"""oneDNN's primitive cache capped by surefit (32) or at oneDNN's default (1,024): resident memory step by step, time.

oneDNN runs torch's 16-bit matmuls on a CPU and keeps a primitive for every shape it meets; each training batch of a
new length brings a new set (18 on SmolLM2 with LoRA), made in the middle of the step. Since 2026-12-03 surefit's
commands set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=64`` unless the user set it (``threads.py``). Here one surefit
run per process, alternating, on a workload that ``cpu_sft.py --keep`` left (its ``train.jsonl``, ``val.jsonl`` and
``spec.json``): ``surefit`` leaves the variable unset (surefit's cap), a number sets it (``1024``: as before). Each
run records VmRSS and VmHWM after every optimizer step.

    python benchmarks/cpu_sft.py --workload chat --only surefit --keep --workdir /tmp/chat
    python benchmarks/kernel_cache_ab.py --workdir /tmp/chat --pairs 3 --out benchmarks/results/epyc_zen4/kernel_cache_chat

Writes OUT.json and OUT.md (nothing with no --out). One job at a time on the machine: two trainings at once slow
each other several times over.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) // 1024
    return out


def child(work: Path, capacity: str, out: Path) -> None:
    from benchlib import kept_surefit_settings

    import surefit
    import surefit.training.loop as loop

    steps: list[dict[str, int]] = []
    original = loop._Fit.optimizer_step

    def step(self: Any, *a: Any, **k: Any) -> Any:
        result = original(self, *a, **k)
        steps.append(_status())
        return result

    loop._Fit.optimizer_step = step
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    surefit.train(**kept_surefit_settings(work, out))
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    epochs = [r for r in records if r.get("type") == "epoch"]
    print(json.dumps({
        "capacity": capacity, "in_force": os.environ.get(VARIABLE), "train_call_seconds": round(wall, 1),
        "train_seconds": round(epochs[-1]["time_per_epoch"], 1), "final_loss": epochs[-1]["train_loss"],
        "eval_seconds": [e.get("eval_seconds") for e in epochs], "peak_rss_mb": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), "rss_after_steps_mb": [s["VmRSS"] for s in steps],
        "hwm_after_steps_mb": [s["VmHWM"] for s in steps]}))


def _markdown(rec: dict[str, Any]) -> str:
    caps = rec["capacities"]
    lines = [f"# kernel_cache_ab: oneDNN's primitive cache, {rec['workload']} rows ({rec['pairs']} alternating pairs)",
             "", "| capacity | peak RSS MB (each run) | median | RSS after the last step MB | training s (each) | "
             "whole train() call s (each) | final loss |", "|---|---|---|---|---|---|---|"]
    for cap in caps:
        rs = [r for r in rec["runs"] if r["capacity"] == cap]
        name = f"{cap} (surefit's, variable unset)" if cap == "surefit" else cap
        lines.append(f"| {name} | {', '.join(str(r['peak_rss_mb']) for r in rs)} | "
                     f"{statistics.median(r['peak_rss_mb'] for r in rs):,.0f} | "
                     f"{', '.join(str(r['rss_after_steps_mb'][-1]) for r in rs)} | "
                     f"{', '.join(str(r['train_seconds']) for r in rs)} | "
                     f"{', '.join(str(r['train_call_seconds']) for r in rs)} | {rs[0]['final_loss']:.6f} |")
    lines += ["", "VmHWM after each optimizer step, first run of each:", ""]
    for cap in caps:
        r = next(r for r in rec["runs"] if r["capacity"] == cap)
        lines.append(f"- {cap}: {' '.join(str(x) for x in r['hwm_after_steps_mb'])}")
    lines += ["", f"Command: `{rec['command']}`", "", f"Machine: {rec['machine']}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, help="a cpu_sft.py work folder (train.jsonl, val.jsonl, spec.json)")
    ap.add_argument("--capacities", default="surefit,1024", help="comma-separated: surefit (unset) or a number")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", default=None, help="results path without suffix (.json and .md)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.workdir)
    if args.child is not None:
        child(work, args.child, work / f"kernel-cache-{args.child}")
        return
    import benchlib

    caps = args.capacities.split(",")
    runs = []
    for p in range(args.pairs):
        for cap in (caps if p % 2 == 0 else caps[::-1]):
            env = {k: v for k, v in os.environ.items() if k not in (VARIABLE, "DNNL_PRIMITIVE_CACHE_CAPACITY")}
            if cap != "surefit":
                env[VARIABLE] = cap
            done = subprocess.run([sys.executable, __file__, "--workdir", str(work), "--child", cap], env=env,
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"run with capacity {cap} failed:\n{done.stderr[-3000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps({k: v for k, v in runs[-1].items() if not k.endswith("steps_mb")}), flush=True)
    spec = json.loads((work / "spec.json").read_text(encoding="utf-8"))
    m = benchlib.machine_info()
    rec = {"benchmark": "kernel_cache_ab", "workload": spec.get("workload"), "pairs": args.pairs, "capacities": caps,
           "runs": runs, "machine": f"{m.get('cpu_model', '')}, {m.get('cpus_usable', '')} usable cores, "
                                     f"{', '.join(m.get('cpu_flags') or [])}; "
                                     f"torch {m.get('versions', {}).get('torch', '')}",
           "command": "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    print(_markdown(rec))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(rec, indent=1) + "\n")
        out.with_suffix(".md").write_text(_markdown(rec) + "\n")


if __name__ == "__main__":
    main()
