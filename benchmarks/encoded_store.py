"""The encoded-data cache (issue 35): peak RSS and start-up to step 1 on a cache hit as the rows grow, and encoding
throughput on this machine's cores against ``datasets.map`` with the same tokenizer.

Three parts, each in its own processes (peak RSS: ``cli``, the kernel's ``ru_maxrss`` of that child from ``os.wait4``,
which on Linux also covers the driver's RSS at the fork; ``store``, the child's own ``VmHWM``):

- ``cli``: ``surefit train`` on a synthetic Alpaca file (short rows, written here) with the embedded SmolLM2-135M,
  ``--max_steps 2 --eval_generate false`` and a fixed 20-row ``--val_data`` (so the evaluation before training is the
  same at every size); first run a miss (reads, encodes, writes the store), second run a hit. ``OMP_NUM_THREADS=1``.
- ``store``: the store alone at sizes a full run cannot reach on this shared machine: a store of N synthetic examples
  (token lengths like the Alpaca rows') written with ``StoreWriter`` and opened once (as the run that wrote it does),
  then a child process (a later run's hit) opens it, builds epoch 0's length-grouped steps with the loop's own
  sampler and reads the first 50 steps' examples.
- ``encoding``: rows/s of surefit's encoding of the Alpaca rows (read as one-turn conversations, rendered with the
  model's chat template: ``Encoder.encode_into``, one and two processes) against ``datasets.Dataset.map`` (batched,
  ``num_proc`` 1 and 2) rendering the same conversations with the same tokenizer's ``apply_chat_template``.

    PYTHONPATH=src .venv/bin/python benchmarks/encoded_store.py [--parts cli,store,encoding] [--cli-sizes 20000,200000]
        [--store-sizes 20000,200000,2000000] [--quick]
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
sys.path.insert(0, str(HERE))
from benchlib import loadavg, machine_info  # noqa: E402

WORDS = "the cat sat on a mat dog ran to park bird flew over tree red blue green big small city river".split()


def write_rows(path: Path, n: int, start: int = 0) -> None:
    """Short Alpaca rows (about 10 words each side), distinct, deterministic."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(start, start + n):
            w = [WORDS[(i * k + k) % len(WORDS)] for k in range(1, 9)]
            f.write(json.dumps({"instruction": f"Repeat {i}: " + " ".join(w[:5]), "input": "",
                                "output": " ".join(w[3:]) + f" {i}."}) + "\n")


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int, Any]:
    deadline = time.time() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage
        if time.time() > deadline:
            proc.kill()
            raise SystemExit(f"timed out: {proc.args}")
        time.sleep(0.2)


def run_train(data: Path, val: Path, out: Path, cache: Path, timeout: float, src: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "SUREFIT_STARTUP_CACHE": str(cache)}
    argv = [sys.executable, "-m", "surefit", "train", "--data", str(data), "--val_data", str(val), "--max_steps", "2",
            "--eval_generate", "false", "--output_dir", str(out)]
    t0 = time.time()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    status, usage = _wait(proc, timeout)
    if status != 0:
        raise SystemExit(f"failed ({status}): {' '.join(argv)}\n{log[-3000:]}")
    startup = json.loads((out / "startup.json").read_text(encoding="utf-8"))
    report = json.loads((out / "data_report.json").read_text(encoding="utf-8"))
    return {"peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "startup_s": startup["seconds"],
            "store": report["encoded_store"]["status"], "encoding_s": startup["phases"].get("encoding data"),
            "phases": startup["phases"], "wall_s": round(time.time() - t0, 1)}


def part_cli(sizes: list[int], work: Path, timeout: float, src: Path, result: dict[str, Any]) -> None:
    val = work / "val.jsonl"
    write_rows(val, 20, start=10**8)  # rows of their own: no leak into training
    for n in sizes:
        data = work / f"alpaca_{n}.jsonl"
        write_rows(data, n)
        cache = work / f"cache_{n}"
        for attempt in ("miss", "hit"):
            result["loads"].append(loadavg())
            rec = run_train(data, val, work / f"out_{n}_{attempt}", cache, timeout, src)
            rec.update(rows=n, run=attempt)
            result["cli"].append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "phases"}), flush=True)
            save(result)
        data.unlink()


