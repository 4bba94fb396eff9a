"""A finished classify run: its labels, ``load``, ``evaluate``, ``predict`` and ``export``, scored as training scored
each epoch."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from surefit.config.task_configs import ClassifyConfig
from surefit.data.classes import Fields, LabelSpec
from surefit.data.collate import PadCollator
from surefit.data.readers import field_not_found, read_checked
from surefit.data.rows import Row
from surefit.data.summary import ClassifyFacts
from surefit.errors import ConfigError, DataError, ModelError, Problem, SurefitError
from surefit.models import model_folder, resolve_model
from surefit.models.lowbit import import_peft
from surefit.run_folder import COLUMNS, untrusted
from surefit.run_folder.open_run import Run
from surefit.tasks.classify.train_classify import (
    HF_PROBLEM_TYPES,
    Scored,
    build_model,
    encode,
    evaluate_features,
    final_files,
    load_data,
    make_collator,
    model_inputs,
    predict_logits,
    say_truncated,
    tokenize,
)
from surefit.tasks.finished_common import Loaded, chunks, rows_from_texts
from surefit.training.memory import shrink_on_oom
from surefit.training.precision import make_accelerator, store_frozen_in
from surefit.training.speedups.lora_fast import fuse_lora

Say = Callable[[str], None]

_HF_TO_OURS = {v: k for k, v in HF_PROBLEM_TYPES.items()}


def label_spec(run: Run, label_field: str | None = None) -> LabelSpec:
    """The run's labels (as training built them), from ``data_report.json`` or the saved model's config."""
    facts = run.summary.facts_as(ClassifyFacts)
    ptype, label2id = facts.problem_type, facts.label2id
    if ptype is None:
        saved = _saved_label_config(run)
        ptype, label2id = saved.get("problem_type"), saved.get("label2id")
    if ptype is None or (ptype != "regression" and label2id is None):
        raise SurefitError(Problem(f"cannot tell the labels of {run.folder}: data_report.json has no problem_type and "
                                   "the saved model has no label mapping", "--run",
                                   "the run folder is incomplete; train the run again"))
    names = [] if ptype == "regression" or label2id is None else [
        n for n, _ in sorted(label2id.items(), key=lambda kv: kv[1])]
    label = label_field or facts.label_field or run.config_as(ClassifyConfig).label_field or "label"
    return LabelSpec(problem_type=ptype, field=label, names=names, kind="str", how=f"the labels of {run.folder}")


def _saved_label_config(run: Run) -> dict[str, Any]:
    if (run.final / "surefit_head.json").is_file():
        spec = json.loads((run.final / "surefit_head.json").read_text(encoding="utf-8"))
        id2label = {int(k): v for k, v in (spec.get("id2label") or {}).items()}
        return {"problem_type": spec.get("problem_type"), "label2id": {v: k for k, v in id2label.items()}}
    if (run.final / "config.json").is_file():
        config = json.loads((run.final / "config.json").read_text(encoding="utf-8"))
        return {"problem_type": _HF_TO_OURS.get(config.get("problem_type")), "label2id": config.get("label2id")}
    return {}


def _base_path(run: Run, say: Say) -> str:
    try:
        return model_folder(resolve_model(run.cfg.model, default="encoder"), log=say)
    except ModelError as e:
        raise run.config_problem(e, ("model",)) from e


def load(run: Run, spec: LabelSpec, say: Say = print, as_trained: bool = True) -> Loaded:
    """The classifier as it was trained: a transformers classifier (full or base + adapter) or backbone + head."""
    from transformers import AutoTokenizer

    run.require(*final_files(run.config_as(ClassifyConfig)))
    cfg = run.config_as(ClassifyConfig)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(run.final), trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelError(Problem(f"cannot load the tokenizer saved in {run.final}: {type(e).__name__}: {e}", "--run",
                                 "the run folder is incomplete; train the run again")) from e
    lora = cfg.lora_r > 0
    if cfg.head:
        path = _base_path(run, say) if lora else str(run.final / "backbone")
    else:
        path = _base_path(run, say) if lora else str(run.final)
    try:
        model = build_model(cfg, path, spec, say=lambda _: None)  # its head is replaced by the trained one below
    except ConfigError as e:
        raise run.config_problem(e, ("head", "head_args")) from e
    max_len, tokenizer_keys, accepted = model_inputs(cfg, model, tokenizer, say=lambda _: None)
    if cfg.head:
        from safetensors.torch import load_file

        if lora:
            PeftModel = import_peft().PeftModel  # noqa: N806

            model.backbone = PeftModel.from_pretrained(model.backbone, str(run.final / "backbone"),
                                                       is_trainable=bool(run.frozen_dtype))
        model.head.load_state_dict(load_file(str(run.final / "head.safetensors")))
    elif lora:
        PeftModel = import_peft().PeftModel  # noqa: N806

        model = PeftModel.from_pretrained(model, str(run.final), is_trainable=bool(run.frozen_dtype))
    if lora and as_trained:
        fuse_lora(model)  # the forward training used (adapters summed in fp32)
        if run.frozen_dtype:
            store_frozen_in(model, {"bf16": torch.bfloat16, "fp16": torch.float16}[run.frozen_dtype])
    accelerator = make_accelerator(run.precision)
    model.to(accelerator.device).eval()
    keys = [k for k in tokenizer_keys if k in accepted]
    return Loaded(model, tokenizer, accelerator, {"max_len": max_len, "keys": keys})


def _run_fields(run: Run, fields: dict[str, str], texts_given: bool = False) -> Fields:
    """The columns the run was trained on (flags override): data_report.json, else the run's columns.json."""
    saved = run.summary.facts_as(ClassifyFacts)
    if saved.text_field is None:
        saved = _fields_from_columns(run.folder / COLUMNS)
    text = fields.get("text_field") or saved.text_field or run.config_as(ClassifyConfig).text_field
    pair = fields.get("text_pair_field") or saved.pair_field or run.config_as(ClassifyConfig).text_pair_field
    label = fields.get("label_field") or saved.label_field or run.config_as(ClassifyConfig).label_field
    if text is None and texts_given:
        text = "text"  # --input texts are not read from a column: any name will do
    if text is None:
        raise SurefitError(Problem(f"cannot tell which field the run {run.folder} read its text from "
                                   "(neither data_report.json nor columns.json says)", "--text_field",
                                   "pass --text_field NAME (and --text_pair_field NAME for pairs)"))
    return Fields(text=text, pair=pair, label=label or "label")


