"""CPU instruction-tuning benchmark: surefit against the Hugging Face Trainer and TRL's SFTTrainer, side by side.

Same model (the embedded SmolLM2-135M-Instruct, fp32 weights), same data (the first N SQuAD rows of
../shared/data/squad/dev-v1.1-part-a.json), same prompt (surefit's DEFAULT_TEMPLATE for everyone), same
hyperparameters (LoRA r=16 / alpha 32 / dropout 0.05 on q,k,v,o,gate,up,down; batch 4; max length 384; AdamW lr 2e-4,
cosine schedule with 5% warmup, clipping 1.0, no weight decay; one epoch; seed 0), each configuration in its own
process:

    surefit               surefit's defaults (precision auto: with LoRA on a CPU with AVX-512 BF16 or AMX, the frozen
                          base's matmuls in bf16, adapters, their sum and the loss in fp32; fp32 on other CPUs)
    surefit_fp32          surefit --precision fp32
    surefit_ckpt          surefit's defaults plus --gradient_checkpointing (what memory costs in time)
    surefit_noshare       surefit's defaults plus --share_prefixes false: every row computes its whole prompt, also
                          the paragraph other questions in its batch share (what sharing buys on this data)
    surefit_unfused       surefit's defaults plus --fused_cross_entropy false: the LM head's logits for all
                          supervised tokens of a micro-batch at once (what fusing the head with the loss buys)
    trainer_seq2seq       transformers.Trainer + DataCollatorForSeq2Seq + length grouping, fp32 (Trainer's default)
    trainer_seq2seq_bf16  the same with bf16=True (CPU autocast)
    trl_sft               trl.SFTTrainer on a prompt/completion dataset at TRL's defaults (bf16=True and
                          gradient_checkpointing=True are TRL's defaults; completion-only loss is its default for
                          prompt/completion data)
    trl_sft_fp32          the same with bf16=False, gradient_checkpointing=False (the Trainer's defaults)
    trl_sft_bf16          the same with bf16=True, gradient_checkpointing=False (TRL given bf16, without its
                          default checkpointing: its fastest setting here)
    seeds_trainer         reference: Trainer + DataCollatorForLanguageModeling, labels = the full text (as people do;
                          the loss is on every token, so its loss is not comparable)

    .venv/bin/python benchmarks/cpu_sft.py                       # --rows 64, every configuration
    .venv/bin/python benchmarks/cpu_sft.py --rows 256
    .venv/bin/python benchmarks/cpu_sft.py --only surefit,trainer_seq2seq --quick
    .venv/bin/python benchmarks/cpu_sft.py --eval-speed          # surefit: per-epoch F1 evaluation vs training epoch
    .venv/bin/python benchmarks/cpu_sft.py --workload chat       # rows that share no prompt, long answers

Workloads (--workload): squad (default; questions share paragraphs, ~4% of tokens supervised) and chat (one row per
conversation of ../shared/data/chat/glaive_toolcall_en_demo.json: the first user message as input, the rest of the
conversation as the answer, cut at a whole turn to fit the maximum length; no shared prompt, most tokens supervised).
`make bench-sft` runs both.

Writes benchmarks/results/cpu_sft.md and .json (--rows 64), cpu_sft_256.md/.json (other --rows), cpu_sft_chat.md/.json
(--workload chat), or cpu_sft_eval.md/.json (--eval-speed); --quick writes into its work folder only, unless --out is
given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402  (next to this file; its import time starts each worker's set-up clock)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH, MAX_LEN, LR, EPOCHS, SEED = 4, 384, 2e-4, 1, 0
LORA_R, LORA_ALPHA, LORA_DROPOUT, WARMUP_RATIO = 16, 32, 0.05, 0.05

# name -> (kind, options, one-line description)
CONFIGS: dict[str, tuple[str, dict[str, Any], str]] = {
    "surefit": ("surefit", {}, "surefit defaults (precision auto)"),
    "surefit_fp32": ("surefit", {"precision": "fp32"}, "surefit --precision fp32"),
    "surefit_ckpt": ("surefit", {"gradient_checkpointing": True}, "surefit --gradient_checkpointing (memory for time)"),
    "surefit_noshare": ("surefit", {"share_prefixes": False}, "surefit --share_prefixes false (every row in full)"),
    "surefit_unfused": ("surefit", {"fused_cross_entropy": False},
                        "surefit --fused_cross_entropy false (LM head and loss unfused)"),
    "surefit_rerun": ("surefit", {}, "surefit defaults run again on the start-up cache the surefit run filled (a rerun: "
                      "encoded data, doctor, plan and evaluation before training reused)"),
    "trainer_seq2seq": ("seq2seq", {"bf16": False}, "Trainer + DataCollatorForSeq2Seq + length grouping, fp32"),
    "trainer_seq2seq_bf16": ("seq2seq", {"bf16": True}, "the same, bf16=True"),
    "trl_sft": ("trl", {}, "TRL SFTTrainer, prompt/completion, TRL defaults"),
    "trl_sft_fp32": ("trl", {"bf16": False, "gradient_checkpointing": False}, "TRL, bf16=False, no grad. checkpointing"),
    "trl_sft_bf16": ("trl", {"bf16": True, "gradient_checkpointing": False}, "TRL, bf16=True, no grad. checkpointing"),
    "seeds_trainer": ("seeds", {}, "reference: Trainer, labels = full text (LM collator), fp32"),
}
WORKLOADS = {
    "squad": "the first N SQuAD questions of squad/dev-v1.1-part-a.json (questions share paragraphs; ~4% of tokens "
             "supervised)",
    "chat": "one row per conversation of chat/glaive_toolcall_en_demo.json: the first user message as input, the rest "
            "of the conversation as the answer (no shared prompt; most tokens supervised)",
}
# Goals (issue 24): surefit's defaults >= 3x the fastest anchor at its defaults and >= 2x the bf16 anchor, at <= 0.5x
# the leanest anchor's peak RSS, with the same final loss.
SPEED_GOAL, BF16_GOAL, RSS_GOAL, BF16_ANCHOR = 3.0, 2.0, 0.5, "trainer_seq2seq_bf16"
ANCHORS_DEFAULT = ["trainer_seq2seq", "trl_sft"]  # each anchor at its own defaults
ANCHORS_ALL = ["trainer_seq2seq", "trainer_seq2seq_bf16", "trl_sft", "trl_sft_fp32", "trl_sft_bf16"]
NUMERIC = ["train_seconds", "setup_seconds", "peak_rss_mb", "final_loss", "eval_seconds_epoch1", "process_seconds"]


# ================================================================================================== parent: data


def prepare(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Read the SQuAD rows once (with surefit's reader, so every configuration trains on the same rows), encode them
    with surefit's encoder for the reference token counts, and write the files the workers read."""
    from surefit.data.encode import DEFAULT_TEMPLATE, build_prompt_format, encode_rows
    from surefit.data.readers import read_rows
    from surefit.data.sampling import step_batches
    from surefit.models import load_tokenizer, model_folder, resolve_model

    source = resolve_model(None)
    path = model_folder(source, log=print)  # converts the GGUF once (cached), outside every timed run
    tok, _ = load_tokenizer(path, source)
    problems: list = []
    squad = Path(args.shared) / "squad" / "dev-v1.1-part-a.json"
    if args.workload == "chat":
        squad = chat_rows(Path(args.shared) / "chat" / "glaive_toolcall_en_demo.json", tok, workdir)
    rows = read_rows(squad, problems)
    if problems:
        raise SystemExit(f"cannot read {squad}: {problems}")
    n_val = args.val_rows
    train, val = rows[: args.rows], rows[-n_val:]
    assert args.rows + n_val <= len(rows), "train and validation rows would overlap"
    fmt = build_prompt_format(tok)
    examples, report = encode_rows(train, tok, fmt, max_seq_length=MAX_LEN)
    if len(examples) != len(train):
        raise SystemExit(f"{len(train) - len(examples)} rows excluded by encoding; pick other rows")
    with (workdir / "train.jsonl").open("w", encoding="utf-8") as fh, \
            (workdir / "encoded.jsonl").open("w", encoding="utf-8") as fe:
        for ex in examples:
            r = ex.row.fields
            # The input as it survives truncation, for the configurations that tokenize text themselves (TRL, the
            # seeds' recipe): they then see the same tokens instead of cutting the answer off the right end.
            kept = ex.input_ids[len(fmt.prefix_ids) : ex.prompt_len - len(fmt.suffix_ids)]
            fit_text = r["input"] if len(kept) == len(tok(r["input"], add_special_tokens=False)["input_ids"]) \
                else tok.decode(kept)
            fh.write(json.dumps({"input": r["input"], "target": r["target"], "answers": r["answers"],
                                 "input_fit": fit_text}) + "\n")
            fe.write(json.dumps({"input_ids": ex.input_ids, "labels": ex.labels}) + "\n")
    with (workdir / "val.jsonl").open("w", encoding="utf-8") as fh:
        for row in val:
            r = row.fields
            fh.write(json.dumps({"input": r["input"], "target": r["target"], "answers": r["answers"]}) + "\n")
    lengths = [len(e.input_ids) for e in examples]
    steps = math.ceil(len(examples) / BATCH)
    # surefit's padded size, by replaying its own batch plan (epoch 1, seed 0): the trainers' is counted as it runs.
    surefit_padded = sum(max(lengths[i] for i in b) * len(b) for b in step_batches(lengths, BATCH, SEED, 1))
    spec = {
        "model_path": str(path), "template": DEFAULT_TEMPLATE, "rows": len(examples), "val_rows": len(val),
        "steps": steps, "warmup_steps": int(WARMUP_RATIO * steps * EPOCHS),  # surefit's rule: int(ratio * total)
        "ref_tokens": report.tokens, "ref_supervised": report.supervised_tokens, "truncated": report.truncated,
        "tokens_cut": report.tokens_cut, "longest": max(lengths), "surefit_padded": surefit_padded,
        "eos": tok.eos_token, "pad": tok.pad_token, "squad": str(squad), "val_source": f"last {len(val)} rows of {squad}",
        "workload": args.workload,
        "source": WORKLOADS[args.workload],
    }
    (workdir / "spec.json").write_text(json.dumps(spec, indent=2), encoding="utf-8")
    return spec


