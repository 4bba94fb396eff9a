"""The user's epoch end to end: training plus the per-epoch evaluation with generation F1, whole process against
whole process.

The job: the embedded SmolLM2-135M-Instruct, LoRA r16 (alpha 32, dropout 0.05) on every linear layer, batch 4,
``--epochs`` epochs over the first ``--rows`` rows of ``../shared/data/squad/dev-v1.1-part-a.json``, and after
each epoch greedy answers for ``--val-rows`` validation rows (the file's last rows) scored with SQuAD token F1.

- ``surefit``: ``python -m surefit train`` (its defaults: evaluation before the first epoch and after each one,
  validation loss plus generated answers).
- ``trainer``: the same job written with transformers' ``Trainer`` (Seq2Seq collator, length grouping, same
  precision, same prompt tokens from surefit's encoder) and a callback that calls ``model.generate`` (batched, left
  padded, under the same autocast) at each epoch end and scores F1 with the same metric code; the validation loss
  at each epoch end as well (``eval_strategy="epoch"``).

Each runs in its own Python process, one after the other; the wall time of the whole process is measured from
outside (start-up, model load, training, every evaluation, saving). Goal: surefit >= 3x faster.

    .venv/bin/python benchmarks/epoch_e2e.py [--quick] [--rows 64] [--val-rows 32] [--epochs 2] \
        [--out benchmarks/results/epoch_e2e]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GOAL = 3.0
ROOT = Path(__file__).resolve().parents[1]


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Train and validation rows as JSONL (input, target, answers), read once with surefit's SQuAD reader."""
    from surefit.data.readers import read_rows

    problems: list = []
    squad = Path(args.shared) / "squad" / "dev-v1.1-part-a.json"
    rows = read_rows(squad, problems)
    if problems:
        raise SystemExit(f"cannot read {squad}: {problems}")
    train, val = rows[: args.rows], rows[-args.val_rows :]
    for name, part in (("train", train), ("val", val)):
        with (work / f"{name}.jsonl").open("w", encoding="utf-8") as fh:
            for r in part:
                fh.write(json.dumps({k: r.fields[k] for k in ("input", "target", "answers")}) + "\n")
    return {"train": str(work / "train.jsonl"), "val": str(work / "val.jsonl"), "rows": len(train),
            "val_rows": len(val), "source": str(squad)}