def _fields_from_columns(path: Path) -> ClassifyFacts:
    """Runs trained before data_report.json recorded the fields: the kept / dropped table names them."""
    table = untrusted.read_json(path, "the columns training read")
    roles = {"text:": "text_field", "second text of the pair": "pair_field", "label:": "label_field"}
    found: dict[str, str] = {}
    for entry in table if isinstance(table, list) else []:  # a changed file names nothing, as a missing one
        for prefix, role in roles.items():
            if isinstance(entry, dict) and entry.get("status") == "kept" and isinstance(entry.get("column"), str) \
                    and str(entry.get("why", "")).startswith(prefix):
                found.setdefault(role, entry["column"])
    return ClassifyFacts(text_field=found.get("text_field"), pair_field=found.get("pair_field"),
                         label_field=found.get("label_field"))


def _text_fields(flds: Fields) -> list[tuple[str, str]]:
    return [(flds.text, "--text_field")] + ([(flds.pair, "--text_pair_field")] if flds.pair else [])


def _check_labels(rows: list[Row], spec: LabelSpec, source: str) -> None:
    """Every row's label must be one the run was trained on; one problem lists every bad row."""
    present = sorted({name for row in rows for name in row.fields})
    if spec.field not in present:
        raise DataError(field_not_found(spec.field, "--label_field", present, source))
    bad: list[str] = []
    for row in rows:
        try:
            spec.encode(row.fields.get(spec.field))
        except ValueError:
            loc = row.where[len(source) + 1 :] if row.where.startswith(f"{source} ") else row.where
            bad.append(f"{loc} ({row.fields.get(spec.field)!r})")
    if bad:
        known = "numbers" if spec.problem_type == "regression" else ", ".join(repr(n) for n in spec.names)
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise DataError(Problem(f"{len(bad)} of {len(rows)} rows have a label '{spec.field}' the run was not trained "
                                f"on: {', '.join(bad[:10])}{more}", source,
                                f"the run's labels are {known}; fix or remove these rows"))


