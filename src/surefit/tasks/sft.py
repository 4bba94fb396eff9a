"""Instruction tuning of a causal LM on input -> target rows: data -> encoding -> model -> loop -> final/, top to bottom.

The correctness-critical pieces live in library code shared by every task: encoding builds the labels once
(``data/encode.py``), the collator only pads (``data/collate.py``), the loop normalises the loss by supervised tokens
(``training/loop.py``), checkpoints are atomic (``training/checkpoint.py``). This file wires them together, reports in
counts everything that happened to the data, and reads back the ``final/`` it writes (``load``, ``evaluate``,
``predict``, ``export``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from surefit.config import SFTConfig
from surefit.data.augment import augment_rows
from surefit.data.collate import PadCollator
from surefit.data.encode import Example, build_prompt_format, encode_prompts, encode_rows
from surefit.data.readers import Rejected, check_text_fields, read_checked, read_splits
from surefit.data.rows import Row
from surefit.data.split import leaked, normalize_key, split_or_check
from surefit.doctor import check
from surefit.errors import ConfigError, DataError, ModelError, Problem, raise_if, raise_input_problems
from surefit.eval.generate import greedy_generate
from surefit.eval.metrics import exact_match, squad_scores, token_f1
from surefit.models import ModelSource, apply_lora, load_causal_lm, load_tokenizer, model_folder, resolve_model
from surefit.run_folder import EXCLUDED, Run
from surefit.tasks.common import Evaluation, Loaded, Prepared, chunks, rows_from_texts, train
from surefit.training.distributed import sum_over_processes
from surefit.training.loop import evaluate_loss
from surefit.training.loss import causal_lm_loss_sum
from surefit.training.memory import enable_gradient_checkpointing, shrink_on_oom
from surefit.training.precision import make_accelerator, precision_name, store_frozen_in
from surefit.training.speedups.lora_fast import fuse_lora
from surefit.training.speedups.prefixes import PrefixSharing, why_not_shared

Say = Callable[[str], None]
# The column flags of an sft run (``surefit eval`` / ``predict`` take them for other data).
FIELDS = ("input_field", "target_field")
# What ``final/`` holds: a LoRA adapter, or a full model.
FINAL_FILES = [("adapter_config.json",), ("config.json",)]


def final_files(cfg: SFTConfig) -> list[tuple[str, ...]]:
    """The alternatives of what ``final/`` holds (any one of them)."""
    return FINAL_FILES


# ------------------------------------------------------------------------------------------------------------ data


def load_data(cfg: SFTConfig, say: Say = print, problems: list[Problem] | None = None,
              on_rejected: Callable[[list[Rejected]], None] | None = None) -> tuple[list[Row], list[Row], dict[str, Any]]:
    """Read, check, split (before augmentation) and augment. Every problem in every file is reported at once.

    Args:
        problems: problems already found (e.g. with ``--output_dir``), reported together with the data's.
        on_rejected: given the rows dropped under ``--on_bad_rows skip`` before any problem is raised (so that an
            "all rows rejected" problem can point at the file they were written to).

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
    if rejects and on_rejected is not None:
        on_rejected(rejects)
    report["rejected_rows"] = len(rejects or [])
    raise_input_problems(problems)

    key = lambda r: normalize_key(str(r.fields[cfg.input_field]))  # noqa: E731
    train_rows, val, notes = split_or_check(loaded["train"], loaded.get("validation"), cfg.val_fraction, cfg.seed,
                                            key, "input")
    report["notes"] += notes
    # Augment AFTER the split and only the training side: a variant of a validation row in training is a leak.
    train_rows, stats = augment_rows(train_rows, cfg.augmentation_factor, cfg.seed, cfg.input_field)
    report["notes"].append(stats.summary())
    if not cfg.val_data:
        assert not leaked(train_rows, val, key), "split/augment invariant broken: a validation row leaked into training"
    report.update(train_rows=len(train_rows), val_rows=len(val), augmentation=stats.__dict__)
    for note in report["notes"]:
        say(note)
    return train_rows, val, report


def _golds(row: Row, target_field: str) -> list[str]:
    answers = row.fields.get("answers")
    if isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers):
        return answers
    return [str(row.fields[target_field])]


def _encode_settings(cfg: SFTConfig, input_field: str | None = None, target_field: str | None = None) -> dict:
    return dict(max_seq_length=cfg.max_seq_length, input_field=input_field or cfg.input_field,
                target_field=target_field or cfg.target_field, truncation_side=cfg.truncation_side)


# ------------------------------------------------------------------------------------------------------------ prepare