def run_surefit(args: argparse.Namespace, work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    out = work / "surefit_run"
    cmd = [sys.executable, "-m", "surefit", "train", "--data", spec["train"], "--val_data", spec["val"],
           "--epochs", str(args.epochs), "--batch_size", "4", "--lora_r", "16", "--max_seq_length", "384",
           "--precision", args.precision, "--output_dir", str(out), "--overwrite", "true"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"surefit failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    f1 = [float(tok.split("=")[1]) for line in proc.stdout.splitlines() if line.startswith("epoch ")
          for tok in line.split() if tok.startswith("eval_f1=")]
    # Where the wall time went: startup.json (command to step 1, the epoch-0 evaluation included) and metrics.jsonl.
    startup = json.loads((out / "startup.json").read_text())
    epochs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"type": "epoch"' in x]
    split = {"start-up to step 1": startup["seconds"],
             "training": sum(r.get("time_per_epoch", 0.0) for r in epochs),
             "evaluations after each epoch (loss + generation)": sum(r.get("eval_seconds", 0.0) for r in epochs[1:])}
    split["rest (checkpoints, final save, report, exit)"] = wall - sum(split.values())
    return {"wall_s": round(wall, 1), "command": " ".join(cmd[1:]), "eval_f1_per_evaluation": f1,
            "split_s": {k: round(v, 1) for k, v in split.items()},
            "startup_phases_s": startup["phases"]}


def run_trainer(args: argparse.Namespace, work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--epochs", str(args.epochs),
           "--precision", args.precision, "--work", str(work)]
    t0, started = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rec = json.loads((work / "trainer.json").read_text())
    t = rec.pop("times")  # absolute times the worker's callbacks saw
    split = {"start-up to step 1": t["train_begin"] - started,
             "training": sum(e - b for b, e in zip(t["epoch_begin"], t["epoch_end"], strict=True)),
             "generation + F1 after each epoch": sum(t["generate"]),
             "validation loss after each epoch": sum(v - e - g for v, e, g in zip(t["evaluate"], t["epoch_end"],
                                                                               t["generate"], strict=True))}
    split["rest (final save, exit)"] = wall - sum(split.values())
    return {"wall_s": round(wall, 1), **rec, "split_s": {k: round(v, 1) for k, v in split.items()}}


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def worker(args: argparse.Namespace) -> None:
    """The Trainer job, as a careful user writes it (run in its own process)."""
    work = Path(args.work)
    spec = json.loads((work / "spec.json").read_text())
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        GenerationConfig,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from surefit.data.collate import PadCollator
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.readers import read_rows
    from surefit.eval.metrics import squad_scores
    from surefit.models import model_folder, resolve_model

    path = model_folder(resolve_model(None), log=lambda _: None)  # the converted model (cached)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    fmt = build_prompt_format(tok)
    problems: list = []
    train_ex, _ = encode_rows(read_rows(spec["train"], problems), tok, fmt, max_seq_length=384)
    val_rows = read_rows(spec["val"], problems)
    val_ex, _ = encode_rows(val_rows, tok, fmt, max_seq_length=384)
    train_ds = [{"input_ids": e.input_ids, "labels": e.labels} for e in train_ex]
    val_ds = [{"input_ids": e.input_ids, "labels": e.labels} for e in val_ex]
    golds = [r.fields["answers"] or [r.fields["target"]] for r in val_rows]
    max_new = max(len(e.input_ids) - e.prompt_len for e in train_ex) + 4  # surefit's default, for the same work
    eos = sorted({tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>"])})
    bf16 = args.precision == "bf16"
    scores: list[float] = []
    times: dict[str, Any] = {"epoch_begin": [], "epoch_end": [], "generate": [], "evaluate": []}

    class Clock(TrainerCallback):  # listed before F1Callback: its on_epoch_end runs first
        def on_train_begin(self, *a: Any, **kw: Any) -> None:
            times["train_begin"] = time.time()

        def on_epoch_begin(self, *a: Any, **kw: Any) -> None:
            times["epoch_begin"].append(time.time())

        def on_epoch_end(self, *a: Any, **kw: Any) -> None:
            times["epoch_end"].append(time.time())

        def on_evaluate(self, *a: Any, **kw: Any) -> None:
            times["evaluate"].append(time.time())

    class F1Callback(TrainerCallback):
        def on_epoch_end(self, targs: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            t0 = time.time()
            model.eval()
            cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=eos,
                                   pad_token_id=tok.pad_token_id)
            collate = PadCollator(pad_token_id=tok.pad_token_id, padding_side="left")
            order = sorted(range(len(val_ex)), key=lambda i: -len(val_ex[i].prompt_ids))
            preds = [""] * len(val_ex)
            for s in range(0, len(order), 8):
                idx = order[s : s + 8]
                batch = collate([{"input_ids": val_ex[i].prompt_ids} for i in idx])
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model.generate(**batch, generation_config=cfg)[:, batch["input_ids"].shape[1] :]
                for i, seq in zip(idx, out, strict=True):
                    preds[i] = tok.decode(seq, skip_special_tokens=True).strip()
            scores.append(squad_scores(preds, golds)["f1"])
            model.train()
            times["generate"].append(time.time() - t0)

    targs = TrainingArguments(output_dir=str(work / "trainer_run"), per_device_train_batch_size=4,
                              per_device_eval_batch_size=8, num_train_epochs=args.epochs, learning_rate=2e-4,
                              warmup_steps=int(0.05 * -(-len(train_ds) // 4) * args.epochs),  # surefit's rule
                              weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="cosine", train_sampling_strategy="group_by_length",
                              bf16=bf16,
                              use_cpu=not torch.cuda.is_available(), eval_strategy="epoch", save_strategy="no",
                              report_to="none", logging_strategy="no", seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=train_ds, eval_dataset=val_ds,
                      data_collator=DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100),
                      callbacks=[Clock(), F1Callback()])
    trainer.train()
    model.save_pretrained(str(work / "trainer_run" / "final"))
    (work / "trainer.json").write_text(json.dumps({"eval_f1_per_epoch": scores, "times": times}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--val-rows", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--shared", default=str(ROOT / ".." / "shared" / "data"))
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 rows, 4 validation rows, 1 epoch, no files")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results/epoch_e2e")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.rows, args.val_rows, args.epochs = 8, 4, 1
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        spec = prepare(args, work)
        (work / "spec.json").write_text(json.dumps(spec))
        surefit = run_surefit(args, work, spec)
        trainer = run_trainer(args, work, spec)
    ratio = round(trainer["wall_s"] / surefit["wall_s"], 2)
    result = {"rows": spec["rows"], "val_rows": spec["val_rows"], "epochs": args.epochs, "precision": args.precision,
              "surefit": surefit, "trainer": trainer,
              "goal": {"ratio": ratio, "goal": GOAL, "result": "PASS" if ratio >= GOAL else "FAIL"}}
    print(json.dumps(result, indent=2))
    if args.quick:
        return
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text("\n".join([
        "# The user's epoch end to end: training + per-epoch generation F1", "",
        f"`.venv/bin/python benchmarks/epoch_e2e.py --rows {args.rows} --val-rows {args.val_rows} --epochs "
        f"{args.epochs} --precision {args.precision}`: embedded SmolLM2-135M-Instruct, LoRA r16 on every linear "
        f"layer, batch 4, {spec['rows']} SQuAD rows, {spec['val_rows']} validation rows answered and scored after each "
        "epoch. Whole process wall time, each in its own process.", "",
        "| job | wall s | F1 per evaluation |", "|---|---|---|",
        f"| surefit train | {surefit['wall_s']} | {surefit['eval_f1_per_evaluation']} |",
        f"| Trainer + generate callback | {trainer['wall_s']} | {trainer['eval_f1_per_epoch']} |", "",
        f"Goal: surefit >= {GOAL}x faster: {ratio}x, {result['goal']['result']}.", "",
        "## Where the wall time went (seconds)", "",
        "| job | " + " | ".join(["part", "seconds", "share"]) + " |", "|---|---|---|---|",
        *[f"| {job} | {part} | {sec} | {sec / res['wall_s']:.0%} |" for job, res in (("surefit", surefit),
          ("Trainer", trainer)) for part, sec in res["split_s"].items()], "",
        "surefit's start-up by phase (startup.json): " + ", ".join(
            f"{k} {v:.1f} s" for k, v in sorted(surefit["startup_phases_s"].items(), key=lambda kv: -kv[1])
            if v >= 0.1) + ".", ""]), encoding="utf-8")


if __name__ == "__main__":
    main()