CHAT_ROLES = {"human": "User", "gpt": "Assistant", "function_call": "Function call", "observation": "Function result"}


def chat_rows(source: Path, tok: Any, workdir: Path) -> Path:
    """The chat workload's rows, one per conversation: ``input`` = its first user message, ``target`` = the rest of
    the conversation as a transcript (``Assistant: ...``, ``User: ...``, function calls and results), cut at the last
    whole turn that keeps the example within the maximum length. Rows share no prompt and most of their tokens carry
    loss (as instruction data with long answers does); written as input/target JSONL for every configuration."""
    from surefit.data.encode import DEFAULT_TEMPLATE

    data = json.loads(source.read_text(encoding="utf-8"))
    out = workdir / "chat_rows.jsonl"
    budget = MAX_LEN - 4  # room for the EOS and for tokens merging at the boundaries
    seen: set[str] = set()  # the file repeats some first messages: one row each, so validation never sees training
    with out.open("w", encoding="utf-8") as fh:
        for conv in data:
            turns = conv["conversations"]
            if not turns or turns[0]["from"] != "human" or " ".join(turns[0]["value"].lower().split()) in seen:
                continue
            seen.add(" ".join(turns[0]["value"].lower().split()))
            prompt = DEFAULT_TEMPLATE.replace("{input}", turns[0]["value"])
            used = len(tok(prompt, add_special_tokens=False)["input_ids"])
            parts: list[str] = []
            for t in turns[1:]:
                piece = f"{CHAT_ROLES.get(t['from'], t['from'])}: {t['value'].strip()}"
                cost = len(tok(("\n\n" if parts else "") + piece, add_special_tokens=False)["input_ids"])
                if used + cost > budget:
                    break
                parts.append(piece)
                used += cost
            if parts:
                target = "\n\n".join(parts)
                fh.write(json.dumps({"input": turns[0]["value"], "target": target, "answers": [target]}) + "\n")
    return out


