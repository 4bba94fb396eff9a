"""CPU classification benchmark: surefit against the Hugging Face Trainer, side by side.

The embedded all-MiniLM-L6-v2 (full fine-tuning), the first N rows of ../shared/data/sst2/train.tsv (default 2,000),
batch 32, max length 128, AdamW lr 5e-5, weight decay 0.01, cosine with 6% warmup, clipping 1.0, one epoch, seed 0;
dev accuracy on the 872 SST-2 dev rows. Each configuration in its own process:

    surefit               surefit's defaults (precision auto = fp32 on CPU)
    surefit_bf16          surefit --precision bf16 (autocast, fp32 master weights)
    trainer               transformers.Trainer + DataCollatorWithPadding (its defaults: random order, fp32)
    trainer_bf16          the same with bf16=True (CPU autocast)
    trainer_grouped       Trainer + length grouping (train_sampling_strategy="group_by_length"), fp32
    trainer_grouped_bf16  the same with bf16=True

    .venv/bin/python benchmarks/cpu_classify.py                  # 2,000 rows, every configuration
    .venv/bin/python benchmarks/cpu_classify.py --quick          # 256 rows, 200 dev rows: smoke test

Writes benchmarks/results/cpu_classify.md and .json (--quick: into its work folder only, unless --out is given).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402  (next to this file; its import time starts each worker's set-up clock)

BATCH, MAX_LEN, LR, EPOCHS, SEED, WEIGHT_DECAY, WARMUP_RATIO = 32, 128, 5e-5, 1, 0, 0.01, 0.06

CONFIGS: dict[str, tuple[str, dict[str, Any], str]] = {
    "surefit": ("surefit", {}, "surefit defaults (precision auto = fp32 on CPU)"),
    "surefit_bf16": ("surefit", {"precision": "bf16"}, "surefit --precision bf16"),
    "trainer": ("trainer", {"bf16": False, "grouped": False}, "Trainer + DataCollatorWithPadding, fp32 (defaults)"),
    "trainer_bf16": ("trainer", {"bf16": True, "grouped": False}, "the same, bf16=True"),
    "trainer_grouped": ("trainer", {"bf16": False, "grouped": True}, "Trainer + length grouping, fp32"),
    "trainer_grouped_bf16": ("trainer", {"bf16": True, "grouped": True}, "Trainer + length grouping, bf16=True"),
}
ANCHORS_DEFAULT = ["trainer"]
ANCHORS_ALL = ["trainer", "trainer_bf16", "trainer_grouped", "trainer_grouped_bf16"]
NUMERIC = ["train_seconds", "setup_seconds", "peak_rss_mb", "final_loss", "dev_accuracy", "process_seconds"]


# ================================================================================================== parent: data


def prepare(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Read the SST-2 rows with surefit's reader (the same rows for everyone), write them as JSONL, and tokenize
    them once for the reference token count."""
    from transformers import AutoTokenizer

    from surefit.data.readers import read_rows
    from surefit.data.sampling import step_batches
    from surefit.models.gguf import embedded_encoder_path

    sst2 = Path(args.shared) / "sst2"
    problems: list = []
    train = read_rows(sst2 / "train.tsv", problems)[: args.rows]
    dev = read_rows(sst2 / "dev.tsv", problems)[: args.dev_rows]
    if problems:
        raise SystemExit(f"cannot read {sst2}: {problems}")
    for name, rows in (("train", train), ("dev", dev)):
        with (workdir / f"{name}.jsonl").open("w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps({"sentence": r.fields["sentence"], "label": int(r.fields["label"])}) + "\n")
    path = embedded_encoder_path()
    tok = AutoTokenizer.from_pretrained(str(path))
    lengths = [len(ids) for ids in tok([r.fields["sentence"] for r in train], truncation=True,
                                       max_length=MAX_LEN)["input_ids"]]
    steps = math.ceil(len(train) / BATCH)
    spec = {
        "model_path": str(path), "rows": len(train), "dev_rows": len(dev), "steps": steps,
        "warmup_steps": int(WARMUP_RATIO * steps * EPOCHS),  # surefit's rule: int(ratio * total steps)
        "ref_tokens": sum(lengths), "ref_examples": len(train), "longest": max(lengths),
        "truncated": sum(1 for n in lengths if n >= MAX_LEN),
        "surefit_padded": sum(max(lengths[i] for i in b) * len(b) for b in step_batches(lengths, BATCH, SEED, 1)),
        "train_source": str(sst2 / "train.tsv"), "dev_source": str(sst2 / "dev.tsv"),
    }
    (workdir / "spec.json").write_text(json.dumps(spec, indent=2), encoding="utf-8")
    return spec


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ================================================================================================== workers


def worker_surefit(name: str, opts: dict[str, Any], spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """surefit's classify task through its Python API; training time and loss from its metrics.jsonl."""
    import surefit
    import surefit.tasks.classify.train_classify as cls  # its evaluation calls predict_logits
    import surefit.tasks.runner as common

    marks: dict[str, Any] = {"fit_start": None, "evals": []}
    original_fit, original_predict = common.fit, cls.predict_logits

    def fit(*a: Any, **k: Any) -> Any:
        marks["fit_start"] = time.perf_counter()
        benchlib.PHASES.switch("train")
        try:
            return original_fit(*a, **k)
        finally:
            benchlib.PHASES.switch("after")

    def predict(*a: Any, **k: Any) -> Any:
        benchlib.PHASES.switch("eval")
        t0 = time.perf_counter()
        try:
            return original_predict(*a, **k)
        finally:
            marks["evals"].append(time.perf_counter() - t0)
            benchlib.PHASES.switch("train" if len(marks["evals"]) == 1 else "after")

    common.fit = fit
    cls.predict_logits = predict
    out = workdir / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    settings = dict(task="classify", data=str(workdir / "train.jsonl"), val_data=str(workdir / "dev.jsonl"),
                    epochs=EPOCHS, batch_size=BATCH, max_seq_length=MAX_LEN, lr=LR, weight_decay=WEIGHT_DECAY,
                    warmup_ratio=WARMUP_RATIO, seed=SEED, output_dir=str(out), **opts)
    t0 = time.perf_counter()
    result = surefit.train(**settings)
    t_end = time.perf_counter()
    epochs = [r for r in _read_jsonl(out / "metrics.jsonl") if r.get("type") == "epoch"]
    final = epochs[-1]
    return {
        "kind": "surefit", "precision": opts.get("precision", "auto"),
        "settings": {k: v for k, v in settings.items() if k not in ("data", "val_data")},
        "train_seconds": final["time_per_epoch"],
        "surefit_tokens_per_s": final["train_tokens_per_s"],
        "final_loss": final["train_loss"],
        "dev_accuracy": final["eval_accuracy"],
        "dev_accuracy_epoch0": epochs[0]["eval_accuracy"],
        "setup_seconds": marks["fit_start"] - benchlib.T_PROCESS,
        "api_seconds": t_end - t0,
        "eval_seconds": marks["evals"],
        "steps": final["step"],
        "tokens_padded": spec["surefit_padded"],
        "tokens_real": spec["ref_tokens"],
        "train_rows": result.data_report["train_rows"],
    }


def worker_trainer(name: str, opts: dict[str, Any], spec: dict[str, Any], workdir: Path, warm: bool) -> dict[str, Any]:
    """Trainer + DataCollatorWithPadding on the same rows, tokenized with truncation at 128."""
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    set_seed(SEED)
    tok = AutoTokenizer.from_pretrained(spec["model_path"])
    model = AutoModelForSequenceClassification.from_pretrained(spec["model_path"], num_labels=2, dtype=torch.float32)

    def dataset(rows: list[dict[str, Any]]) -> Any:
        enc = tok([r["sentence"] for r in rows], truncation=True, max_length=MAX_LEN)
        return Dataset.from_dict({**enc, "labels": [r["label"] for r in rows]})

    train_ds = dataset(_read_jsonl(workdir / "train.jsonl"))
    dev_ds = dataset(_read_jsonl(workdir / "dev.jsonl"))
    args = TrainingArguments(
        output_dir=str(workdir / f"hf-{name}"), per_device_train_batch_size=BATCH, per_device_eval_batch_size=64,
        num_train_epochs=EPOCHS, learning_rate=LR, weight_decay=WEIGHT_DECAY, lr_scheduler_type="cosine",
        warmup_steps=spec["warmup_steps"], max_grad_norm=1.0, seed=SEED, use_cpu=True, save_strategy="no",
        eval_strategy="no", report_to="none", logging_steps=10, bf16=opts["bf16"],
        **({"train_sampling_strategy": "group_by_length"} if opts["grouped"] else {}))
    collator = benchlib.CountingCollator(DataCollatorWithPadding(tok), causal=False)
    timer = benchlib.make_epoch_timer()
    trainer = benchlib.recording(Trainer, causal=False)(model=model, args=args, train_dataset=train_ds,
                                                        data_collator=collator, processing_class=tok,
                                                        callbacks=[timer])
    benchlib.PHASES.switch("warmup")
    warm_s = benchlib.warm_up(trainer, opts["bf16"]) if warm else 0.0
    collator.reset()
    trainer.bench_reset()
    t_setup_end = time.perf_counter()
    benchlib.PHASES.switch("train")
    out = trainer.train()
    t_train_end = time.perf_counter()
    benchlib.PHASES.switch("after")
    counts = collator.counts()
    pred = trainer.predict(dev_ds)  # untimed: dev accuracy only
    accuracy = float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())
    return {
        "kind": "trainer", "precision": "bf16 autocast" if opts["bf16"] else "fp32",
        "train_seconds": timer.seconds,
        "train_call_seconds": t_train_end - t_setup_end,
        "trainer_train_runtime": out.metrics.get("train_runtime"),
        "trainer_reported_loss": out.metrics.get("train_loss"),
        "final_loss": trainer.bench_loss,
        "dev_accuracy": accuracy,
        "eval_seconds": [time.perf_counter() - t_train_end],
        "setup_seconds": t_setup_end - benchlib.T_PROCESS - warm_s,
        "warmup_seconds": warm_s,
        "steps": trainer.state.global_step,
        **counts,
        "resolved": {"bf16": args.bf16, "optim": str(args.optim), "sampler": args.train_sampling_strategy},
    }


def worker_main(name: str, workdir: Path, warm: bool) -> None:
    spec = json.loads((workdir / "spec.json").read_text(encoding="utf-8"))
    kind, opts, _ = CONFIGS[name]
    rec = worker_surefit(name, opts, spec, workdir) if kind == "surefit" else worker_trainer(name, opts, spec,
                                                                                                 workdir, warm)
    benchlib.write_result(workdir, name, rec)


# ================================================================================================== report


def build_report(spec: dict[str, Any], results: dict[str, dict[str, Any]], machine: dict[str, Any],
                 args: argparse.Namespace, started: str) -> tuple[list[str], dict[str, Any]]:
    ok = {n: r for n, r in results.items() if "error" not in r}
    for r in ok.values():
        r["tokens_per_s"] = spec["ref_tokens"] / r["train_seconds"]
        r["examples_per_s"] = spec["ref_examples"] / r["train_seconds"]
    goals, verdicts = benchlib.goal_rows(ok, ANCHORS_DEFAULT, ANCHORS_ALL, unit="tok/s")
    sf = ok.get("surefit")
    md = [
        f"# cpu_classify: surefit vs Trainer, {spec['rows']} SST-2 rows" + (" (QUICK smoke run)" if args.quick else ""),
        "",
        f"Embedded all-MiniLM-L6-v2, full fine-tuning, the first {spec['rows']} rows of SST-2 `train.tsv`, batch "
        f"{BATCH}, max length {MAX_LEN}, AdamW lr {LR}, weight decay {WEIGHT_DECAY}, cosine with "
        f"{spec['warmup_steps']} warmup steps (6%, surefit's rule), clipping 1.0, 1 epoch = {spec['steps']} steps, "
        f"seed {SEED}; dev accuracy on {spec['dev_rows']} SST-2 dev rows. Every configuration ran in its own process, "
        f"one after the other, on {started}.",
        "",
        f"Training set: {spec['ref_tokens']:,} tokens ([CLS] + sentence + [SEP], non-padding, truncated at {MAX_LEN}; "
        f"longest {spec['longest']}). **tokens/s = {spec['ref_tokens']:,} / training seconds and examples/s = "
        f"{spec['ref_examples']:,} / training seconds for every row.**",
        "",
        "| config | what | precision | train s | tokens/s | examples/s | peak RSS MB | final loss | dev accuracy | "
        "setup s | padding | surefit speed-up | others' CPU | training RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    sf_tps = sf["tokens_per_s"] if sf else None
    for name, r in results.items():
        desc = CONFIGS[name][2]
        if "error" in r:
            md.append(f"| {name} | {desc} | - | FAILED: {r['error']} | | | | | | | | | | |")
            continue
        pad, real = r.get("tokens_padded"), r.get("tokens_real")
        padding = f"{100 * (pad - real) / pad:.0f}%" if pad and real else "-"
        rel = f"{sf_tps / r['tokens_per_s']:.2f}x" if sf_tps else "-"
        md.append(
            f"| {name} | {desc} | {r.get('precision')} | {benchlib.fmt(r['train_seconds'])} | "
            f"{benchlib.fmt(r['tokens_per_s'], 0)} | {benchlib.fmt(r['examples_per_s'], 1)} | "
            f"{benchlib.fmt(r['peak_rss_mb'], 0)} | {benchlib.fmt(r.get('final_loss'), 4)} | "
            f"{benchlib.fmt(r.get('dev_accuracy'), 4)} | {benchlib.fmt(r.get('setup_seconds'))} | {padding} | {rel} | "
            f"{benchlib.fmt(r.get('others_cpu_cores'), 1)} | "
            f"{benchlib.fmt((r.get('peak_rss_by_phase_mb') or {}).get('train'), 0)} |")
    accs = [ok[n]["dev_accuracy"] for n in ANCHORS_ALL if n in ok]
    md += [
        "",
        "## Goals (the SFT benchmark's goal lines, applied to classification)",
        "",
        "| goal | measured | target | result | detail |",
        "|---|---|---|---|---|",
        *goals,
        "",
        (f"Dev accuracy: surefit {', '.join(benchlib.fmt(ok[n]['dev_accuracy'], 4) for n in ('surefit', 'surefit_bf16') if n in ok)}"
         f"; the Trainer runs {min(accs):.4f}-{max(accs):.4f}." if accs and sf else "Dev accuracy: see the table."),
        "",
        "## How each number is measured",
        "",
        "- **train s**: the training epoch only. surefit: `time_per_epoch` from its `metrics.jsonl` (the sum of its "
        "step times; its evaluations before and after the epoch and its checkpoint are excluded). Trainer: a "
        "callback's `on_epoch_begin` to `on_epoch_end`. Loading, tokenization and trainer construction are in "
        "**setup s**. Each Trainer run first does one untimed forward + backward on its first batch (gradients zeroed, "
        "RNG restored), as surefit's timed epoch follows its doctor dry run and epoch-0 evaluation (`--no-warmup` "
        "turns it off).",
        "- **others' CPU**: cores kept busy by other processes while the worker ran (machine busy time from "
        "`/proc/stat` minus the worker's own CPU time, over its wall time); 0 on a quiet machine. With `--repeats N` "
        "the training time is the fastest of the N runs and the other numbers their medians.",
        "- **peak RSS**: the worker process's peak resident memory over its whole life (for surefit: including its "
        "two evaluations and saves; for the Trainer: including the dev prediction after training). **training RSS**: "
        "the peak while training only, from the kernel's high-water mark reset between phases "
        "(`/proc/self/clear_refs`); every phase's peak is in the JSON (`peak_rss_by_phase_mb`).",
        "- **final loss**: example-weighted mean of the training loss over the whole epoch (surefit's `train_loss`; "
        "for the Trainer a `compute_loss` override records loss x batch size).",
        "- **dev accuracy**: surefit's epoch-1 evaluation; for the Trainer `trainer.predict` on the same dev rows after "
        "training (untimed).",
        "- **padding**: share of padded batch positions (Trainer: counted around its collator; surefit: its batch plan "
        "replayed). The Trainer's default sampler draws batches at random, so short SST-2 phrases share batches with "
        "long sentences; surefit groups by length.",
        "- The Trainer excludes biases and LayerNorm weights from weight decay (its default); surefit decays every "
        "trainable parameter.",
        "",
        *benchlib.machine_lines(machine, [r.get("load_before", []) for r in results.values()]
                                + [r.get("load_after", []) for r in results.values()],
                                [r.get("others_cpu_cores") for r in results.values()]),
        "",
        f"Command: `{benchlib.command_line('cpu_classify.py', args)}`; raw numbers in the `.json` next to this "
        "file.",
        "",
    ]
    return md, {"verdicts": verdicts}


# ================================================================================================== main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"), help="the shared data folder")
    ap.add_argument("--rows", type=int, default=None, help="training rows (default 2000; --quick 256)")
    ap.add_argument("--dev_rows", type=int, default=None, help="dev rows scored (default all 872; --quick 200)")
    ap.add_argument("--only", default=None, help=f"comma-separated configurations (of: {', '.join(CONFIGS)})")
    ap.add_argument("--quick", action="store_true", help="smoke test: 256 rows, results in the work folder")
    ap.add_argument("--repeats", type=int, default=1, help="run the configurations N times (interleaved); medians")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="no untimed warm-up step for Trainer")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per worker")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; --quick: the work folder)")
    ap.add_argument("--workdir", default=None, help="work folder (default: a new temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, runs)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        worker_main(args.worker, Path(args.workdir), args.warmup)
        return
    args.rows = args.rows or (256 if args.quick else 2000)
    args.dev_rows = args.dev_rows or (200 if args.quick else 872)
    names = list(CONFIGS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cpu_classify-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else (workdir if args.quick else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    print(f"work folder: {workdir}")
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    spec = prepare(args, workdir)
    machine = benchlib.machine_info()
    print(f"{spec['rows']} rows, {spec['ref_tokens']} tokens, {spec['steps']} steps")

    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names:
            print(f"[{rep + 1}/{args.repeats}] {name} ...", flush=True)
            r = benchlib.run_worker(Path(__file__), name, workdir, args.timeout, [] if args.warmup else ["--no-warmup"])
            runs[name].append(r)
            if "error" in r:
                print(f"  FAILED ({r['error']}); log: {r['log']}\n  " + "\n  ".join(r.get("log_tail", [])[-8:]))
            else:
                print(f"  train {r['train_seconds']:.1f} s, {spec['ref_tokens'] / r['train_seconds']:.0f} tok/s, "
                      f"peak RSS {r['peak_rss_mb']:.0f} MB, loss {r['final_loss']:.4f}, dev acc "
                      f"{r['dev_accuracy']:.4f}, load {r['load_after']}", flush=True)
    results = {n: benchlib.median_records(rs, NUMERIC) for n, rs in runs.items()}
    md, extra = build_report(spec, results, machine, args, started)
    stem = "cpu_classify" if args.rows == 2000 else f"cpu_classify_{args.rows}"
    record = {"benchmark": stem, "started": started, "spec": spec, "machine": machine, "results": results,
              "runs": runs if args.repeats > 1 else None, **extra}
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text("\n".join(md), encoding="utf-8")
    print("\n".join(md))
    print(f"wrote {out / (stem + '.md')} and .json")
    if not (args.keep or args.workdir or out == workdir):
        if any("error" in r for r in results.values()):
            print(f"(work folder kept for the failed workers' logs: {workdir})")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