def prepare(cfg: SFTConfig, say: Say = print, problems: list[Problem] | None = None,
            on_rejected: Callable[[list[Rejected]], None] | None = None) -> Prepared:
    """Everything the loop needs: rows -> encoded examples, the model with LoRA, the collator, the loss and the
    per-epoch evaluation. Nothing is written to the run folder.

    Data comes before the model: a data problem should cost seconds, not a model load. Resolving ``--model`` is
    cheap, so its problems join the data's (and ``problems``, e.g. the run folder's) in one report.
    """
    early = list(problems or [])
    try:
        source = resolve_model(cfg.model)
    except ModelError as e:
        early += e.problems
    train_rows, val_rows, data_report = load_data(cfg, say, early, on_rejected)
    path = model_folder(source, log=say)
    tokenizer, notes = load_tokenizer(path, source, cfg.trust_remote_code)
    for note in notes:
        say(note)
    fmt = build_prompt_format(tokenizer, cfg.template, cfg.chat_template)
    enc = _encode_settings(cfg)
    train_ex, train_rep = encode_rows(train_rows, tokenizer, fmt, split="train", **enc)
    val_ex, val_rep = encode_rows(val_rows, tokenizer, fmt, split="validation", **enc)
    excluded = [{"split": r.split, "where": w, "reason": why} for r in (train_rep, val_rep) for w, why in r.excluded]
    for rep in (train_rep, val_rep):
        say(rep.summary())
        for where, why in rep.excluded[:10]:
            say(f"  excluded {where}: {why}")
        if len(rep.excluded) > 10:
            say(f"  ... and {len(rep.excluded) - 10} more (all listed in {Path(cfg.output_dir) / EXCLUDED})")
    raise_if([Problem(f"no {r.split} rows left after encoding: all {r.rows} targets are longer than "
                      "--max_seq_length allows", "--max_seq_length",
                      f"raise --max_seq_length (now {cfg.max_seq_length}) or shorten the targets")
              for r in (train_rep, val_rep) if r.encoded == 0 and r.rows > 0], DataError)
    data_report["encoding"] = {
        r.split: {k: v for k, v in r.__dict__.items() if k != "excluded"} | {"excluded": len(r.excluded)}
        for r in (train_rep, val_rep)
    }

    model = load_causal_lm(path, source, cfg.trust_remote_code)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, lora=cfg.lora_r > 0)
        say("gradient checkpointing on: activations are recomputed in the backward pass")
    model = apply_lora(model, cfg, "CAUSAL_LM", say)
    if cfg.lora_r:
        fuse_lora(model)  # the same weights and files; adapters summed in fp32 (training/speedups/lora_fast.py)
    accelerator = make_accelerator(cfg.precision, lora=cfg.lora_r > 0, report_to=cfg.trackers,
                                   project_dir=cfg.output_dir)
    max_new = cfg.max_new_tokens or train_rep.longest_target + 4
    say(f"model {source.name}; precision {precision_name(accelerator)}; device {accelerator.device}; "
        f"eval generates up to {max_new} tokens")

    collate = PadCollator(pad_token_id=tokenizer.pad_token_id)
    # Generation pads on the left (eval/generate.py does it by hand); the saved tokenizer says so too.
    tokenizer.padding_side = "left"
    features = [e.features() for e in train_ex]
    eos_ids = eos_token_ids(model, tokenizer)

    def evaluate(m: Any, epoch: int, batch_size: int) -> Evaluation:
        metrics, preds, golds = evaluate_examples(m, val_ex, tokenizer, target_field=cfg.target_field,
                                                  eos_token_ids=eos_ids, max_new_tokens=max_new, batch_size=batch_size,
                                                  accelerator=accelerator, say=say, share_prefixes=cfg.share_prefixes)
        say(f"epoch {epoch}/{cfg.epochs}  eval_f1={metrics['eval_f1']:.4f}  eval_em={metrics['eval_em']:.4f}  "
            f"eval_loss={metrics['eval_loss']:.4f}")
        return Evaluation(metrics, prediction_records(val_ex, preds, golds, cfg.input_field))

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

    doctor_args = {"batch_size": cfg.micro_batch_size, "max_length": cfg.max_seq_length, "generation": True}
    return Prepared(
        cfg=cfg, model=model, accelerator=accelerator, features=features,
        lengths=[len(e.input_ids) for e in train_ex], counts=[e.num_supervised for e in train_ex], collate=collate,
        loss_fn=train_loss, evaluate=evaluate, save=lambda m, folder: save(m, tokenizer, folder),
        check=lambda: check(model, tokenizer, features, [e.features() for e in val_ex] or None, collate, args=doctor_args,
                            task="sft"),
        data_report=data_report, jsonl={EXCLUDED: excluded},
        plan={"eval_lengths": [len(e.input_ids) for e in val_ex],
              "generate_lengths": [len(e.prompt_ids) + max_new for e in val_ex], "lora": cfg.lora_r > 0,
              # the planner measures with the plain loss: a shared layout is never larger
              "loss_fn": causal_lm_loss_sum},
        saved=f"{'LoRA adapter (load with peft)' if cfg.lora_r else 'full model (load with transformers)'} and tokenizer",
        on_epoch=on_epoch, counters=sharing, rejected=data_report["rejected_rows"])


