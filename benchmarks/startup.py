"""Start-up: seconds from the command to step 1, `surefit train` against a plain transformers Trainer script.

Same model (the embedded SmolLM2-135M-Instruct, its converted folder from surefit's cache), same rows (SQuAD
questions as input / target JSONL), LoRA r16 on every linear layer, batch 4. Each run is its own process, started
one after the other; the clock starts just before the process is started and stops when step 1 begins:

* surefit: ``step1_at`` in ``OUTPUT/startup.json`` (written when the first training forward starts), with the split
  of the start-up by phase. ``cold``: an empty start-up cache (the doctor and the planner run); ``warm``: the same
  command into a new run folder, the cache filled by the cold run; ``cold, hashes known``: a start-up cache holding
  only the model files' remembered hashes (``hashes/``, copied from the cold run's), so the doctor and the planner
  run as in a run with a changed setting, but no weights are read to hash them. The GGUF conversion (once per
  machine) is done before timing; ``--with-conversion`` adds a run that converts too.
* Trainer: a callback's ``on_step_begin`` writes the time, and the seconds of each phase (imports, tokenizer, data,
  model load, LoRA, ``TrainingArguments`` and ``Trainer(...)``, ``train()`` to step 1), and ends the process.

Goal (issue 34): surefit's start-up <= the Trainer's, doctor and memory plan on (cold and warm each get a verdict,
on the median of the per-repeat ratios: each repeat runs the jobs back to back, the Trainer first in even repeats and last in odd ones, so a
shared machine's load hits them alike; the load average is recorded per repeat). surefit runs with ``--profile``, so each run also says where
the time after step 1 went (checkpoint, final save, report). Results go to ``benchmarks/results/startup.{json,md}``.

    .venv/bin/python benchmarks/startup.py [--rows 64] [--repeats 3] [--max-seq-length 384] [--quick]
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
GOAL_S = 0.0  # surefit's seconds to step 1 minus the Trainer's, at most


# ------------------------------------------------------------------------------------------------------------ workers


def trainer_worker(workdir: Path, model: str, data: Path, max_len: int) -> None:
    """The anchor: tokenise, load, LoRA, Trainer; on_step_begin of step 1 writes the time, and the seconds of each
    phase (the same names as surefit's where they do the same work), and ends the process."""
    marks: list[tuple[str, float]] = []  # each phase ends at its mark; the first begins at the process start
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    marks.append(("imports", time.time()))
    tok = AutoTokenizer.from_pretrained(model)
    marks.append(("tokenizer", time.time()))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = tok([r["input"] + "\n\n" for r in rows], add_special_tokens=False)["input_ids"]
    answers = tok([r["target"] + tok.eos_token for r in rows], add_special_tokens=False)["input_ids"]
    features = []
    for p, a in zip(prompts, answers, strict=True):
        ids = (p + a)[-max_len:]
        n_answer = min(len(a), len(ids))
        features.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                         "labels": [-100] * (len(ids) - n_answer) + ids[len(ids) - n_answer:]})
    marks.append(("reading and encoding data", time.time()))
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    marks.append(("model load", time.time()))
    lm = get_peft_model(lm, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                       task_type="CAUSAL_LM"))
    marks.append(("LoRA setup", time.time()))

    class Step1(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.time()
            marks.append(("Trainer.train() to step 1", now))
            phases, last = {}, process_start()
            for name, at in marks:
                phases[name], last = round(at - last, 3), at
            (workdir / "trainer_step1.json").write_text(json.dumps({"step1_at": now, "phases": phases}),
                                                        encoding="utf-8")
            os._exit(0)  # only the start-up is measured

    args = TrainingArguments(output_dir=str(workdir / "trainer_out"), per_device_train_batch_size=4, max_steps=1,
                             report_to=[], save_strategy="no", logging_strategy="no", train_sampling_strategy="group_by_length",
                             use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    trainer = Trainer(model=lm, args=args, train_dataset=features, callbacks=[Step1()],
                      data_collator=DataCollatorForSeq2Seq(tok, padding=True))
    marks.append(("TrainingArguments and Trainer(...)", time.time()))
    trainer.train()


def process_start() -> float:
    """When this process started (wall clock), as surefit's start-up clock reads it (``startup.process_start``)."""
    import psutil

    return float(psutil.Process().create_time())


# ------------------------------------------------------------------------------------------------------------ the parent


def timed(cmd: list[str], env: dict[str, str], log: Path, read_step1: Any, timeout: float) -> dict[str, Any]:
    """Start ``cmd`` now; seconds until its step 1 (``read_step1()`` gives the wall-clock time, or None)."""
    t_launch = time.time()
    t_exit = None
    with log.open("w", encoding="utf-8") as fh:
        try:
            rc: int | str = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                           cwd=REPO, check=False).returncode
            t_exit = time.time()
        except subprocess.TimeoutExpired:
            rc = "timeout"
    step1 = read_step1()
    if step1 is None:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-20:]
        return {"error": f"exit {rc}, no step 1 recorded", "log_tail": tail}
    return {"seconds": round(step1 - t_launch, 2), "exit": rc, "log": str(log),
            "process_seconds": None if t_exit is None else round(t_exit - t_launch, 2)}


