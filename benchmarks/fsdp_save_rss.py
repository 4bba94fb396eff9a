"""Host peak RSS of each process while a ``--sharding fsdp`` checkpoint is saved (issue 35): 2 gloo processes, full
fine-tuning of the embedded SmolLM2-135M in fp32 (AdamW: two fp32 states per weight, so the optimizer state is
twice the model), before and after checkpoints were written shard by shard.

- ``before``: the gather path (the main process receives the whole optimizer state and the full weights, and writes
  ``trainable.safetensors`` and ``optimizer.pt``): the source tree of commit 8f96729 (``git archive``, or
  ``--before_src``).
- ``after``: this tree (each process writes its shard with torch.distributed.checkpoint).

Each variant is one ``surefit train`` of 2 processes under torchrun (``--max_steps 2 --save_every 1
--val_fraction 0``): a step checkpoint after step 1 (weights and optimizer state only) and the epoch-end checkpoint
after step 2, which also exports ``model/`` (the whole weights, in safetensors). Every process wraps the loop's
``checkpoint`` call: the kernel's high-water mark (``VmHWM``) is reset to the current RSS (``/proc/self/clear_refs``)
just before it and read just after, so ``peak`` is that process's own peak during the save and ``growth`` what the
save added to the RSS it had.

Each variant runs twice, in the order before, after, after, before (the RSS a process has before its first save
varies by a few hundred MB from run to run with the same code: the allocator's release of the model loaded whole
before it was sharded; the growth during the save does not).

    PYTHONPATH=src .venv/bin/python benchmarks/fsdp_save_rss.py [--only before,after,after,before] [--out benchmarks/results/fsdp_save_rss]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BEFORE = "8f96729"
WORDS = "the cat sat on a mat dog ran to park bird flew over tree red blue green big small city river".split()


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(out: Path, argv: list[str]) -> int:
    """One training process (under torchrun): ``surefit train ARGV`` with every checkpoint's RSS recorded."""
    import surefit.training.loop as loop
    from surefit.cli import main

    rank = int(os.environ.get("RANK", "0"))
    original = loop._Fit.checkpoint

    def checkpoint(self: Any, name: str, export: bool) -> Any:
        before = _status_mb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        t0 = time.perf_counter()
        try:
            return original(self, name, export)
        finally:
            peak = _status_mb("VmHWM")
            record = {"rank": rank, "checkpoint": name, "exports_model": export, "rss_before_mb": round(before, 1),
                      "peak_mb": round(peak, 1), "growth_mb": round(peak - before, 1),
                      "seconds": round(time.perf_counter() - t0, 2)}
            with (out / f"rss-rank{rank}.jsonl").open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    loop._Fit.checkpoint = checkpoint
    return main(["train", *argv])


