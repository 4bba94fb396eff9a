"""Instruction tuning of a causal LM on input -> target rows: setup -> fit -> evaluate -> save, top to bottom.

The correctness-critical pieces live in library code shared by every task: encoding builds the labels once
(``data/encode.py``), the collator only pads (``data/collate.py``), the loop normalises the loss by supervised tokens
(``training/loop.py``), checkpoints are atomic (``training/checkpoint.py``). This file wires them together and reports,
in counts, everything that happened to the data.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from surefit.config import SFTConfig
from surefit.data.augment import augment_rows
from surefit.data.collate import PadCollator
from surefit.data.encode import Example, build_prompt_format, encode_rows
from surefit.data.rows import Row
from surefit.data.sources import Rejected, check_text_fields, read_splits
from surefit.data.split import leaked, normalize_key, split_or_check
from surefit.doctor import check
from surefit.doctor.gate import gate, run_doctor
from surefit.errors import ConfigError, DataError, ModelError, Problem, raise_if, raise_input_problems
from surefit.eval.generate import greedy_generate
from surefit.eval.metrics import exact_match, squad_scores, token_f1
from surefit.models import load_causal_lm, load_tokenizer, model_folder, resolve_model
from surefit.training.distributed import is_main_process, on_main, sum_over_processes
from surefit.training.loop import Checkpointing, LoopSettings, evaluate_loss, fit, make_accelerator
from surefit.training.lora_fast import fuse_lora
from surefit.training.loss import causal_lm_loss_sum
from surefit.training.memory import enable_gradient_checkpointing, shrink_on_oom
from surefit.training.plan import plan_run, precision_name
from surefit.training.prefixes import PrefixSharing, why_not_shared
from surefit.training.run import (
    check_output_dir,
    open_metrics_log,
    quiet_libraries,
    resume_command,
    resume_point,
    save_final,
    start_output_dir,
    write_rejected,
    write_run_report,
)


def load_data(
    cfg: SFTConfig, say=print, problems: list[Problem] | None = None
) -> tuple[list[Row], list[Row], dict[str, Any]]:
    """Read, check, split (before augmentation) and augment. Every problem in every file is reported at once.

    Args:
        problems: problems already found (e.g. with ``--model``), reported together with the data's.

    Returns:
        ``(train_rows, val_rows, report)``; ``report`` holds the counts printed to the user and saved.
    """
    problems = list(problems or [])
    report: dict[str, Any] = {"notes": []}
    fields = [(cfg.input_field, "--input_field"), (cfg.target_field, "--target_field")]
    rejects: list[Rejected] | None = [] if cfg.on_bad_rows == "skip" else None
    loaded = read_splits(cfg.data, cfg.val_data, cfg.limit, problems, rejects, report["notes"])
    for name, path in (("train", cfg.data), ("validation", cfg.val_data)):
        if loaded.get(name):
            loaded[name], notes = check_text_fields(loaded[name], fields, problems, str(path), rejects=rejects)
            report["notes"] += notes
    write_rejected(cfg, rejects or [], say)  # before raising: an "all rows rejected" problem points at this file
    report["rejected_rows"] = len(rejects or [])
    raise_input_problems(problems)

    key = lambda r: normalize_key(str(r.fields[cfg.input_field]))  # noqa: E731
    train, val, notes = split_or_check(loaded["train"], loaded.get("validation"), cfg.val_fraction, cfg.seed, key,
                                       "input")
    report["notes"] += notes
    # Augment AFTER the split and only the training side: a variant of a validation row in training is a leak.
    train, stats = augment_rows(train, cfg.augmentation_factor, cfg.seed, cfg.input_field)
    report["notes"].append(stats.summary())
    if not cfg.val_data:
        assert not leaked(train, val, key), "split/augment invariant broken: a validation row leaked into training"
    report.update(train_rows=len(train), val_rows=len(val), augmentation=stats.__dict__)
    for note in report["notes"]:
        say(note)
    return train, val, report


def _golds(row: Row, target_field: str) -> list[str]:
    answers = row.fields.get("answers")
    if isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers):
        return answers
    return [str(row.fields[target_field])]


def _apply_lora(model: Any, cfg: SFTConfig, say=print) -> Any:
    if cfg.lora_r == 0:
        n = sum(p.numel() for p in model.parameters())
        say(f"full fine-tuning: {n:,} trainable parameters")
        return model
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = (
        "all-linear" if cfg.lora_targets == "all-linear" else [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    )
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.resolved_lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    try:
        model = get_peft_model(model, lora)
    except ValueError as e:
        raise ConfigError(
            Problem(f"cannot apply LoRA: {e}", "--lora_targets", "use 'all-linear' or names of Linear modules")
        ) from e
    fuse_lora(model)  # same weights and files; adapters summed in fp32, cheaper dropout (training/lora_fast.py)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    adapted = sorted({n.split(".")[-1] for n in model.peft_config["default"].target_modules})
    say(
        f"LoRA r={cfg.lora_r} alpha={cfg.resolved_lora_alpha} on {', '.join(adapted)}: "
        f"{trainable:,} trainable of {total:,} parameters ({100.0 * trainable / total:.2f}%)"
    )
    return model


def run(cfg: SFTConfig, say=print, doctor_only: bool = False) -> dict[str, Any]:
    """Train, evaluating every epoch (and before the first), and save everything under ``cfg.output_dir``.

    Returns:
        ``{"output_dir", "final_dir", "history", "data_report"}``.
    """
    from accelerate.utils import set_seed

    say = on_main(say)  # several processes: the main one reports and writes files, the others wait where needed
    quiet_libraries()
    out = Path(cfg.output_dir)
    set_seed(cfg.seed)

    # -- data (before loading the model: a data problem should cost seconds, not a model load). Resolving --model and
    # looking at --output_dir are cheap, so their problems join the data problems in one report.
    early: list[Problem] = []
    try:
        source = resolve_model(cfg.model)
    except ModelError as e:
        early = e.problems
    previous = check_output_dir(cfg, early)
    resume_from = resume_point(cfg, early, say)
    train_rows, val_rows, data_report = load_data(cfg, say, early)
    out = start_output_dir(cfg, previous, say, data_report)
    path = model_folder(source, log=say)
    tokenizer, notes = load_tokenizer(path, source, cfg.trust_remote_code)
    for note in notes:
        say(note)
    fmt = build_prompt_format(tokenizer, cfg.template, cfg.chat_template)
    enc = dict(
        max_seq_length=cfg.max_seq_length,
        input_field=cfg.input_field,
        target_field=cfg.target_field,
        truncation_side=cfg.truncation_side,
    )
    train_ex, train_rep = encode_rows(train_rows, tokenizer, fmt, split="train", **enc)
    val_ex, val_rep = encode_rows(val_rows, tokenizer, fmt, split="validation", **enc)
    excluded = [{"split": r.split, "where": w, "reason": why} for r in (train_rep, val_rep) for w, why in r.excluded]
    for rep in (train_rep, val_rep):
        say(rep.summary())
        for where, why in rep.excluded[:10]:
            say(f"  excluded {where}: {why}")
        if len(rep.excluded) > 10:
            say(f"  ... and {len(rep.excluded) - 10} more (all listed in {out / 'excluded_rows.jsonl'})")
    if excluded and is_main_process():
        with (out / "excluded_rows.jsonl").open("w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(e) + "\n" for e in excluded)
    empty = [
        Problem(
            f"no {r.split} rows left after encoding: all {r.rows} targets are longer than --max_seq_length allows",
            "--max_seq_length",
            f"raise --max_seq_length (now {cfg.max_seq_length}) or shorten the targets",
        )
        for r in (train_rep, val_rep)
        if r.encoded == 0
    ]
    raise_if(empty, DataError)
    data_report["encoding"] = {
        r.split: {k: v for k, v in r.__dict__.items() if k != "excluded"} | {"excluded": len(r.excluded)}
        for r in (train_rep, val_rep)
    }
    if is_main_process():
        (out / "data_report.json").write_text(json.dumps(data_report, indent=2, default=str), encoding="utf-8")

    # -- model
    model = load_causal_lm(path, source, cfg.trust_remote_code)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, lora=cfg.lora_r > 0)
        say("gradient checkpointing on: activations are recomputed in the backward pass")
    model = _apply_lora(model, cfg, say)
    accelerator = make_accelerator(cfg.precision, lora=cfg.lora_r > 0, report_to=cfg.trackers, project_dir=out)
    max_new = cfg.max_new_tokens or train_rep.longest_target + 4
    say(
        f"model {source.name}; precision {precision_name(accelerator)}; device {accelerator.device}; "
        f"eval generates up to {max_new} tokens"
    )

    collate = PadCollator(pad_token_id=tokenizer.pad_token_id)
    # Generation pads on the left (eval/generate.py does it by hand); the saved tokenizer says so too.
    tokenizer.padding_side = "left"
    doctor_report = run_doctor(lambda: check(
        model, tokenizer, [e.features() for e in train_ex], [e.features() for e in val_ex], collate,
        args={"batch_size": cfg.micro_batch_size, "max_length": cfg.max_seq_length, "generation": True}, task="sft"))
    gate(doctor_report, cfg, say, out, doctor_only)
    plan = plan_run(cfg, model, accelerator, features=[e.features() for e in train_ex],
                    lengths=[len(e.input_ids) for e in train_ex], counts=[e.num_supervised for e in train_ex],
                    collate=collate, loss_fn=causal_lm_loss_sum, eval_lengths=[len(e.input_ids) for e in val_ex],
                    generate_lengths=[len(e.prompt_ids) + max_new for e in val_ex], lora=cfg.lora_r > 0, say=say,
                    out=out)
    eval_bs = plan.eval_batch_size
    eos_ids = eos_token_ids(model, tokenizer)
    log = open_metrics_log(cfg, out, accelerator)
    if is_main_process():
        (out / "predictions").mkdir(exist_ok=True)

    def evaluate(m: Any, epoch: int) -> dict[str, Any]:
        metrics, preds, golds = evaluate_examples(m, val_ex, tokenizer, target_field=cfg.target_field,
                                                  eos_token_ids=eos_ids, max_new_tokens=max_new, batch_size=eval_bs,
                                                  accelerator=accelerator, say=say, share_prefixes=cfg.share_prefixes)
        _write_predictions(out / "predictions" / f"epoch_{epoch}.jsonl", val_ex, preds, golds, cfg.input_field)
        say(f"epoch {epoch}/{cfg.epochs}  eval_f1={metrics['eval_f1']:.4f}  eval_em={metrics['eval_em']:.4f}  "
            f"eval_loss={metrics['eval_loss']:.4f}")
        return metrics

    def save_model(m: Any, folder: Path) -> None:
        accelerator.unwrap_model(m).save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    sharing, train_loss = None, causal_lm_loss_sum
    if cfg.share_prefixes:
        reason = why_not_shared(model)
        if reason:
            say(f"shared prompt prefixes: each row computes its own, because {reason}")
        else:
            sharing = PrefixSharing()
            train_loss = functools.partial(causal_lm_loss_sum, share=sharing)

    def on_epoch(record: dict[str, Any]) -> None:
        if sharing is None:
            return
        c = sharing.take()
        rows, saved, tokens, shared, batches = (int(v) for v in sum_over_processes(
            [c["rows"], c["tokens_saved"], c["tokens"], c["shared_batches"], c["batches"]], accelerator.device))
        record.update(shared_prefix_rows=rows, shared_prefix_tokens=saved)
        if shared:
            say(f"epoch {record['epoch']}: {rows} rows reused a prompt prefix computed once for another row of their "
                f"micro-batch ({saved:,} of {tokens:,} tokens not recomputed, {saved / max(tokens, 1):.0%}; "
                f"{shared} of {batches} micro-batches); --share_prefixes false computes every row in full")

    checkpointing = Checkpointing(folder=out / "checkpoints", save_every=cfg.save_every, keep=cfg.keep_checkpoints,
                                  export=save_model, resume_from=resume_from, resume_command=resume_command(cfg))
    settings = LoopSettings(
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        micro_batch_size=plan.micro_batch_size,
        saved_activations=plan.saved_activations,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        warmup_ratio=cfg.warmup_ratio,
        max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed,
        log_every=cfg.log_every,
    )
    try:
        history = fit(
            model,
            [e.features() for e in train_ex],
            [len(e.input_ids) for e in train_ex],
            [e.num_supervised for e in train_ex],
            loss_fn=train_loss,
            collate=collate,
            settings=settings,
            accelerator=accelerator,
            evaluate=evaluate,
            checkpointing=checkpointing,
            log=log,
            say=say,
            on_epoch=on_epoch,
            counters=sharing,
        )
    finally:
        log.close()

    final = save_final(out, lambda d: save_model(model, d))
    kind = "LoRA adapter (load with peft)" if cfg.lora_r else "full model (load with transformers)"
    say(f"saved {kind} and tokenizer to {final}")
    write_run_report(out, accelerator, say)
    return {"output_dir": out, "final_dir": final, "history": history, "data_report": data_report}


def generate_texts(model: Any, prompts: list[list[int]], tokenizer: Any, *, eos_token_ids: list[int],
                   max_new_tokens: int, batch_size: int, accelerator: Any, say=print) -> list[str]:
    """Greedy continuations of tokenized prompts, decoded and stripped (out of memory halves the batch)."""
    generated = shrink_on_oom(
        lambda bs: greedy_generate(
            accelerator.unwrap_model(model),
            prompts,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=eos_token_ids,
            max_new_tokens=max_new_tokens,
            batch_size=bs,
            device=accelerator.device,
            autocast=accelerator.autocast,
        ),
        batch_size,
        "generation",
        say,
    )
    return [tokenizer.decode(g, skip_special_tokens=True).strip() for g in generated]


def evaluate_examples(model: Any, examples: list[Example], tokenizer: Any, *, target_field: str,
                      eos_token_ids: list[int], max_new_tokens: int, batch_size: int, accelerator: Any,
                      say=print, share_prefixes: bool = True) -> tuple[dict[str, float], list[str], list[list[str]]]:
    """Validation loss (per supervised token) and SQuAD F1 / exact match of greedy generations.

    Used after every epoch of training and by ``surefit eval``, so both report the same numbers. With
    ``share_prefixes`` the loss computes prompt prefixes that rows of a batch share once, as training does (the
    same loss; see :mod:`surefit.training.prefixes`).

    Returns:
        ``({"eval_loss", "eval_f1", "eval_em"}, predictions, gold answers per example)``.
    """
    collate = PadCollator(pad_token_id=tokenizer.pad_token_id)
    share = share_prefixes and why_not_shared(model) is None
    loss = evaluate_loss(
        model,
        [e.features() for e in examples],
        [len(e.input_ids) for e in examples],
        loss_fn=functools.partial(causal_lm_loss_sum, share=PrefixSharing()) if share else causal_lm_loss_sum,
        collate=collate,
        batch_size=batch_size,
        accelerator=accelerator,
        say=say,
    )
    preds = generate_texts(model, [e.prompt_ids for e in examples], tokenizer, eos_token_ids=eos_token_ids,
                           max_new_tokens=max_new_tokens, batch_size=batch_size, accelerator=accelerator, say=say)
    golds = [_golds(e.row, target_field) for e in examples]
    scores = squad_scores(preds, golds)
    return {"eval_loss": loss, "eval_f1": scores["f1"], "eval_em": scores["em"]}, preds, golds


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every id that ends an answer: the tokenizer's EOS and those of the model's generation config."""
    return sorted({tokenizer.eos_token_id} | _extra_eos(model))


def _extra_eos(model: Any) -> set[int]:
    """EOS ids from the model's generation config (chat models often end turns with a second token)."""
    gen = getattr(model, "generation_config", None)
    ids = getattr(gen, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, list) else {int(ids)}


def _write_predictions(path: Path, examples: list[Example], preds: list[str], golds: list[list[str]], input_field: str) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for rec in prediction_records(examples, preds, golds, input_field):
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")


def prediction_records(examples: list[Example], preds: list[str], golds: list[list[str]],
                       input_field: str) -> list[dict[str, Any]]:
    """Per example: where it came from, input, gold answers, prediction, F1 and EM (``predictions/epoch_N.jsonl``)."""
    return [
        {
            "where": ex.row.where,
            "input": ex.row.fields[input_field],
            "gold": gold,
            "prediction": pred,
            "f1": max(token_f1(pred, g) for g in gold),
            "em": max(exact_match(pred, g) for g in gold),
        }
        for ex, pred, gold in zip(examples, preds, golds, strict=True)
    ]
