"""Giving the C heap back before the first training step, or not: page faults, system time, peak RSS, one epoch.

Until 2026-11-28 the loop handed glibc's free pages back to the system after the set-up and around the evaluation
before training (``training/heap.py``); step 1 then faulted the same memory in again. The loop now gives nothing back
before its first step. ``--mode given_back`` puts the earlier calls back (a wrapper around the loop's ``start`` and
``evaluate``), ``--mode kept`` runs the code as it is. One surefit run per call, alone on the machine, on a workload
that ``cpu_sft.py --keep`` left (its ``train.jsonl``, ``val.jsonl`` and ``spec.json``):

    python benchmarks/cpu_sft.py --workload chat --only surefit --keep --workdir /tmp/chat
    python benchmarks/heap_before_step1.py --workdir /tmp/chat --mode given_back
    python benchmarks/heap_before_step1.py --workdir /tmp/chat --mode kept

Prints one JSON line: step 1's forward (seconds, system seconds, minor page faults), the process's page faults,
system and user CPU seconds, peak RSS, the epoch's training seconds and loss, and the start-up seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, help="a cpu_sft.py work folder (train.jsonl, val.jsonl, spec.json)")
    ap.add_argument("--mode", choices=["given_back", "kept"], required=True)
    ap.add_argument("--out", default=None, help="the run folder (default: WORKDIR/heap-MODE)")
    args = ap.parse_args()

    from benchlib import kept_surefit_settings

    import surefit
    import surefit.tasks.runner as runner
    import surefit.training.loop as loop
    from surefit.training.heap import release_free_memory

    if args.mode == "given_back":  # the loop as it was: after the set-up, and around every evaluation
        start, evaluate = loop._Fit.start, loop._Fit.evaluate

        def start_giving_back(self: Any) -> None:
            release_free_memory()
            start(self)

        def evaluate_giving_back(self: Any, *a: Any, **k: Any) -> Any:
            if self.stepped:
                return evaluate(self, *a, **k)  # gives back itself
            release_free_memory()
            try:
                return evaluate(self, *a, **k)
            finally:
                release_free_memory()

        loop._Fit.start, loop._Fit.evaluate = start_giving_back, evaluate_giving_back

    first: dict[str, Any] = {}
    starting = runner._starting

    def timed_starting(clock: Any, folder: Any, loss_fn: Any, times: Any) -> Any:
        def loss(model: Any, batch: Any) -> Any:
            if first:
                return loss_fn(model, batch)
            r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            out = loss_fn(model, batch)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            first.update(seconds=round(time.perf_counter() - t, 2), sys=round(r1.ru_stime - r0.ru_stime, 2),
                         faults=r1.ru_minflt - r0.ru_minflt)
            return out

        return starting(clock, folder, loss, times)

    runner._starting = timed_starting
    work = Path(args.workdir)
    out = Path(args.out) if args.out else work / f"heap-{args.mode}"
    shutil.rmtree(out, ignore_errors=True)
    spec = json.loads((work / "spec.json").read_text(encoding="utf-8"))
    surefit.train(**kept_surefit_settings(work, out))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    epochs = [r for r in records if r.get("type") == "epoch"]
    startup = json.loads((out / "startup.json").read_text(encoding="utf-8"))
    print(json.dumps({
        "workload": spec.get("workload"), "mode": args.mode, "step1_forward": first,
        "process_seconds": round(time.perf_counter() - T0, 1), "faults": ru.ru_minflt, "sys": round(ru.ru_stime, 2),
        "user": round(ru.ru_utime, 2), "peak_rss_mb": round(ru.ru_maxrss / 1024, 1),
        "train_seconds": round(epochs[-1]["time_per_epoch"], 1), "final_loss": epochs[-1]["train_loss"],
        "eval_seconds": [e.get("eval_seconds") for e in epochs], "startup_seconds": startup["seconds"]}))


if __name__ == "__main__":
    main()