def write_rows(path: Path, n: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            w = [WORDS[(i * k + k) % len(WORDS)] for k in range(1, 9)]
            f.write(json.dumps({"instruction": f"Repeat {i}: " + " ".join(w[:5]), "input": "",
                                "output": " ".join(w[3:]) + f" {i}."}) + "\n")


def source_tree(commit: str, into: Path) -> Path:
    """``src/`` of ``commit`` (this repository's history), extracted into ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"], capture_output=True, check=True)
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def run_variant(name: str, src: Path, work: Path, data: Path, index: int) -> dict[str, Any]:
    out = work / f"{index}-{name}"
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(src)}
    args = ["--data", str(data), "--output_dir", str(out / "run"), "--lora_r", "0", "--precision", "fp32",
            "--batch_size", "2", "--grad_accum", "1", "--max_steps", "2", "--save_every", "1", "--val_fraction", "0",
            "--max_seq_length", "64", "--sharding", "fsdp", "--no_cache", "--log_every", "1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(Path(__file__)),
           "--worker", str(out), "--", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    (out / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}); see {out / 'log.txt'}:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for rank in (0, 1)
               for line in (out / f"rss-rank{rank}.jsonl").read_text(encoding="utf-8").splitlines()]
    ckpts = out / "run" / "checkpoints"
    sizes = {p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in ckpts.iterdir()}
    files = {p.name: sorted(str(f.relative_to(p)) for f in p.rglob("*")
                            if f.is_file() and not str(f.relative_to(p)).startswith("model/")) for p in ckpts.iterdir()}
    return {"variant": name, "run": index, "source": str(src), "wall_s": round(time.perf_counter() - t0, 1), "saves": records,
            "checkpoint_bytes": sizes, "checkpoint_files": files}


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = ["# FSDP checkpoint save: host RSS of each process (issue 35)", "",
             f"2 gloo processes, embedded SmolLM2-135M, full fine-tuning in fp32 (AdamW), `--max_steps 2 "
             f"--save_every 1 --val_fraction 0 --max_seq_length 64`. Machine: {meta['machine']}. Load average "
             f"before / after: {meta['loadavg_before']} / {meta['loadavg_after']} (2 cores shared with other jobs: "
             "the seconds are noisy, the megabytes are not).", "",
             "`peak`: the process's high-water mark during the save (reset just before it); `growth`: peak minus "
             "the RSS it had just before the save.", "",
             "| run: variant | checkpoint | model/ exported | rank | RSS before (MB) | peak (MB) | growth (MB) | s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for s in sorted(r["saves"], key=lambda s: (s["checkpoint"], s["rank"])):
            lines.append(f"| {r['run']}: {r['variant']} | {s['checkpoint']} | {'yes' if s['exports_model'] else 'no'} | "
                         f"{s['rank']} | {s['rss_before_mb']:.0f} | {s['peak_mb']:.0f} | {s['growth_mb']:.0f} | "
                         f"{s['seconds']:.1f} |")
    lines += ["", "Files of the step checkpoint:", ""]
    for r in {r["variant"]: r for r in results}.values():
        step = next((v for k, v in r["checkpoint_files"].items() if k.startswith("step-")), [])
        lines.append(f"- {r['variant']}: {', '.join(step)}")
    lines += ["", "The main process's growth during each save, per run:", ""]
    for variant in dict.fromkeys(r["variant"] for r in results):
        for name in sorted({s["checkpoint"] for r in results for s in r["saves"]}):
            growth = [s["growth_mb"] for r in results if r["variant"] == variant for s in r["saves"]
                      if s["checkpoint"] == name and s["rank"] == 0]
            lines.append(f"- {variant}, {name}: {' / '.join(f'{g:.0f}' for g in growth)} MB")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--only", default="before,after,after,before", help="variants in order (repeats allowed)")
    ap.add_argument("--before_src", default=None, help=f"the source tree of the gather path (default: {BEFORE}'s)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args, rest = ap.parse_known_args()
    if args.worker:
        sys.exit(worker(Path(args.worker), [a for a in rest if a != "--"]))
    sys.path.insert(0, str(HERE))
    from benchlib import loadavg, machine_info

    with tempfile.TemporaryDirectory(prefix="fsdp_save_rss-") as tmp:
        work = Path(tmp)
        data = work / "rows.jsonl"
        write_rows(data, args.rows)
        meta: dict[str, Any] = {"machine": machine_info(), "loadavg_before": loadavg(), "before_commit": BEFORE}
        results = []
        trees = {"before": Path(args.before_src) if args.before_src else source_tree(BEFORE, work / "before-tree"),
                 # a copy: the tree may be edited while the benchmark runs
                 "after": Path(shutil.copytree(REPO / "src", work / "after-tree" / "src"))}
        for index, name in enumerate(args.only.split(","), 1):
            results.append(run_variant(name, trees[name], work, data, index))
            print(json.dumps(results[-1]["saves"]), flush=True)
        meta["loadavg_after"] = loadavg()
    text = report(results, meta)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({**meta, "results": results}, indent=2) + "\n",
                                            encoding="utf-8")
        Path(args.out + ".md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
