"""Start-up to step 1, the loss-only evaluation before training, and peak RSS per row, at 2k and 20k rows (issue 35).

The issue's setting: a synthetic Alpaca file of short rows (written by this script), the embedded SmolLM2-135M,
``--max_steps 2 --val_fraction 0.001 --eval_generate false``, start-up cache off (the doctor and planner run). Each
run is its own ``surefit train`` process; its peak RSS is the kernel's ``ru_maxrss`` of that child (``os.wait4``), its
phases come from ``OUTPUT/startup.json``. Every size runs with ``OMP_NUM_THREADS=1`` and with torch's default (one
thread per core), in one session, so the ratios compare like with like on a machine shared with other jobs.

``--holders N`` measures in this process what holds the memory per row after each data stage (tracemalloc):
the rows read, the encoded examples, the features list handed to the loop.

    PYTHONPATH=src .venv/bin/python benchmarks/eval_scaling.py [--sizes 2000,20000] [--holders 2000] [--quick]
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

WORDS = "the cat sat on a mat dog ran to park bird flew over tree red blue green big small city river".split()


def write_rows(path: Path, n: int) -> None:
    """Short Alpaca rows (about 10 words each side), distinct, deterministic."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            w = [WORDS[(i * k + k) % len(WORDS)] for k in range(1, 9)]
            f.write(json.dumps({"instruction": f"Repeat {i}: " + " ".join(w[:5]), "input": "",
                                "output": " ".join(w[3:]) + f" {i}."}) + "\n")


def run_train(data: Path, out: Path, threads: str | None, timeout: float, src: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    argv = [sys.executable, "-m", "surefit", "train", "--data", str(data), "--max_steps", "2",
            "--val_fraction", "0.001", "--eval_generate", "false", "--no_cache", "true", "--output_dir", str(out)]
    t0 = time.time()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = t0 + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"timed out: {' '.join(argv)}")
        time.sleep(0.5)
    log = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    if status != 0:
        raise SystemExit(f"failed ({status}): {' '.join(argv)}\n{log[-3000:]}")
    startup = json.loads((out / "startup.json").read_text(encoding="utf-8"))
    report = json.loads((out / "data_report.json").read_text(encoding="utf-8"))
    val = report["encoding"]["validation"]["encoded"]
    phases = startup["phases"]
    return {"threads": threads or "default", "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "startup_s": startup["seconds"], "encoding_s": phases.get("encoding data"),
            "eval_s": phases.get("evaluation before training"), "validation_rows": val,
            "eval_s_per_row": round(phases.get("evaluation before training", 0) / max(val, 1), 3),
            "doctor_s": phases.get("doctor"), "phases": phases, "wall_s": round(time.time() - t0, 1)}


def holders(n: int, workdir: Path, src: Path) -> dict[str, Any]:
    """Bytes per row held after reading, after encoding, and by the features list (tracemalloc, this process)."""
    import tracemalloc

    sys.path.insert(0, str(src))

    from surefit.config import SFTConfig, build_config
    from surefit.models import resolve_model
    from surefit.tasks.sft.train_sft import Encoder, load_data, load_tokenizer, model_folder

    data = workdir / f"holders_{n}.jsonl"
    write_rows(data, n)
    cfg = build_config(SFTConfig, None, {"data": str(data), "val_fraction": 0.001, "output_dir": str(workdir / "h")})
    source = resolve_model(cfg.model)
    tokenizer, _ = load_tokenizer(model_folder(source, log=lambda _: None), source, False)
    quiet = lambda _: None  # noqa: E731
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    train_rows, val_rows, report = load_data(cfg, quiet, [], None)
    after_rows, peak_rows = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    encoder = Encoder.build(cfg, tokenizer, report["format"], report["format_conversational"])
    train_ex, _ = encoder.encode(train_rows, "train")
    after_encode, peak_encode = tracemalloc.get_traced_memory()
    features = [e.features() for e in train_ex]
    after_features = tracemalloc.get_traced_memory()[0]
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    top = [{"where": str(s.traceback[0]), "bytes_per_row": round(s.size / n)}
           for s in snap.statistics("lineno")[:8]]
    ids = sum(len(e.input_ids) for e in train_ex) / len(train_ex)
    del features
    return {"rows": n, "tokens_per_row": round(ids, 1),
            "rows_read_bytes_per_row": round((after_rows - base) / n),
            "encoded_examples_bytes_per_row": round((after_encode - after_rows) / n),
            "features_list_bytes_per_row": round((after_features - after_encode) / n),
            # the high-water marks while reading and while encoding, above what was held before each stage
            "reading_peak_bytes_per_row": round((peak_rows - base) / n),
            "encoding_peak_bytes_per_row": round((peak_encode - after_rows) / n),
            "top_allocation_sites": top}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2000,20000")
    ap.add_argument("--threads", default="1,default", help="OMP_NUM_THREADS values; 'default' leaves it unset")
    ap.add_argument("--holders", type=int, default=2000, help="rows for the in-process memory breakdown (0: skip)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--holders-only", action="store_true", help="only the in-process breakdown (to --out)")
    ap.add_argument("--quick", action="store_true", help="200 rows, one thread setting, no files written")
    ap.add_argument("--src", default=str(HERE.parent / "src"), help="the surefit source to run (a before/after pair)")
    ap.add_argument("--out", default=str(HERE / "results" / "eval_scaling"))
    args = ap.parse_args()
    src = Path(args.src).resolve()
    sizes = [200] if args.quick else [int(s) for s in args.sizes.split(",")]
    threads = ["1"] if args.quick else args.threads.split(",")
    result: dict[str, Any] = {"machine": machine_info(), "command": " ".join(sys.argv), "src": str(src), "runs": [],
                              "loads": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n in [] if args.holders_only else sizes:
            data = work / f"alpaca_{n}.jsonl"
            write_rows(data, n)
            for t in threads:
                result["loads"].append(loadavg())
                rec = run_train(data, work / f"out_{n}_{t}", None if t == "default" else t, args.timeout, src)
                rec["rows"] = n
                result["runs"].append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "phases"}), flush=True)
        if args.holders and not args.quick:
            result["holders"] = holders(args.holders, work, src)
            print(json.dumps(result["holders"]), flush=True)
    result["loads"].append(loadavg())
    if not args.quick:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