STORE_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from pathlib import Path
import surefit.training.loop  # noqa: F401 - what a run has imported (torch, the loop) before it reads data
from surefit.data.encoded_store import EncodedStore
def status():  # this process's own RSS and peak (VmHWM: of the address space exec made)
    return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in open("/proc/self/status"))
            if k in ("VmRSS", "VmHWM")}
after_imports = status()["VmRSS"]
try:  # the loop's sampler: versioned (epoch_steps) since issue 35's read side; step_batches before
    from surefit.data.sampling import epoch_steps as sampler
except ImportError:
    from surefit.data.sampling import step_batches as sampler
folder, key = Path(sys.argv[1]), json.loads(sys.argv[2])
t1 = time.perf_counter()
store = EncodedStore.open(folder, key)
split = store.split("train")
t2 = time.perf_counter()
steps = sampler(split.lengths, 16, 0, 0)
t3 = time.perf_counter()
tokens = 0
for k in range(50):
    tokens += sum(len(split[i]["input_ids"]) for i in steps[k])
t4 = time.perf_counter()
# ru_maxrss is not this process's own: Linux carries the parent's RSS at the fork over the exec, so it reported the
# driver's memory (which grows with the store it writes) as the child's. VmHWM is.
print(json.dumps({"examples": len(split), "imports_s": t1 - t0, "open_and_check_s": t2 - t1, "sampler_s": t3 - t2,
                  "read_50_steps_s": t4 - t3, "to_step_1_s": t4 - t0 - (t4 - t3) * 49 / 50, "tokens_read": tokens,
                  "peak_rss_mb": status()["VmHWM"], "rss_after_imports_mb": after_imports,
                  "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


MISS_CHILD = r"""
import json, resource, sys, time
from surefit.config import SFTConfig, build_config
from surefit.models import resolve_model
from surefit.tasks.sft.train_sft import load_encoded
cfg = build_config(SFTConfig, None, {"data": sys.argv[1], "val_data": sys.argv[2], "output_dir": sys.argv[3]})
source = resolve_model(cfg.model)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
data = load_encoded(cfg, source, lambda _: None, [])
print(json.dumps({"store": data.store.status, "examples": len(data.features), "seconds": time.perf_counter() - t0,
                  "peak_rss_before_data_mb": before,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def part_miss(sizes: list[int], work: Path, src: Path, result: dict[str, Any]) -> None:
    """A miss alone (``load_encoded``: read, split, encode on every core, write the store) in a child process, its
    peak RSS as the rows grow (the model is not loaded: what is measured is the data's share)."""
    val = work / "miss_val.jsonl"
    write_rows(val, 20, start=10**8)
    for n in sizes:
        data = work / f"miss_{n}.jsonl"
        write_rows(data, n)
        result["loads"].append(loadavg())
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1",
               "SUREFIT_STARTUP_CACHE": str(work / f"miss_cache_{n}")}
        proc = subprocess.Popen([sys.executable, "-c", MISS_CHILD, str(data), str(val), str(work / f"miss_out_{n}")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
        status, usage = _wait(proc, 7200)
        if status != 0:
            raise SystemExit(out[-3000:])
        rec = json.loads([x for x in out.splitlines() if x.startswith("{")][-1])  # warnings may follow
        rec.update(rows=n, child_peak_rss_mb=round(usage.ru_maxrss / 1024, 1), load_after=loadavg())
        result.setdefault("miss", []).append(rec)
        print(json.dumps(rec), flush=True)
        save(result)
        data.unlink()


def part_store(sizes: list[int], work: Path, src: Path, result: dict[str, Any], repeats: int = 3) -> None:
    import numpy as np

    sys.path.insert(0, str(src))
    from surefit.data.encoded_store import SplitArrays, StoreWriter

    for n in sizes:
        folder, key = work / f"store_{n}", {"rows": n}
        writer = StoreWriter(folder, key)
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        for a in range(0, n, 100_000):
            m = min(100_000, n - a)
            lengths = rng.integers(45, 66, size=m)  # the Alpaca rows' tokens with SmolLM2's template
            total = int(lengths.sum())
            ids = rng.integers(0, 49152, size=total, dtype=np.int32)
            labels = ids.copy()
            prompt = (lengths * 0.7).astype(np.int32)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            for s, p in zip(starts, prompt, strict=True):
                labels[s:s + p] = -100
            writer.add("train", SplitArrays(ids, labels, lengths, prompt, (lengths - prompt).astype(np.int32),
                                            np.arange(a, a + m), [f"alpaca.jsonl line {i + 1}" for i in range(a, a + m)]))
        writer.commit(None)
        written = time.perf_counter() - t0
        # What the run that wrote the store does next (tasks/sft): open it once. Since issue 35's read side this
        # first open checks every byte and saves the chunks' checksums, so the child below is a later run's hit.
        from surefit.data.encoded_store import EncodedStore

        t0 = time.perf_counter()
        assert EncodedStore.open(folder, key) is not None
        first_open = time.perf_counter() - t0
        size_mb = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
        runs = []
        for _ in range(repeats):  # the median of each figure: imports alone swing by seconds on a shared machine
            result["loads"].append(loadavg())
            proc = subprocess.Popen([sys.executable, "-c", STORE_CHILD, str(folder), json.dumps(key)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out = proc.stdout.read().decode() if proc.stdout else ""
            status, usage = _wait(proc, 1800)
            if status != 0:
                raise SystemExit(out[-3000:])
            run = json.loads([x for x in out.strip().splitlines() if x.startswith("{")][-1])
            run["child_ru_maxrss_mb"] = round(usage.ru_maxrss / 1024, 1)
            run["data_s"] = run["to_step_1_s"] - run["imports_s"]  # open, sampler, first step: what rows could grow
            runs.append(run)
        rec = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rec.update(rows=n, write_s=round(written, 2), first_open_s=round(first_open, 2), store_mb=round(size_mb, 1),
                   repeats=runs)
        result["store"].append(rec)
        print(json.dumps(rec), flush=True)
        save(result)
        import shutil

        shutil.rmtree(folder)


def _cpu() -> float:
    """CPU seconds of this process and of its children that have ended (a pool's workers, once joined)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _rates(out: dict[str, Any], name: str, n: int, t0: float, c0: float) -> None:
    """rows/s (wall), CPU seconds per 1,000 rows (every process together) and the cores the run kept busy: on a
    shared machine the wall clock depends on the others' load, the CPU cost per row does not."""
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    out[f"{name}_rows_per_s"] = round(n / wall)
    out[f"{name}_cpu_s_per_1000_rows"] = round(1000 * cpu / n, 3)
    out[f"{name}_cores_busy"] = round(cpu / wall, 2)


def scheduler_probe(seconds: float = 3.0) -> dict[str, Any]:
    """The cores 1 and 2 busy processes of this session get right now. With the kernel's autogroup scheduling
    (``/proc/sys/kernel/sched_autogroup_enabled``), CPU is shared between sessions first: on a machine other
    sessions keep busy, a second process of the same session gets no more CPU time, only a share of the same."""
    def burn(k: int) -> float:
        c0, t0 = os.times(), time.perf_counter()
        pids = []
        for _ in range(k):
            pid = os.fork()
            if pid == 0:
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    pass
                os._exit(0)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        c1 = os.times()
        return round((c1.children_user + c1.children_system - c0.children_user - c0.children_system)
                     / (time.perf_counter() - t0), 2)

    try:
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        autogroup = None
    return {"autogroup": autogroup, "cores_1_busy_process": burn(1), "cores_2_busy_processes": burn(2),
            "load": loadavg()}


def part_encoding(n: int, work: Path, src: Path, result: dict[str, Any]) -> None:
    sys.path.insert(0, str(src))
    from surefit.config import SFTConfig, build_config
    from surefit.data.encoded_store import StoreWriter
    from surefit.models import load_tokenizer, model_folder, resolve_model
    from surefit.tasks.sft.train_sft import Encoder, load_data

    data = work / f"enc_{n}.jsonl"
    write_rows(data, n)
    cfg = build_config(SFTConfig, None, {"data": str(data), "val_fraction": 0.0, "output_dir": str(work / "e")})
    source = resolve_model(cfg.model)
    path = model_folder(source, log=lambda _: None)
    tokenizer, _ = load_tokenizer(path, source, False)
    rows, _, report = load_data(cfg, lambda _: None, [])
    encoder = Encoder.build(cfg, tokenizer, str(report.format), bool(report.format_conversational))
    out: dict[str, Any] = {"rows": n, "cores": os.cpu_count(), "scheduler_before": scheduler_probe()}
    for workers in (1, 2):
        writer = StoreWriter(work / f"enc_store_{workers}", {"w": workers})
        result["loads"].append(loadavg())
        t0, c0 = time.perf_counter(), _cpu()
        encoder.encode_into(rows, "train", False, lambda a, w=writer: w.add("train", a), workers)
        writer.commit(None)
        _rates(out, f"surefit_{workers}_process", n, t0, c0)
        print(json.dumps(out), flush=True)
    # The anchor: datasets.map rendering the same conversations with the same tokenizer's chat template (the
    # prompt's render for the label mask, the whole conversation for the ids, as TRL-style preprocessing does),
    # batched, on 1 and 2 processes.
    import datasets

    ds = datasets.Dataset.from_list([{"messages": r.fields["messages"]} for r in rows])

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        ids, labels = [], []
        for messages in batch["messages"]:
            full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True,
                                                   return_dict=True)["input_ids"]
            ids.append(full)
            labels.append([-100] * len(prompt) + full[len(prompt):])
        return {"input_ids": ids, "labels": labels}

    for procs in (1, 2):
        result["loads"].append(loadavg())
        t0, c0 = time.perf_counter(), _cpu()
        ds.map(encode, batched=True, num_proc=procs if procs > 1 else None, remove_columns=["messages"],
               load_from_cache_file=False, keep_in_memory=True)
        _rates(out, f"datasets_map_{procs}_process", n, t0, c0)
        print(json.dumps(out), flush=True)
    out["scheduler_after"] = scheduler_probe()
    result["encoding"] = out
    save(result)


OUT: list[str] = []  # where results go as each part finishes (a long run stopped part-way keeps what it measured)


def save(result: dict[str, Any]) -> None:
    if OUT:
        Path(OUT[0] + ".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="encoding,store,cli")
    ap.add_argument("--cli-sizes", default="20000,200000")
    ap.add_argument("--store-sizes", default="20000,200000,2000000")
    ap.add_argument("--store-repeats", type=int, default=3, help="child runs per store size (medians reported)")
    ap.add_argument("--miss-sizes", default="20000,200000")
    ap.add_argument("--encoding-rows", type=int, default=20000)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--quick", action="store_true", help="small sizes, no files written")
    ap.add_argument("--src", default=str(HERE.parent / "src"))
    ap.add_argument("--out", default=str(HERE / "results" / "encoded_store"))
    args = ap.parse_args()
    src = Path(args.src).resolve()
    parts = args.parts.split(",")
    if not args.quick:
        OUT.append(args.out)
    result: dict[str, Any] = {"machine": machine_info(), "command": " ".join(sys.argv), "cli": [], "store": [],
                              "loads": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "encoding" in parts:
            part_encoding(2000 if args.quick else args.encoding_rows, work, src, result)
        if "miss" in parts:
            part_miss([2000] if args.quick else [int(x) for x in args.miss_sizes.split(",")], work, src, result)
        if "store" in parts:
            part_store([2000] if args.quick else [int(s) for s in args.store_sizes.split(",")], work, src, result,
                       args.store_repeats)
        if "cli" in parts:
            part_cli([500] if args.quick else [int(s) for s in args.cli_sizes.split(",")], work, args.timeout, src,
                     result)
    result["loads"].append(loadavg())
    if not args.quick:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