def run(cfg: SFTConfig, say: Say = print) -> dict[str, Any]:
    """Train, evaluating before the first epoch and after each one; see :func:`surefit.tasks.common.train`."""
    return train(cfg, prepare, say)


def save(model: Any, tokenizer: Any, folder: Path) -> None:
    """``final/``: the LoRA adapter (or the full model) in safetensors, and the tokenizer."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


# ------------------------------------------------------------------------------------------------------------ evaluation


def generate_texts(model: Any, prompts: list[list[int]], tokenizer: Any, *, eos_token_ids: list[int],
                   max_new_tokens: int, batch_size: int, accelerator: Any, say: Say = print) -> list[str]:
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
                      say: Say = print, share_prefixes: bool = True) -> tuple[dict[str, float], list[str], list[list[str]]]:
    """Validation loss (per supervised token) and SQuAD F1 / exact match of greedy generations.

    Used after every epoch of training and by ``surefit eval``, so both report the same numbers. With
    ``share_prefixes`` the loss computes prompt prefixes that rows of a batch share once, as training does (the
    same loss; see :mod:`surefit.training.speedups.prefixes`).

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


# ------------------------------------------------------------------------------------------------------------ a finished run


def _base_model(run: Run, say: Say) -> tuple[str, ModelSource]:
    """The base model the run was trained from (a LoRA adapter is applied to it), resolved as training did."""
    try:
        source = resolve_model(run.cfg.model)
        return model_folder(source, log=say), source
    except ModelError as e:
        raise run.config_problem(e, ("model",)) from e


def load(run: Run, say: Say = print, as_trained: bool = True) -> Loaded:
    """The causal LM (base + LoRA adapter, or the full model), its tokenizer and the run's prompt format.

    ``as_trained``: frozen weights in the dtype training computed with (``False``: fp32, e.g. to merge for export).
    """
    import torch

    run.require(*FINAL_FILES)
    cfg = run.cfg
    final_source = ModelSource("folder", str(run.final), str(run.final))
    tokenizer, _ = load_tokenizer(str(run.final), final_source, cfg.trust_remote_code)
    if (run.final / "adapter_config.json").is_file():
        from peft import PeftModel

        path, source = _base_model(run, say)
        # Adapters marked trainable as in training: what stays frozen is what training may have stored in 16 bits.
        model = PeftModel.from_pretrained(load_causal_lm(path, source, cfg.trust_remote_code), str(run.final),
                                          is_trainable=bool(run.frozen_dtype))
        if as_trained:
            fuse_lora(model)  # the forward training used (adapters summed in fp32)
            if run.frozen_dtype:
                store_frozen_in(model, {"bf16": torch.bfloat16, "fp16": torch.float16}[run.frozen_dtype])
    else:
        model = load_causal_lm(str(run.final), final_source, cfg.trust_remote_code)
    accelerator = make_accelerator(run.precision)
    model.to(accelerator.device).eval()
    fmt = build_prompt_format(tokenizer, cfg.template, cfg.chat_template)
    return Loaded(model, tokenizer, accelerator, {"fmt": fmt, "eos": eos_token_ids(model, tokenizer)})


def _quiet(_: str) -> None:
    pass


