"""Python's cyclic collector in a ``surefit train`` run: how often it walks every object and what that costs, with the
command's hold (``training/heap.collector_off_for_set_up``, the default: no collections from the imports to the
training loop, then one, the survivors frozen) and without it (the collector as Python sets it, throughout).

Each run is ``surefit train`` in its own process, the two settings interleaved (``--repeats``), on the settings of a
``cpu_sft.py --keep`` work folder's surefit run (its ``run-surefit/config.yaml``: model, data, LoRA, batch, length),
with no start-up cache, so every run does the same work. A ``gc.callbacks`` hook in the worker times every
collection; the JSON keeps each full one (seconds, when, objects freed) and the others' counts and seconds. The
epoch's seconds come from the run's ``metrics.jsonl`` (``time_per_epoch``: its steps), the whole process from launch
to exit.

    .venv/bin/python benchmarks/cpu_sft.py --only surefit --workdir /tmp/w --keep     # once: the work folder
    .venv/bin/python benchmarks/gc_pauses.py --work /tmp/w [--repeats 2] [--out benchmarks/results/...]

Timings need a quiet machine: compare the two settings within one run of this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402


def worker(config: Path, out: Path, freeze: bool, result: Path, extra: list[str]) -> None:
    import gc

    begun = time.perf_counter()
    pauses: list[dict[str, Any]] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            t = started.pop()
            pauses.append({"generation": info["generation"], "seconds": time.perf_counter() - t,
                           "at": t - begun, "collected": info.get("collected", 0)})

    gc.callbacks.append(on_gc)
    from contextlib import nullcontext

    import surefit.training.heap as heap
    from surefit.cli import main

    if not freeze:
        heap.collector_off_for_set_up = nullcontext  # main() imports it from the module when it runs
    code = main(["train", "--config", str(config), "--output_dir", str(out), "--no_cache", *extra])
    gc.callbacks.remove(on_gc)
    result.write_text(json.dumps({"code": code, "pauses": pauses, "peak_rss_mb": benchlib.peak_rss_mb()}),
                      encoding="utf-8")


def _epoch_seconds(run: Path) -> float | None:
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if "time_per_epoch" in rec:
            return float(rec["time_per_epoch"])
    return None


def one(config: Path, work: Path, name: str, freeze: bool, extra: list[str]) -> dict[str, Any]:
    out, result = work / f"run-{name}", work / f"{name}.json"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--worker", str(config), str(out), str(int(freeze)), str(result),
                    *extra], check=True, stdout=(work / f"{name}.log").open("w"), stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    rec = json.loads(result.read_text(encoding="utf-8"))
    step1 = json.loads((out / "startup.json").read_text(encoding="utf-8"))["seconds"]
    pauses = rec["pauses"]
    full = [p for p in pauses if p["generation"] == 2]
    after = [p for p in pauses if p["at"] >= step1]
    return {"name": name, "freeze": freeze, "whole_process_s": round(wall, 2), "epoch_s": _epoch_seconds(out),
            "start_up_s": step1, "collections": len(pauses), "gc_seconds": round(sum(p["seconds"] for p in pauses), 3),
            "full_collections": len(full), "full_seconds": round(sum(p["seconds"] for p in full), 3),
            "gc_seconds_from_step1": round(sum(p["seconds"] for p in after), 3),
            "full_from_step1": sum(1 for p in after if p["generation"] == 2), "peak_rss_mb": rec["peak_rss_mb"],
            "by_generation": {g: {"count": sum(1 for p in pauses if p["generation"] == g),
                                  "seconds": round(sum(p["seconds"] for p in pauses if p["generation"] == g), 4)}
                              for g in (0, 1, 2)},
            "full_collections_each": full}  # the young generations' hundreds of short ones: counted, not listed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", help="a cpu_sft.py --keep work folder (its run-surefit/config.yaml is the job)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="results folder (default: the work folder)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    if args.worker:
        config, out, freeze, result = args.worker[:4]
        worker(Path(config), Path(out), freeze == "1", Path(result), args.worker[4:] + extra)
        return
    work = Path(args.work)
    config = work / "run-surefit" / "config.yaml"
    tmp = Path(tempfile.mkdtemp(prefix="gc_pauses-", dir=work))
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        for freeze in order:
            name = f"{'held' if freeze else 'python_default'}-{r}"
            runs.append(one(config, tmp, name, freeze, extra))
            x = runs[-1]
            print(f"{name}: whole {x['whole_process_s']} s, epoch {x['epoch_s']} s, {x['collections']} collections "
                  f"{x['gc_seconds']} s ({x['full_collections']} full, {x['full_seconds']} s; from step 1 "
                  f"{x['gc_seconds_from_step1']} s, {x['full_from_step1']} full)", flush=True)
    out = Path(args.out) if args.out else work
    out.mkdir(parents=True, exist_ok=True)
    keys = ["whole_process_s", "epoch_s", "start_up_s", "collections", "gc_seconds", "full_collections",
            "full_seconds", "gc_seconds_from_step1", "full_from_step1", "peak_rss_mb"]
    summary = {name: {k: statistics.median(x[k] for x in runs if x["freeze"] == f) for k in keys}
               for name, f in (("held (default)", True), ("python_default", False))}
    machine = benchlib.machine_info()
    (out / "gc_pauses.json").write_text(json.dumps({"config": str(config), "summary": summary, "runs": runs,
                                                    "machine": machine}, indent=1), encoding="utf-8")
    lines = ["# gc_pauses: Python's cyclic collector in a surefit run", "",
             f"Job: `{config}` (a `cpu_sft.py` work folder's surefit run), no start-up cache, {args.repeats} "
             "interleaved repeats per setting; medians.", "",
             "| setting | whole process s | epoch s | start-up s | collections | their s | full | full s | s from step 1 "
             "| full from step 1 | peak RSS MB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | " + " | ".join(str(round(s[k], 3)) for k in keys) + " |")
    flags = " ".join(extra)
    lines += ["", f"Machine: {machine['cpu_model']}, {machine['cpus_usable']} usable cores, torch "
              f"{machine['versions']['torch']}, Python {machine['python']}.", "",
              f"Command: `.venv/bin/python benchmarks/gc_pauses.py --work WORK --repeats {args.repeats} {flags}`"]
    (out / "gc_pauses.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {out / 'gc_pauses.md'}")


if __name__ == "__main__":
    main()