# ================================================================================================== workers


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _resolved_precision(out: Path, opts: dict[str, Any]) -> str:
    plan_file = out / "memory_plan.json"
    plan = json.loads(plan_file.read_text(encoding="utf-8")) if plan_file.is_file() else {}
    got = plan.get("precision", opts.get("precision", "auto"))
    if got == "bf16" and plan.get("frozen_dtype"):
        got = "bf16 matmuls summed in fp32, activations saved in bf16"
    return got if "precision" in opts else f"auto = {got}"


def worker_surefit(name: str, opts: dict[str, Any], spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """surefit through its Python API. Its own metrics.jsonl gives the training time (``time_per_epoch``: the sum of
    its step times, evaluation and checkpointing excluded) and the token-weighted ``train_loss``. Evaluation seconds
    are not logged by surefit, so its two evaluation functions are wrapped here with a timer (nothing else changes)."""
    import surefit
    import surefit.tasks.runner as common
    import surefit.tasks.sft.train_sft as sft

    marks: dict[str, Any] = {"fit_start": None, "evals": []}
    original_fit, original_loss, original_gen = common.fit, sft.evaluate_loss, sft.greedy_generate

    def fit(*a: Any, **k: Any) -> Any:
        marks["fit_start"] = time.perf_counter()
        benchlib.PHASES.switch("train")
        try:
            return original_fit(*a, **k)
        finally:
            benchlib.PHASES.switch("after")

    def timed(kind: str, fn: Any) -> Any:
        # Each evaluation pass (its loss, its generation) is "eval"; what follows one is training again until fit
        # returns ("after"). An evaluation that generates nothing (loss only, e.g. chat rows' long answers) must not
        # leave the phase at "eval" for the epoch after it, which the earlier version did.
        def wrapper(*a: Any, **k: Any) -> Any:
            benchlib.PHASES.switch("eval")
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                marks["evals"].append((kind, time.perf_counter() - t0))
                benchlib.PHASES.switch("train")
        return wrapper

    def apply_lora(*a: Any, **k: Any) -> Any:
        model = original_lora(*a, **k)
        marks["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return model

    original_lora = sft.apply_lora
    sft.apply_lora = apply_lora
    common.fit = fit
    sft.evaluate_loss = timed("loss", original_loss)
    sft.greedy_generate = timed("generate", original_gen)
    out = workdir / f"run-{name}"
    shutil.rmtree(out, ignore_errors=True)
    settings = dict(task="sft", data=str(workdir / "train.jsonl"), val_data=str(workdir / "val.jsonl"),
                    epochs=EPOCHS, batch_size=BATCH, max_seq_length=MAX_LEN, lora_r=LORA_R, lora_alpha=LORA_ALPHA,
                    lora_dropout=LORA_DROPOUT, lr=LR, warmup_ratio=WARMUP_RATIO, seed=SEED, output_dir=str(out),
                    # The anchors' prompt: without it surefit would use the model's own chat template (its default for
                    # a model that ships one), other tokens than the anchors train on.
                    template=spec["template"], **opts)
    t0 = time.perf_counter()
    result = surefit.train(**settings)
    t_end = time.perf_counter()
    records = _read_jsonl(out / "metrics.jsonl")
    epochs = [r for r in records if r.get("type") == "epoch"]
    final = epochs[-1]
    # Evaluation seconds per evaluation (loss + generation), in order: epoch 0, then epoch 1.
    # An evaluation is its loss pass and the generation passes after it, if any (none when it scores the loss only).
    groups: list[list[tuple[str, float]]] = []
    for kind, seconds in marks["evals"]:
        if kind == "loss" or not groups:
            groups.append([])
        groups[-1].append((kind, seconds))
    per_eval = [sum(sec for _, sec in g) for g in groups]
    # The same from metrics.jsonl alone: the epoch-1 record is written after training and its evaluation.
    eval1_from_log = (final["time"] - epochs[0]["time"] - final["time_per_epoch"]) if len(epochs) > 1 else None
    return {
        "kind": "surefit", "settings": {k: v for k, v in settings.items() if k not in ("data", "val_data")},
        # what the run resolved (auto -> bf16 or fp32), from its own memory plan
        "precision": _resolved_precision(out, opts),
        "train_seconds": final["time_per_epoch"],
        "surefit_tokens_per_s": final["train_tokens_per_s"],
        "final_loss": final["train_loss"],
        "loss_definition": "surefit train_loss: token-weighted mean over the epoch of the answer+EOS tokens",
        "setup_seconds": marks["fit_start"] - benchlib.T_PROCESS,
        "api_seconds": t_end - t0,
        "eval_seconds": per_eval,
        "eval_seconds_epoch1": per_eval[1] if len(per_eval) > 1 else None,
        "eval_split_epoch1": dict(groups[1]) if len(groups) > 1 else None,
        "eval1_seconds_from_metrics_log": eval1_from_log,
        # surefit's own evaluation wall time per epoch record (newer versions log it; None where absent)
        "eval_seconds_logged": [e.get("eval_seconds") for e in epochs],
        "eval_f1": [e.get("eval_f1") for e in epochs],
        "steps": final["step"],
        "examples_seen": final.get("examples_seen"),
        "tokens_real": result.data_report["encoding"]["train"]["tokens"],
        "tokens_supervised_seen": result.data_report["encoding"]["train"]["supervised_tokens"],
        "tokens_padded": spec["surefit_padded"],
        "trainable_params": marks.get("trainable"),
        # prompt-prefix tokens computed once for several rows of a micro-batch (absent with --share_prefixes false)
        "shared_prefix_tokens": final.get("shared_prefix_tokens"),
        "shared_prefix_rows": final.get("shared_prefix_rows"),
        # the run's own account of its start-up (command to step 1, by phase), for the whole-process section
        "startup": _read_json(out / "startup.json"),
    }


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def _load_model_and_tokenizer(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    set_seed(SEED)
    tok = AutoTokenizer.from_pretrained(spec["model_path"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    return model, tok


def _lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")


def _common_args(spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    """The hyperparameters every Trainer-based configuration shares with surefit; everything else is the trainer's
    own default (optimizer implementation, sampler unless stated, dataloader, logging)."""
    return dict(output_dir=str(workdir / f"hf-{name}"), per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS,
                learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=spec["warmup_steps"], weight_decay=0.0,
                max_grad_norm=1.0, seed=SEED, use_cpu=True, save_strategy="no", eval_strategy="no", report_to="none",
                logging_steps=10)


def _run_trainer(trainer: Any, collator: benchlib.CountingCollator, timer: Any, bf16: bool, warm: bool,
                 extra_reset: Any = None) -> dict[str, Any]:
    """Warm up (optional, undone), then time ``trainer.train()`` and gather what it did."""
    benchlib.PHASES.switch("warmup")
    warm_s = benchlib.warm_up(trainer, bf16) if warm else 0.0
    collator.reset()
    trainer.bench_reset()
    if extra_reset is not None:
        extra_reset()
    t_setup_end = time.perf_counter()
    benchlib.PHASES.switch("train")
    out = trainer.train()
    t_end = time.perf_counter()
    benchlib.PHASES.switch("after")
    model = trainer.model
    return {
        "train_seconds": timer.seconds,
        "train_call_seconds": t_end - t_setup_end,
        "trainer_train_runtime": out.metrics.get("train_runtime"),
        "trainer_reported_loss": out.metrics.get("train_loss"),
        "final_loss": trainer.bench_loss,
        "loss_tokens": trainer.bench_items,
        "steps": trainer.state.global_step,
        "setup_seconds": t_setup_end - benchlib.T_PROCESS - warm_s,
        "warmup_seconds": warm_s,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        **collator.counts(),
    }


def worker_seq2seq(name: str, opts: dict[str, Any], spec: dict[str, Any], workdir: Path, warm: bool) -> dict[str, Any]:
    """Trainer + DataCollatorForSeq2Seq on the exact token ids and labels surefit encodes (-100 over the prompt)."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    model, tok = _load_model_and_tokenizer(spec)
    model = get_peft_model(model, _lora_config())
    enc = _read_jsonl(workdir / "encoded.jsonl")
    ds = Dataset.from_list([{"input_ids": e["input_ids"], "attention_mask": [1] * len(e["input_ids"]),
                             "labels": e["labels"]} for e in enc])
    args = TrainingArguments(**_common_args(spec, workdir, name), bf16=opts["bf16"],
                             train_sampling_strategy="group_by_length")
    collator = benchlib.CountingCollator(DataCollatorForSeq2Seq(tok, label_pad_token_id=-100))
    timer = benchlib.make_epoch_timer()
    trainer = benchlib.recording(Trainer)(model=model, args=args, train_dataset=ds, data_collator=collator,
                                          processing_class=tok, callbacks=[timer])
    res = _run_trainer(trainer, collator, timer, opts["bf16"], warm)
    return {"kind": "seq2seq", "precision": "bf16 autocast" if opts["bf16"] else "fp32", **res,
            "loss_definition": "token-weighted mean over the epoch of the answer+EOS tokens",
            "resolved": {"bf16": args.bf16, "optim": str(args.optim), "sampler": args.train_sampling_strategy,
                         "gradient_checkpointing": args.gradient_checkpointing}}


def _render(spec: dict[str, Any], text: str) -> str:
    return spec["template"].replace("{input}", text)


def worker_trl(name: str, opts: dict[str, Any], spec: dict[str, Any], workdir: Path, warm: bool) -> dict[str, Any]:
    """TRL SFTTrainer on a prompt/completion dataset (the prompt is surefit's template filled in)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tok = _load_model_and_tokenizer(spec)
    rows = _read_jsonl(workdir / "train.jsonl")
    ds = Dataset.from_list([{"prompt": _render(spec, r["input_fit"]), "completion": r["target"]} for r in rows])
    args = SFTConfig(**_common_args(spec, workdir, name), max_length=MAX_LEN, **opts)
    timer = benchlib.make_epoch_timer()
    trainer = benchlib.recording(SFTTrainer)(model=model, args=args, train_dataset=ds, processing_class=tok,
                                             peft_config=_lora_config(), callbacks=[timer])
    collator = benchlib.CountingCollator(trainer.data_collator)
    trainer.data_collator = collator

    def reset_trl_metrics() -> None:  # the warm-up step went through TRL's compute_loss, which keeps metrics
        for d in trainer._metrics.values():
            d.clear()
        trainer._total_train_tokens = 0

    bf16 = bool(args.bf16)
    res = _run_trainer(trainer, collator, timer, bf16, warm, reset_trl_metrics)
    return {"kind": "trl", "precision": ("bf16 autocast" if bf16 else "fp32")
            + (" + grad. checkpointing" if args.gradient_checkpointing else ""), **res,
            "loss_definition": "token-weighted mean over the epoch of the completion tokens (completion + EOS)",
            "resolved": {"bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing,
                         "completion_only_loss": trainer.completion_only_loss, "optim": str(args.optim),
                         "packing": args.packing, "padding_free": args.padding_free, "max_length": args.max_length}}


def worker_seeds(name: str, opts: dict[str, Any], spec: dict[str, Any], workdir: Path, warm: bool) -> dict[str, Any]:
    """The common recipe: tokenize prompt + answer + EOS as one text, DataCollatorForLanguageModeling(mlm=False)
    copies input_ids into labels (and, the pad token being EOS here, masks the EOS label as padding)."""
    from datasets import Dataset
    from peft import get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    model, tok = _load_model_and_tokenizer(spec)
    model = get_peft_model(model, _lora_config())
    rows = _read_jsonl(workdir / "train.jsonl")
    texts = [_render(spec, r["input_fit"]) + r["target"] + tok.eos_token for r in rows]
    enc = tok(texts, truncation=True, max_length=MAX_LEN)
    ds = Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    args = TrainingArguments(**_common_args(spec, workdir, name))
    collator = benchlib.CountingCollator(DataCollatorForLanguageModeling(tok, mlm=False))
    timer = benchlib.make_epoch_timer()
    trainer = benchlib.recording(Trainer)(model=model, args=args, train_dataset=ds, data_collator=collator,
                                          processing_class=tok, callbacks=[timer])
    res = _run_trainer(trainer, collator, timer, False, warm)
    return {"kind": "seeds", "precision": "fp32", **res,
            "loss_definition": "token-weighted mean over the epoch of EVERY non-pad token (prompt included; EOS "
                               "masked because pad == EOS): not comparable with the others",
            "resolved": {"bf16": args.bf16, "optim": str(args.optim), "sampler": args.train_sampling_strategy}}


def worker_main(name: str, workdir: Path, warm: bool) -> None:
    spec = json.loads((workdir / "spec.json").read_text(encoding="utf-8"))
    kind, opts, _ = CONFIGS[name]
    if kind == "surefit":
        rec = worker_surefit(name, opts, spec, workdir)
    elif kind == "seq2seq":
        rec = worker_seq2seq(name, opts, spec, workdir, warm)
    elif kind == "trl":
        rec = worker_trl(name, opts, spec, workdir, warm)
    else:
        rec = worker_seeds(name, opts, spec, workdir, warm)
    benchlib.write_result(workdir, name, rec)
    if kind == "surefit":
        # The process ends as the `surefit` command ends (cli.exit_now: the exit handlers run and the output is
        # flushed, without the interpreter's teardown of the trained model's objects); the trainers' processes end
        # as a Python script does, which is what their users run.
        from surefit.cli import exit_now

        exit_now(0)


# ================================================================================================== report


def _tps(rec: dict[str, Any], key: str, spec: dict[str, Any]) -> float | None:
    s = rec.get("train_seconds")
    return spec[key] / s if s else None


def _shared_lines(ok: dict[str, dict[str, Any]], spec: dict[str, Any]) -> list[str]:
    shared = {n: r for n, r in ok.items() if r.get("shared_prefix_tokens")}
    if not shared:
        return []
    parts = [f"{n} {r['shared_prefix_rows']} rows, {benchlib.fmt(r['shared_prefix_tokens'])} tokens" for n, r in shared.items()]
    return ["", "Shared prompt prefixes (surefit): rows whose batch holds another question on the same paragraph reuse "
            "that paragraph's states, computed once (same loss; see the README). Prefix tokens not recomputed, of "
            f"{benchlib.fmt(spec['ref_tokens'])}: " + "; ".join(parts) + ". Every tokens/s column still divides "
            "the same token count, so it counts these tokens as trained, which they are."]


def _trainable_line(ok: dict[str, dict[str, Any]]) -> str:
    counts = {n: r.get("trainable_params") for n, r in ok.items()}
    if len(set(counts.values())) == 1:
        return f"Trainable (LoRA) parameters: {benchlib.fmt(next(iter(counts.values())))} in every configuration."
    return "Trainable (LoRA) parameters: " + ", ".join(f"{n} {benchlib.fmt(v)}" for n, v in counts.items()) + "."


def build_report(spec: dict[str, Any], results: dict[str, dict[str, Any]], machine: dict[str, Any],
                 args: argparse.Namespace, started: str) -> tuple[list[str], dict[str, Any]]:
    ok = {n: r for n, r in results.items() if "error" not in r}
    for r in ok.values():
        r["tokens_per_s"] = _tps(r, "ref_tokens", spec)
        r["supervised_tokens_per_s"] = _tps(r, "ref_supervised", spec)

    goals, verdicts = benchlib.goal_rows(ok, ANCHORS_DEFAULT, ANCHORS_ALL, unit="tok/s", speed_goal=SPEED_GOAL,
                                         bf16_goal=BF16_GOAL, rss_goal=RSS_GOAL, bf16_anchor=BF16_ANCHOR)
    sf = ok.get("surefit")

    md = [
        f"# cpu_sft: surefit vs Trainer vs TRL, {spec['rows']} {'chat' if spec.get('workload') == 'chat' else 'SQuAD'} "
        "rows" + (" (QUICK smoke run)" if args.quick else ""),
        "",
        f"Workload `{spec.get('workload', 'squad')}`: {spec.get('source', WORKLOADS['squad'])}.",
        "",
        f"Embedded SmolLM2-135M-Instruct (fp32 weights), the first {spec['rows']} rows of `{Path(spec['squad']).name}`, "
        f"LoRA r={LORA_R} alpha={LORA_ALPHA} dropout={LORA_DROPOUT} on {', '.join(LORA_TARGETS)}, batch {BATCH}, max "
        f"length {MAX_LEN}, AdamW lr {LR}, cosine with {spec['warmup_steps']} warmup step(s) (5%, surefit's rule), "
        f"clipping 1.0, 1 epoch = {spec['steps']} steps, seed {SEED}. Every configuration ran in its own process, one "
        f"after the other, on {started}. Prompt: surefit's `DEFAULT_TEMPLATE` for everyone.",
        "",
        f"Training set: {spec['ref_tokens']:,} tokens (prompt + answer + EOS, non-padding), {spec['ref_supervised']:,} "
        f"of them supervised (answer + EOS); {spec['truncated']} prompt(s) truncated at {MAX_LEN} ({spec['tokens_cut']} "
        f"input tokens cut from the left); longest example {spec['longest']} tokens. **tokens/s = {spec['ref_tokens']:,} "
        f"/ training seconds and supervised tokens/s = {spec['ref_supervised']:,} / training seconds for every row**, "
        "so the columns compare time for the same work.",
        "",
        "| config | what | precision | train s | tokens/s | supervised tok/s | peak RSS MB | final loss | "
        "setup s | padding | tokens seen | surefit speed-up | others' CPU | training RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    sf_tps = sf["tokens_per_s"] if sf else None
    for name in results:
        r = results[name]
        desc = CONFIGS[name][2]
        if "error" in r:
            md.append(f"| {name} | {desc} | - | FAILED: {r['error']} | | | | | | | | | | |")
            continue
        pad = r.get("tokens_padded")
        real = r.get("tokens_real")
        padding = f"{100 * (pad - real) / pad:.0f}%" if pad and real else "-"
        rel = f"{sf_tps / r['tokens_per_s']:.2f}x" if sf_tps else "-"
        loss = benchlib.fmt(r.get("final_loss"), 4) + (" *" if r["kind"] == "seeds" else "")
        md.append(
            f"| {name} | {desc} | {r.get('precision')} | {benchlib.fmt(r['train_seconds'])} | "
            f"{benchlib.fmt(r['tokens_per_s'], 0)} | {benchlib.fmt(r['supervised_tokens_per_s'], 1)} | "
            f"{benchlib.fmt(r['peak_rss_mb'], 0)} | {loss} | {benchlib.fmt(r.get('setup_seconds'))} | {padding} | "
            f"{benchlib.fmt(real)} | {rel} | {benchlib.fmt(r.get('others_cpu_cores'), 1)} | "
            f"{benchlib.fmt((r.get('peak_rss_by_phase_mb') or {}).get('train'), 0)} |")
    md += [
        "",
        "\\* seeds_trainer's loss is over every non-padding token (prompt included, EOS masked as padding because the "
        "pad token is EOS), so it is not comparable with the others (answer + EOS tokens only); its supervised "
        "tok/s column still counts answer tokens, for the same work.",
        "",
        _trainable_line(ok),
        *_shared_lines(ok, spec),
        "",
        f"## Goals (issue: surefit >= {SPEED_GOAL}x the fastest anchor at defaults, >= {BF16_GOAL}x the bf16 anchor, "
        f"RSS <= {RSS_GOAL}x the leanest anchor, same loss)",
        "",
        "| goal | measured | target | result | detail |",
        "|---|---|---|---|---|",
        *goals,
        "",
        *whole_process_lines(ok),
        "",
        "Anchors: " + ", ".join(ANCHORS_ALL) + f"; at their defaults: {', '.join(ANCHORS_DEFAULT)} (TRL's defaults "
        "include bf16 autocast and gradient checkpointing). seeds_trainer is a reference row, not an anchor.",
        "",
        "## How each number is measured",
        "",
        "- **train s**: the training epoch only. surefit: `time_per_epoch` from its `metrics.jsonl` (sum of its step "
        "times: collation, forward, backward, clipping, optimizer; its epoch-0/epoch-1 evaluations and checkpoint "
        "excluded). Trainers: a callback's `on_epoch_begin` to `on_epoch_end` (data loading, collation, steps, "
        "logging). Model loading, tokenization and trainer construction are in **setup s** (process start to the "
        "training call; for surefit, to the start of its `fit`, so its data checks, doctor and model load).",
        "- Warm start: surefit's timed epoch follows its doctor dry run and its epoch-0 evaluation, which already ran "
        "the model; each Trainer-based run first does one forward + backward on its first batch outside the timing, "
        "with gradients zeroed and every RNG restored afterwards (`--no-warmup` turns this off).",
        "- **others' CPU**: cores kept busy by other processes while the worker ran (machine busy time from "
        "`/proc/stat` minus the worker's own CPU time, over its wall time); 0 on a quiet machine. With `--repeats N` "
        "the training time is the fastest of the N runs and the other numbers their medians.",
        "- **peak RSS**: the worker process's peak resident memory over its whole life (load, data, training, and for "
        "surefit its evaluations and saves). **training RSS**: the peak while training only (for the trainers "
        "`trainer.train()`; for surefit from its `fit` start to its epoch-0 evaluation and from the end of that "
        "evaluation to the start of the next), from the kernel's high-water mark reset between phases "
        "(`/proc/self/clear_refs`); every phase's peak is in the JSON (`peak_rss_by_phase_mb`).",
        "- **final loss**: token-weighted mean of the training loss over the whole epoch, the definition of surefit's "
        "`train_loss`. For the trainers a `compute_loss` override calls the original and records loss x items; "
        "`trainer_reported_loss` (the Trainer's own mean of step means) is in the JSON.",
        "- **padding**: share of the padded batch that is padding (trainers: counted by a wrapper around their "
        "collator; surefit: its batch plan replayed with `step_batches`). **tokens seen**: non-padding tokens that "
        "reached the model (TRL and seeds_trainer tokenize the text themselves, so a few tokens can differ where "
        "tokens merge across the prompt/answer boundary).",
        "- Data: Trainer + DataCollatorForSeq2Seq trains on the token ids and labels surefit's encoder produces "
        "(identical tokens); TRL gets `{prompt: template(input), completion: answer}` and appends EOS itself; "
        "seeds_trainer tokenizes `template(input) + answer + EOS` as one text. Rows whose prompt surefit truncates "
        "are given to the text-based configurations with the input already cut the same way.",
        "- surefit evaluates before and after the epoch (on "
        f"{spec['val_rows']} held-out rows, {spec['val_source']}); the trainers do no evaluation.",
        "",
        *benchlib.machine_lines(machine, [r.get("load_before", []) for r in results.values()]
                                + [r.get("load_after", []) for r in results.values()],
                                [r.get("others_cpu_cores") for r in results.values()]),
        "",
        f"Command: `{benchlib.command_line('cpu_sft.py', args)}`; "
        "raw numbers (and each worker's resolved settings) in the `.json` next to this file.",
        "",
    ]
    verdicts.update(whole_process_verdicts(ok))
    return md, {"verdicts": verdicts}


def whole_seconds(r: dict[str, Any]) -> float | None:
    """A job's start-to-exit seconds as it would run on its own: a trainer's untimed warm-up step is one step this
    script adds, so one ordinary step's time comes off (not the warm-up's own, which carries the first call's costs
    that the first real step would otherwise pay)."""
    total = r.get("process_seconds")
    if not total:
        return None
    if r.get("warmup_seconds") and r.get("train_seconds") and r.get("steps"):
        return total - r["train_seconds"] / r["steps"]
    return total


def _whole_goals(ok: dict[str, dict[str, Any]]) -> list[tuple[str, float | None, float, str]]:
    """(label, surefit's speed-up in whole-process seconds, goal, detail) for each whole-process goal."""
    sf = whole_seconds(ok.get("surefit", {}))
    have = [(s, n) for n in ANCHORS_DEFAULT if (s := whole_seconds(ok.get(n, {})))]
    fastest = min(have, default=None)
    bf16 = whole_seconds(ok.get(BF16_ANCHOR, {}))
    goals = [
        ("surefit (defaults) whole process vs the fastest anchor at its defaults",
         fastest[0] / sf if sf and fastest else None, SPEED_GOAL,
         f"fastest: {fastest[1]} ({fastest[0]:.1f} s)" if fastest else "no anchor measured"),
        (f"surefit (defaults) whole process vs {BF16_ANCHOR}", bf16 / sf if sf and bf16 else None, BF16_GOAL,
         f"{BF16_ANCHOR}: {bf16:.1f} s" if bf16 else "not measured"),
    ]
    rerun = whole_seconds(ok.get("surefit_rerun", {}))
    if rerun:  # the same job again: what a second run with another learning rate or seed finds
        goals += [("(surefit_rerun, the same run again, vs the same)", fastest[0] / rerun if fastest else None,
                   SPEED_GOAL, "start-up cache filled by the surefit run"),
                  (f"(surefit_rerun vs {BF16_ANCHOR})", bf16 / rerun if bf16 else None, BF16_GOAL, "")]
    return goals


def whole_process_verdicts(ok: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
    return {f"whole_process_{i}": benchlib.ratio_line(label, value, goal, True, detail)[1]
            for i, (label, value, goal, detail) in enumerate(_whole_goals(ok))}


def whole_process_lines(ok: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's whole-process goals (each job timed from its process start to its exit, by the parent) and where
    each job's seconds went: set-up to training, training, surefit's evaluations, and the rest (saving, exit)."""
    lines = ["", "## Whole process: start to exit", "",
             "Each job timed by this script from launching its process to the process's exit. surefit's includes its "
             "two evaluations (before and after the epoch: the validation loss, and generated answers scored where "
             "the run generates); the anchors "
             "evaluate nothing. A trainer's untimed warm-up step (see below) is one step more than it would run "
             "alone, so one ordinary step's time is taken off its whole process for these goals. surefit's worker "
             "ends as the `surefit` command does (`cli.exit_now`: exit handlers run, output flushed, no interpreter "
             "teardown of the trained model's objects); the trainers' workers end as a Python script does. Before "
             "each job the model's files are read once, and before the first one the libraries are imported in a process "
             "of their own, so every job finds them in the page cache.", "",
             "| goal | measured | target | result | detail |", "|---|---|---|---|---|"]
    lines += [benchlib.ratio_line(label, value, goal, True, detail)[0]
              for label, value, goal, detail in _whole_goals(ok)]
    lines += ["", "| job | whole process s | set-up s (to training) | warm-up step s | training s | evaluations s | "
              "rest s (saves, exit) |", "|---|---|---|---|---|---|---|"]
    for name, r in ok.items():
        total, setup, train = r.get("process_seconds"), r.get("setup_seconds"), r.get("train_seconds")
        evals, warm = sum(r.get("eval_seconds") or []), r.get("warmup_seconds") or 0.0
        rest = total - setup - warm - train - evals if total and setup is not None and train is not None else None
        lines.append(f"| {name} | {benchlib.fmt(total)} | {benchlib.fmt(setup)} | {benchlib.fmt(warm) if warm else '-'} "
                     f"| {benchlib.fmt(train)} | {benchlib.fmt(evals) if r.get('eval_seconds') else '-'} | "
                     f"{benchlib.fmt(rest)} |")
    start = (ok.get("surefit") or {}).get("startup") or {}
    phases = start.get("phases") or {}
    if phases:
        top = sorted(phases.items(), key=lambda kv: -kv[1])
        lines += ["", f"surefit's start-up to step 1 by its own startup.json: {start.get('seconds', 0):.1f} s = "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in top if v >= 0.05) + "."]
    return lines


# ================================================================================================== eval speed


def eval_speed_report(spec: dict[str, Any], r: dict[str, Any], machine: dict[str, Any], started: str) -> list[str]:
    if "error" in r:
        return ["# cpu_sft eval speed", "", f"FAILED: {r['error']}", "", "```", *r.get("log_tail", []), "```", ""]
    epoch = r["train_seconds"]
    timed = r["eval_seconds"]  # this script's timers around evaluate_loss + greedy_generate
    logged = r.get("eval_seconds_logged") or []
    own = len(logged) > 1 and all(x is not None for x in logged)  # surefit logs eval_seconds itself
    ev = logged if own else timed
    e1 = ev[1] if len(ev) > 1 else None
    split = r.get("eval_split_epoch1") or {}
    ok = e1 is not None and e1 < epoch
    source = ("surefit's own `eval_seconds` (epoch records of metrics.jsonl)" if own
              else "timers this script wraps around `evaluate_loss` and `greedy_generate`")
    return [
        f"# cpu_sft eval speed: per-epoch F1 evaluation of {spec['val_rows']} SQuAD rows vs one training epoch",
        "",
        f"surefit defaults (precision {r.get('precision')}), embedded SmolLM2-135M-Instruct, LoRA r={LORA_R}, batch {BATCH}, max length "
        f"{MAX_LEN}; trained one epoch on the first {spec['rows']} rows of `{Path(spec['squad']).name}`, evaluated "
        f"(validation loss + batched greedy generation + SQuAD F1/EM) on {spec['val_rows']} other rows "
        f"({spec['val_source']}), before training and after the epoch. Run on {started}.",
        "",
        "| measure | seconds |",
        "|---|---|",
        f"| one training epoch on {spec['rows']} rows (`time_per_epoch`) | {epoch:.1f} |",
        f"| evaluation before training (epoch 0) | {ev[0]:.1f} |" if ev else "| evaluation at epoch 0 | - |",
        f"| evaluation after the epoch (epoch 1) | {benchlib.fmt(e1)} |",
        f"| of which validation loss / generation (this script's timers) | {benchlib.fmt(split.get('loss'))} / "
        f"{benchlib.fmt(split.get('generate'))} |",
        f"| cross-check: epoch-1 evaluation by this script's timers | {benchlib.fmt(timed[1] if len(timed) > 1 else None)} |",
        f"| cross-check: from metrics.jsonl timestamps (`time` difference minus `time_per_epoch`) | "
        f"{benchlib.fmt(r.get('eval1_seconds_from_metrics_log'))} |",
        "",
        f"Goal (issue): the per-epoch F1 evaluation of {spec['val_rows']} rows takes less time than one training "
        f"epoch on them: **{'PASS' if ok else 'FAIL'}** (evaluation / epoch = "
        f"{(e1 / epoch if e1 else float('nan')):.2f}). F1 before / after: "
        f"{', '.join(benchlib.fmt(x, 4) for x in r.get('eval_f1', []))}.",
        "",
        f"Evaluation seconds: {source}. The epoch-0 evaluation is slower than the epoch-1 one because the untrained "
        "model rarely stops at EOS, so its generations run to the length limit.",
        "",
        *benchlib.machine_lines(machine, [r.get("load_before", []), r.get("load_after", [])],
                                [r.get("others_cpu_cores")]),
        "",
        "Command: `.venv/bin/python benchmarks/cpu_sft.py --eval-speed`",
        "",
    ]


# ================================================================================================== main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=str(HERE.parent.parent / "shared" / "data"), help="the shared data folder")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="squad",
                    help=("squad: " + WORKLOADS["squad"] + "; chat: " + WORKLOADS["chat"]).replace("%", "%%"))
    ap.add_argument("--rows", type=int, default=None,
                    help="training rows: the first N rows of the workload (default 64; --quick 8; --eval-speed 200)")
    ap.add_argument("--val_rows", type=int, default=None, help="surefit's held-out rows (default 8; --eval-speed 200)")
    ap.add_argument("--only", default=None, help=f"comma-separated configurations (of: {', '.join(CONFIGS)})")
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 rows (4 held out), results in the work folder")
    ap.add_argument("--eval-speed", action="store_true",
                    help="surefit only: its per-epoch F1 evaluation of 200 rows vs a training epoch on 200 rows")
    ap.add_argument("--repeats", type=int, default=1, help="run the configurations N times (interleaved); medians")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="no untimed warm-up step for trainers")
    ap.add_argument("--timeout", type=float, default=5400, help="seconds per worker")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results; --quick: the work folder)")
    ap.add_argument("--workdir", default=None, help="work folder (default: a new temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, runs)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        worker_main(args.worker, Path(args.workdir), args.warmup)
        return

    if args.eval_speed:
        args.rows = args.rows or (8 if args.quick else 200)
        args.val_rows = args.val_rows or (4 if args.quick else 200)
        names = ["surefit"]
    else:
        args.rows = args.rows or (8 if args.quick else 64)
        args.val_rows = args.val_rows or (4 if args.quick else 8)
        names = list(CONFIGS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            ap.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cpu_sft-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else (workdir if args.quick else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    print(f"work folder: {workdir}")
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    spec = prepare(args, workdir)
    machine = benchlib.machine_info()
    print(f"{spec['rows']} rows, {spec['ref_tokens']} tokens ({spec['ref_supervised']} supervised), {spec['steps']} steps")

    if "surefit_rerun" in names and ("surefit" not in names or names.index("surefit") > names.index("surefit_rerun")):
        ap.error("surefit_rerun runs on the cache the surefit run fills: list surefit before it")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    # The libraries into the page cache before the first job too (untimed), so it does not read them from disk for
    # the jobs after it.
    subprocess.run([sys.executable, "-c", "import torch, transformers, peft, accelerate, trl, surefit.cli"], check=False,
                   capture_output=True)
    for rep in range(args.repeats):
        for name in names:
            print(f"[{rep + 1}/{args.repeats}] {name} ...", flush=True)
            # Every surefit run starts on an empty start-up cache of its own (a first run: nothing encoded, no doctor
            # or plan or evaluation stored), except surefit_rerun, which finds what this repeat's surefit run stored.
            os.environ["SUREFIT_STARTUP_CACHE"] = str(workdir / f"startup-cache-{rep}-"
                                                      f"{'surefit' if name == 'surefit_rerun' else name}")
            # The same page cache for every job: this machine's file cache can lose the model between jobs, and a
            # cold read of its 538 MB took 20 s against 1.4 s (2026-12-03), charged to whoever loads it first.
            benchlib.read_files(Path(spec["model_path"]))
            r = benchlib.run_worker(Path(__file__), name, workdir, args.timeout,
                                    [] if args.warmup else ["--no-warmup"])
            runs[name].append(r)
            if "error" in r:
                print(f"  FAILED ({r['error']}); log: {r['log']}\n  " + "\n  ".join(r.get("log_tail", [])[-8:]))
            else:
                print(f"  train {r['train_seconds']:.1f} s, {spec['ref_tokens'] / r['train_seconds']:.0f} tok/s, "
                      f"peak RSS {r['peak_rss_mb']:.0f} MB, loss {r['final_loss']:.4f}, load {r['load_after']}",
                      flush=True)
    results = {n: benchlib.median_records(rs, NUMERIC) for n, rs in runs.items()}

    if args.eval_speed:
        stem = "cpu_sft_eval"
        md = eval_speed_report(spec, results["surefit"], machine, started)
        extra: dict[str, Any] = {}
    else:
        stem = ("cpu_sft" if args.workload == "squad" else f"cpu_sft_{args.workload}") + \
            ("" if args.rows == 64 else f"_{args.rows}")
        md, extra = build_report(spec, results, machine, args, started)
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