def evaluate(run: Run, data: str | None, batch_size: int, max_new_tokens: int | None, fields: dict[str, str],
             say: Say = print) -> tuple[str, int, dict[str, Any], list[dict[str, Any]]]:
    """``surefit eval`` of a classify run: its validation split re-derived as training did (or ``data``).

    Returns:
        ``(what was evaluated, rows, metrics, prediction records)``.
    """
    cfg = run.config_as(ClassifyConfig)
    if data is None:
        run.check_training_data()
        _, rows, flds, spec, _ = load_data(cfg, say=lambda _: None)
        described = run.validation_described()
    else:
        flds = _run_fields(run, fields)
        spec = label_spec(run, flds.label)
        rows = read_checked(data, _text_fields(flds))
        _check_labels(rows, spec, data)
        described = str(data)
    loaded = load(run, spec, say)
    feats, rep = encode(rows, loaded.tokenizer, flds, spec, loaded.extra["max_len"], loaded.extra["keys"], "evaluation")
    say_truncated(rep, loaded.extra["max_len"], say)
    result = evaluate_features(loaded.model, Scored(rows, feats, flds, spec), make_collator(loaded.tokenizer, spec),
                               batch_size, loaded.accelerator, say)
    return described, len(rows), result.metrics, result.records or []


def predict(run: Run, inputs: str | list[str] | None, file: str | None, batch_size: int,
            max_new_tokens: int | None, fields: dict[str, str], say: Say = print) -> Iterator[list[dict[str, Any]]]:
    """The label (``labels`` for multi-label, ``value`` for regression) and probabilities per label, one batch of
    records at a time, in input order."""
    flds = _run_fields(run, fields, texts_given=file is None)
    text_fields = _text_fields(flds)
    rows = read_checked(str(file), text_fields) if file is not None else rows_from_texts(inputs, text_fields)
    spec = label_spec(run, flds.label)
    loaded = load(run, spec, say)
    max_len = loaded.extra["max_len"]
    collate = PadCollator(pad_token_id=loaded.tokenizer.pad_token_id)
    for part in chunks(rows, batch_size):
        feats, rep = tokenize(part, loaded.tokenizer, flds, max_len, loaded.extra["keys"], "predict")
        say_truncated(rep, max_len, say)
        def logits_of(b: int, feats: list[dict[str, Any]] = feats) -> Any:
            return predict_logits(loaded.model, feats, collate, b, loaded.accelerator, spec.problem_type)

        logits, _ = shrink_on_oom(logits_of, batch_size, "prediction", say)
        batch = []
        for row, lg in zip(part, logits, strict=True):
            rec: dict[str, Any] = {"where": row.where, "text": str(row.fields[flds.text])}
            if flds.pair:
                rec["text_pair"] = str(row.fields[flds.pair])
            if spec.problem_type == "single":
                probs = lg.softmax(-1).tolist()
                rec["label"] = spec.names[int(lg.argmax())]
                rec["probabilities"] = {n: round(p, 6) for n, p in zip(spec.names, probs, strict=True)}
            elif spec.problem_type == "multi":
                probs = lg.sigmoid().tolist()
                rec["labels"] = [n for n, p in zip(spec.names, probs, strict=True) if p > 0.5]
                rec["probabilities"] = {n: round(p, 6) for n, p in zip(spec.names, probs, strict=True)}
            else:
                rec["value"] = float(lg.reshape(-1)[0])
            batch.append(rec)
        yield batch


def export(run: Run, folder: Path, merge: bool, say: Say = print) -> str:
    """Write the run's model into ``folder`` (new); with ``merge``, a LoRA adapter folded into the base weights: a
    plain sequence classifier with label2id/id2label in its config, or (with a custom head) backbone/ merged plus
    the head's files. Returns what was written, in words."""
    run.require(*final_files(run.config_as(ClassifyConfig)))
    lora_dir = run.final / "backbone" if run.config_as(ClassifyConfig).head else run.final
    lora = (lora_dir / "adapter_config.json").is_file()
    if not (merge and lora):
        shutil.copytree(run.final, folder)
        if merge:
            say(f"--merge: {run.folder} was trained in full (no LoRA adapter); copied the model as it is")
        return "LoRA adapter (load with peft; its base model is named in adapter_config.json)" if lora else "model"
    folder.mkdir(parents=True)
    loaded = load(run, label_spec(run), say, as_trained=False)
    model = loaded.model
    if run.config_as(ClassifyConfig).head:
        from safetensors.torch import save_file

        model.backbone.merge_and_unload().save_pretrained(folder / "backbone", safe_serialization=True)
        save_file({k: v.contiguous() for k, v in model.head.state_dict().items()}, folder / "head.safetensors")
        shutil.copy2(run.final / "surefit_head.json", folder / "surefit_head.json")
    else:
        model.merge_and_unload().save_pretrained(folder, safe_serialization=True)
    loaded.tokenizer.save_pretrained(folder)
    return "merged model (adapter folded into the base weights)"