# surefit's start-up phases grouped by the Trainer script's work; a phase not named here is counted in "other"
GROUPS = {"imports and settings": "imports and settings", "imports": "imports and settings",
          "model conversion": "tokenizer", "tokenizer": "tokenizer",
          "reading data": "reading and encoding data", "encoding data": "reading and encoding data",
          "encoded data write": "reading and encoding data", "data hash": "reading and encoding data",
          "prepare (other)": "reading and encoding data", "reading and encoding data": "reading and encoding data",
          "model load": "model load", "LoRA setup": "LoRA setup", "accelerate setup": "LoRA setup",
          "cache key": "doctor (cache key, dry run, checks)", "doctor": "doctor (cache key, dry run, checks)",
          "memory plan": "memory plan",
          "metrics log and trackers": "loop setup to step 1", "loop setup": "loop setup to step 1",
          "TrainingArguments and Trainer(...)": "loop setup to step 1",
          "Trainer.train() to step 1": "loop setup to step 1"}


def phase_table(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Median seconds per phase group and run kind (a group a run never has: None)."""
    order = list(dict.fromkeys([*GROUPS.values(), "other", "total"]))
    table: dict[str, dict[str, float | None]] = {g: {} for g in order}
    for name, rs in runs.items():
        per_run: list[dict[str, float]] = []
        for r in rs:
            if "phases" not in r:
                continue
            sums: dict[str, float] = {"total": r["seconds"]}
            for k, v in r["phases"].items():
                g = GROUPS.get(k, "other")
                sums[g] = sums.get(g, 0.0) + v
            # from the launch to the process's own clock (psutil's start time; it can read a little late or early)
            sums["imports and settings"] = sums.get("imports and settings", 0.0) + r["seconds"] - sum(r["phases"].values())
            per_run.append(sums)
        for g in order:
            vals = [p[g] for p in per_run if g in p]
            table[g][name] = round(statistics.median(vals), 2) if vals else None
    return table


def squad_jsonl(path: Path, rows: int) -> None:
    squad = json.loads((REPO / "examples/sft/squad-sample.json").read_text(encoding="utf-8"))
    out = []
    for article in squad["data"]:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                out.append({"input": f"{para['context']}\n\nQuestion: {qa['question']}",
                            "target": qa["answers"][0]["text"]})
    path.write_text("".join(json.dumps(r) + "\n" for r in out[:rows]), encoding="utf-8")


def _out_flag(out: str) -> str:
    """``--out`` as the command line gave it, for the results' Command line; nothing for the default."""
    if Path(out).resolve() == (HERE / "results" / "startup").resolve():
        return ""
    return f" --out {os.path.relpath(Path(out).resolve(), REPO) if Path(out).resolve().is_relative_to(REPO) else out}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seq-length", type=int, default=384)
    ap.add_argument("--rows-from", default=None,
                    help="input/target JSONL to take the rows from instead of SQuAD (e.g. the train.jsonl that "
                         "`cpu_sft.py --workload chat --keep` leaves: chat rows, most tokens supervised)")
    ap.add_argument("--quick", action="store_true", help="smoke mode: 8 rows, one repeat, no result files")
    ap.add_argument("--with-conversion", action="store_true",
                    help="also time a first-ever run: the GGUF conversion into an empty model cache")
    ap.add_argument("--out", default=str(HERE / "results" / "startup"))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "trainer":
        trainer_worker(Path(args.workdir), args.model, Path(args.data), args.max_seq_length)
        return
    if args.quick:
        args.rows, args.repeats = 8, 1

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO / "src"))
    from benchlib import machine_info

    from surefit.models import model_folder, resolve_model

    model = str(model_folder(resolve_model(None), log=print))  # converted once, before any clock runs
    work = Path(tempfile.mkdtemp(prefix="surefit-startup-"))
    data = work / "train.jsonl"
    if args.rows_from:
        rows = [json.loads(line) for line in Path(args.rows_from).read_text(encoding="utf-8").splitlines() if line.strip()]
        data.write_text("".join(json.dumps({"input": r["input"], "target": r["target"]}) + "\n"
                                for r in rows[:args.rows]), encoding="utf-8")
    else:
        squad_jsonl(data, args.rows)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "DISABLE_MLFLOW_INTEGRATION": "TRUE", "WANDB_DISABLED": "true"}

    def surefit_run(name: str, cache: Path, model_cache: str | None = None) -> dict[str, Any]:
        out = work / name
        cmd = [sys.executable, "-m", "surefit", "train", "--task", "sft", "--data", str(data), "--lora_r", "16",
               "--batch_size", "4", "--max_seq_length", str(args.max_seq_length), "--val_fraction", "0",
               "--max_steps", "1", "--output_dir", str(out), "--profile"]
        run_env = {**env, "SUREFIT_STARTUP_CACHE": str(cache)}
        if model_cache:
            run_env["SUREFIT_CACHE"] = model_cache

        def step1() -> float | None:
            f = out / "startup.json"
            return json.loads(f.read_text(encoding="utf-8"))["step1_at"] if f.is_file() else None

        r = timed(cmd, run_env, work / f"{name}.log", step1, args.timeout)
        if "error" not in r:
            rec = json.loads((out / "startup.json").read_text(encoding="utf-8"))
            r.update(inside=rec["seconds"], phases=rec["phases"], cache=rec["cache"])
            prof = out / "profile.json"
            if prof.is_file():
                r["profile"] = json.loads(prof.read_text(encoding="utf-8"))["parts"]
        return r

    def trainer_run(name: str) -> dict[str, Any]:
        marker = work / "trainer_step1.json"
        marker.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "trainer", "--workdir", str(work),
               "--model", model, "--data", str(data), "--max-seq-length", str(args.max_seq_length)]
        r = timed(cmd, env, work / f"{name}.log",
                  lambda: json.loads(marker.read_text())["step1_at"] if marker.is_file() else None, args.timeout)
        if "error" not in r:
            r["phases"] = json.loads(marker.read_text())["phases"]
        return r

    runs: dict[str, list[dict[str, Any]]] = {"trainer": [], "surefit cold": [], "surefit warm": [],
                                             "surefit cold, hashes known": []}
    if args.with_conversion:
        runs["surefit first ever"] = []
    loads: list[list[float]] = []
    for i in range(args.repeats):  # interleaved, so drifting load hits each the same
        loads.append([round(x, 2) for x in os.getloadavg()])
        cache = work / f"cache-{i}"
        if i % 2 == 0:  # the Trainer first, then last: a load that drifts during a repeat favours neither side
            runs["trainer"].append(trainer_run(f"trainer-{i}"))
        runs["surefit cold"].append(surefit_run(f"cold-{i}", cache))
        runs["surefit warm"].append(surefit_run(f"warm-{i}", cache))
        # cold for the doctor and the planner, but the model files' hashes remembered from the run before (what a
        # run with a changed setting finds): an empty start-up cache also makes the first run hash the weights
        known = work / f"cache-known-{i}"
        if (cache / "hashes").is_dir():
            shutil.copytree(cache / "hashes", known / "hashes")
        runs["surefit cold, hashes known"].append(surefit_run(f"known-{i}", known))
        if i % 2 == 1:
            runs["trainer"].append(trainer_run(f"trainer-{i}"))
        if args.with_conversion:
            runs["surefit first ever"].append(surefit_run(f"first-{i}", work / f"cache-first-{i}",
                                                          str(work / f"models-{i}")))
        for name, rs in runs.items():
            print(f"repeat {i + 1}: {name}: {rs[-1].get('seconds', rs[-1].get('error'))}", flush=True)

    def median(name: str) -> float | None:
        secs = [r["seconds"] for r in runs[name] if "seconds" in r]
        return round(statistics.median(secs), 2) if secs else None

    def ratio(name: str) -> float | None:
        # per repeat, against the Trainer run just before it (the same load), then the median
        pairs = [r["seconds"] / t["seconds"] for r, t in zip(runs[name], runs["trainer"], strict=True)
                 if "seconds" in r and "seconds" in t]
        return round(statistics.median(pairs), 3) if pairs else None

    summary = {name: median(name) for name in runs}
    ratios = {name: ratio(name) for name in runs if name != "trainer"}
    anchor = summary["trainer"]
    verdicts = {}
    for name in ("surefit cold", "surefit warm", "surefit cold, hashes known"):
        # on the median of the per-repeat ratios (as the docstring says): each is against the Trainer run of the
        # same repeat, so a load that changes between repeats cancels out; medians of seconds from different
        # repeats do not
        rt = ratios[name]
        verdicts[name] = None if rt is None or anchor is None else rt <= 1.0 + GOAL_S / anchor
    warm_phases = next((r["phases"] for r in runs["surefit warm"] if "phases" in r), {})
    cold_phases = next((r["phases"] for r in runs["surefit cold"] if "phases" in r), {})
    source = f"rows of {args.rows_from}" if args.rows_from else "SQuAD rows"
    result = {"rows": args.rows, "rows_from": args.rows_from, "repeats": args.repeats, "max_seq_length": args.max_seq_length, "goal_s": GOAL_S,
              "median_seconds": summary, "median_ratio_to_trainer": ratios, "verdicts": verdicts,
              "load_average_1_5_15_per_repeat": loads, "runs": runs, "machine": machine_info()}

    lines = ["# Start-up: command to step 1", "",
             f"{args.rows} {source}, LoRA r16 all-linear, batch 4, max length {args.max_seq_length}, the embedded "
             f"SmolLM2-135M; median of {args.repeats} run(s) each, every run its own process, interleaved.", "",
             "| run | seconds to step 1 | vs Trainer | median ratio to the Trainer (per repeat) | goal (<= Trainer) |",
             "|---|---|---|---|---|"]
    for name, s in summary.items():
        gap = "-" if s is None or anchor is None or name == "trainer" else f"{s - anchor:+.1f} s"
        v = verdicts.get(name)
        rt = ratios.get(name)
        lines.append(f"| {name} | {'-' if s is None else f'{s:.1f}'} | {gap} | {'-' if rt is None else f'{rt:.2f}x'} | "
                     f"{'-' if name not in verdicts else 'not measured' if v is None else 'PASS' if v else 'FAIL'} |")
    lines += ["", "Load average (1, 5, 15 min) at the start of each repeat: "
              + "; ".join(", ".join(f"{x:.1f}" for x in la) for la in loads) + "."]
    for label, phases in (("cold", cold_phases), ("warm", warm_phases)):
        if phases:
            lines += ["", f"Where surefit's {label} start-up went (OUTPUT/startup.json, first run): "
                      + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items() if v >= 0.05) + "."]
    lines += ["", "Phase by phase, the median seconds over the repeats (surefit's phases from OUTPUT/startup.json, "
              "grouped where they do the Trainer's work; the Trainer's from marks in its script):", "",
              "| phase | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|"]
    table = phase_table(runs)
    for group, by_run in table.items():
        lines.append(f"| {group} | " + " | ".join("-" if by_run.get(n) is None else f"{by_run[n]:.2f}" for n in runs)
                     + " |")
    result["phase_medians"] = table
    after = next((r for r in runs["surefit cold"] if "profile" in r), None)
    if after:
        rest = {k: v for k, v in after["profile"].items() if k not in ("start-up", "training steps")}
        lines += ["", f"After step 1 (cold, first run, OUTPUT/profile.json of `--profile`): the one training step "
                  f"{after['profile'].get('training steps', 0):.1f} s, then "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in rest.items())
                  + f"; the process exited {after.get('process_seconds', 0) - after['seconds']:.1f} s after step 1 "
                  "began."]
    m = result["machine"]
    lines += ["", f"Machine: {m['cpu_count']} cores, {m['cpu_model']}, CUDA {m['cuda']}; torch {m['versions']['torch']}, "
              f"transformers {m['versions']['transformers']}, peft {m['versions']['peft']}.",
              "", f"Command: `.venv/bin/python benchmarks/startup.py --rows {args.rows} --repeats {args.repeats} "
              f"--max-seq-length {args.max_seq_length}{' --with-conversion' if args.with_conversion else ''}"
              f"{f' --rows-from {args.rows_from}' if args.rows_from else ''}{_out_flag(args.out)}`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.quick:
        print(f"(--quick: nothing written; runs kept in {work})")
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(text, encoding="utf-8")
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