def evaluate(run: Run, data: str | None, batch_size: int, max_new_tokens: int | None, fields: dict[str, str],
             say: Say = print) -> tuple[str, int, dict[str, Any], list[dict[str, Any]]]:
    """``surefit eval`` of an sft run: its validation split re-derived as training did (or ``data``), scored by
    :func:`evaluate_examples` as each epoch was.

    Returns:
        ``(what was evaluated, rows, metrics, prediction records)``.
    """
    cfg = run.cfg
    input_field = fields.get("input_field") or cfg.input_field
    target_field = fields.get("target_field") or cfg.target_field
    train_rows = None
    if data is None:
        run.check_training_data()
        train_rows, rows, _ = load_data(cfg, say=_quiet)
        described = run.validation_described()
    else:
        rows = read_checked(data, [(input_field, "--input_field"), (target_field, "--target_field")])
        described = str(data)
    loaded = load(run, say)
    enc = _encode_settings(cfg, input_field, target_field)
    examples, rep = encode_rows(rows, loaded.tokenizer, loaded.extra["fmt"], split="evaluation", **enc)
    for where, why in rep.excluded[:10]:
        say(f"excluded {where}: {why}")
    if not examples:
        raise DataError(Problem(f"no rows of {described} fit: all {rep.rows} targets are longer than "
                                f"max_seq_length {cfg.max_seq_length} allows", run.where("max_seq_length"),
                                "evaluate on rows with shorter targets"))
    max_new = _max_new_tokens(run, max_new_tokens, loaded, train_rows, enc)
    metrics, preds, golds = evaluate_examples(loaded.model, examples, loaded.tokenizer, target_field=target_field,
                                              eos_token_ids=loaded.extra["eos"], max_new_tokens=max_new,
                                              batch_size=batch_size, accelerator=loaded.accelerator, say=say)
    records = prediction_records(examples, preds, golds, input_field)
    if rep.excluded:
        metrics["excluded_rows"] = len(rep.excluded)
    return described, len(examples), metrics, records


def _max_new_tokens(run: Run, given: int | None, loaded: Loaded, train_rows: list | None, enc: dict) -> int:
    """Generation length as training chose it: --max_new_tokens, else the longest training target + 4."""
    if given:
        return given
    if run.cfg.max_new_tokens:
        return run.cfg.max_new_tokens
    longest = ((run.report.get("encoding") or {}).get("train") or {}).get("longest_target")
    if not longest and train_rows is not None:
        longest = encode_rows(train_rows, loaded.tokenizer, loaded.extra["fmt"], split="train", **enc)[1].longest_target
    if not longest:
        raise ConfigError(Problem(f"cannot tell how many tokens to generate: {run.folder / 'data_report.json'} does not "
                                  "give the longest training target", "--max_new_tokens", "pass --max_new_tokens N"))
    return longest + 4


def predict(run: Run, inputs: str | list[str] | None, file: str | None, batch_size: int,
            max_new_tokens: int | None, fields: dict[str, str], say: Say = print) -> Iterator[list[dict[str, Any]]]:
    """Generated responses in the run's prompt format, one batch of records at a time, in input order."""
    input_field = fields.get("input_field") or run.cfg.input_field
    text_fields = [(input_field, "--input_field")]
    rows = read_checked(str(file), text_fields) if file is not None else rows_from_texts(inputs, text_fields)
    cfg = run.cfg
    loaded = load(run, say)
    max_new = _max_new_tokens(run, max_new_tokens, loaded, None, _encode_settings(cfg))
    # Like training, prompt + answer fit in max_seq_length: the input is cut (and counted) so that they do.
    room = max(cfg.max_seq_length - max_new, 1)
    for part in chunks(rows, batch_size):
        texts = [str(r.fields[input_field]) for r in part]
        prompts, cut = encode_prompts(texts, loaded.tokenizer, loaded.extra["fmt"], max_prompt_length=room,
                                      truncation_side=cfg.truncation_side)
        preds = generate_texts(loaded.model, prompts, loaded.tokenizer, eos_token_ids=loaded.extra["eos"],
                               max_new_tokens=max_new, batch_size=batch_size, accelerator=loaded.accelerator, say=say)
        batch = []
        for row, text, pred, n_cut in zip(part, texts, preds, cut, strict=True):
            rec = {"where": row.where, "input": text, "prediction": pred}
            if n_cut:
                rec["input_tokens_cut"] = n_cut
                say(f"{row.where}: {n_cut} input tokens cut from the {cfg.truncation_side} so that prompt + answer "
                    f"fit max_seq_length {cfg.max_seq_length}")
            batch.append(rec)
        yield batch


def export(run: Run, folder: Path, merge: bool, say: Say = print) -> str:
    """Write the run's model into ``folder`` (new); with ``merge``, a LoRA adapter folded into the base weights: a
    plain causal LM that ``AutoModelForCausalLM`` loads without peft. Returns what was written, in words."""
    import shutil

    run.require(*FINAL_FILES)
    lora = (run.final / "adapter_config.json").is_file()
    if merge and lora:
        folder.mkdir(parents=True)
        loaded = load(run, say, as_trained=False)
        loaded.model.merge_and_unload().save_pretrained(folder, safe_serialization=True)
        loaded.tokenizer.save_pretrained(folder)
        return "merged model (adapter folded into the base weights)"
    shutil.copytree(run.final, folder)
    if merge:
        say(f"--merge: {run.folder} was trained in full (no LoRA adapter); copied the model as it is")
    return "LoRA adapter (load with peft; its base model is named in adapter_config.json)" if lora else "model"
