"""Sequence classification with a pretrained backbone: setup -> fit -> evaluate -> save, top to bottom.

Columns the model's forward does not take (``idx``, raw text, ...) never reach it: the batch is built from the
tokenizer's outputs that the forward accepts plus the mapped labels, and a kept / dropped / why table says so once
(the seeds' ``forward() got an unexpected keyword argument 'idx'``). The loss is computed here from the logits, as a
sum over examples normalised by the loop, so a custom head and a transformers classifier train the same way.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from surefit.config import ClassifyConfig
from surefit.data.collate import PadCollator
from surefit.data.labels import Fields, LabelSpec, build_label_spec, detect_fields
from surefit.data.rows import Row
from surefit.data.sources import Rejected, check_text_fields, read_splits
from surefit.data.split import normalize_key, split_or_check
from surefit.doctor import check
from surefit.doctor.gate import gate, run_doctor
from surefit.errors import ConfigError, ModelError, Problem, raise_input_problems
from surefit.eval.metrics import accuracy, confusion_matrix, macro_f1, per_class_f1
from surefit.models import resolve_model
from surefit.training.distributed import is_main_process, on_main
from surefit.training.loop import Checkpointing, LoopSettings, fit, make_accelerator
from surefit.training.lora_fast import fuse_lora
from surefit.training.memory import enable_gradient_checkpointing, shrink_on_oom
from surefit.training.plan import plan_run, precision_name
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

HF_PROBLEM_TYPES = {"single": "single_label_classification", "multi": "multi_label_classification",
                    "regression": "regression"}
TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")


# ------------------------------------------------------------------------------------------------------------ data


def load_data(cfg: ClassifyConfig, say=print, problems: list[Problem] | None = None):
    """Read, detect columns, type the labels, split. Every problem in every file is reported at once.

    Returns:
        ``(train_rows, val_rows, fields, label_spec, report)``.
    """
    problems = list(problems or [])
    report: dict[str, Any] = {"notes": []}
    sources = [("train", cfg.data)] + ([("validation", cfg.val_data)] if cfg.val_data else [])
    rejects: list[Rejected] | None = [] if cfg.on_bad_rows == "skip" else None
    loaded = read_splits(cfg.data, cfg.val_data, cfg.limit, problems, rejects, report["notes"])
    fields: Fields | None = None
    if loaded["train"]:
        fields = detect_fields(loaded["train"], str(cfg.data), problems, text_field=cfg.text_field,
                               text_pair_field=cfg.text_pair_field, label_field=cfg.label_field)
    spec: LabelSpec | None = None
    if fields is not None:
        text_fields = [(fields.text, "--text_field")] + ([(fields.pair, "--text_pair_field")] if fields.pair else [])
        for name, path in sources:
            if loaded[name]:
                loaded[name], notes = check_text_fields(loaded[name], text_fields, problems, str(path), rejects=rejects)
                report["notes"] += notes
            if rejects is not None:
                loaded[name] = _reject_missing_labels(loaded[name], fields.label, rejects)
        spec = build_label_spec([(str(path), loaded[name]) for name, path in sources], fields.label,
                                cfg.problem_type, problems)
    write_rejected(cfg, rejects or [], say)
    report["rejected_rows"] = len(rejects or [])
    raise_input_problems(problems)
    assert fields is not None and spec is not None
    report["notes"] = fields.notes + report["notes"]

    key = lambda r: normalize_key(_text_of(r, fields))  # noqa: E731
    train, val, notes = split_or_check(loaded["train"], loaded.get("validation"), cfg.val_fraction, cfg.seed, key,
                                       "text")
    report["notes"] += notes
    report["notes"].append(spec.how)
    report["notes"].append(spec.summary())
    report.update(train_rows=len(train), val_rows=len(val), problem_type=spec.problem_type,
                  label2id=spec.label2id if spec.problem_type != "regression" else None,
                  fields={"text": fields.text, "pair": fields.pair, "label": fields.label})
    for note in report["notes"]:
        say(note)
    return train, val, fields, spec, report


def _reject_missing_labels(rows: list[Row], label: str, rejects: list[Rejected]) -> list[Row]:
    """--on_bad_rows skip: a row without a usable label is dropped and recorded. Mixed label kinds across rows stay
    an error: no single row is at fault there."""
    kept = []
    for r in rows:
        value = r.fields.get(label)
        if value is None or (isinstance(value, float) and value != value) or (isinstance(value, str) and not value.strip()):
            rejects.append(Rejected(r.where, f"no label in '{label}' (got {value!r})", json.dumps(r.fields, default=str)))
        else:
            kept.append(r)
    return kept


def _text_of(row: Row, fields: Fields) -> str:
    text = str(row.fields[fields.text])
    return text + "\n" + str(row.fields[fields.pair]) if fields.pair else text


def encode(rows: list[Row], tokenizer: Any, fields: Fields, spec: LabelSpec, max_len: int, keys: list[str],
           split: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Tokenize (truncating to ``max_len``, counted) and attach encoded labels; keep only ``keys`` of the tokenizer."""
    feats, report = tokenize(rows, tokenizer, fields, max_len, keys, split)
    for f, row in zip(feats, rows, strict=True):
        f["labels"] = spec.encode(row.fields[spec.field])
    return feats, report


def tokenize(rows: list[Row], tokenizer: Any, fields: Fields, max_len: int, keys: list[str],
             split: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The model inputs of :func:`encode` without labels (``surefit predict`` uses it on unlabelled rows)."""
    texts = [str(r.fields[fields.text]) for r in rows]
    pairs = [str(r.fields[fields.pair]) for r in rows] if fields.pair else None
    # Measure untruncated lengths first, so that every truncation is counted rather than silently applied.
    full = tokenizer(texts, pairs, truncation=False)["input_ids"]
    enc = tokenizer(texts, pairs, truncation=True, max_length=max_len)
    truncated = [i for i, ids in enumerate(full) if len(ids) > max_len]
    feats = [{k: list(enc[k][i]) for k in keys if k in enc} for i in range(len(rows))]
    report = {
        "split": split,
        "rows": len(rows),
        "truncated": len(truncated),
        "longest_tokens": max((len(x) for x in full), default=0),
        "truncated_rows": [rows[i].where for i in truncated[:10]],
    }
    return feats, report


def column_table(rows: list[Row], fields: Fields, spec: LabelSpec, tokenizer_keys: list[str], accepted: set[str],
                 model_name: str) -> list[dict[str, str]]:
    """What happens to each data column and each tokenizer output: kept (and as what) or dropped (and why)."""
    columns: list[str] = []
    for r in rows:
        columns += [c for c in r.fields if c not in columns]
    table = []
    for c in columns:
        if c == fields.text:
            table.append({"column": c, "status": "kept", "why": "text: tokenized into the model inputs below"})
        elif c == fields.pair:
            table.append({"column": c, "status": "kept", "why": "second text of the pair: tokenized with the text"})
        elif c == spec.field:
            how = "as float targets" if spec.problem_type == "regression" else "with label2id"
            table.append({"column": c, "status": "kept", "why": f"label: mapped {how} into 'labels' (used by the loss)"})
        else:
            table.append({"column": c, "status": "dropped",
                          "why": f"not the text or the label, and not an argument of {model_name}.forward"})
    for k in tokenizer_keys:
        if k in accepted:
            table.append({"column": k, "status": "kept", "why": "tokenizer output, an argument of the forward"})
        else:
            table.append({"column": k, "status": "dropped", "why": f"tokenizer output that {model_name}.forward does not take"})
    return table


def _render_table(table: list[dict[str, str]]) -> str:
    width = max(len(r["column"]) for r in table)
    lines = [f"  {'column'.ljust(width)}  kept?    why"]
    lines += [f"  {r['column'].ljust(width)}  {r['status'].ljust(7)}  {r['why']}" for r in table]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------ model


def build_model(cfg: ClassifyConfig, path: str, spec: LabelSpec, say=print) -> Any:
    """A transformers sequence classifier, or backbone + custom head, with the label mapping in its config."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    label_kwargs = {"num_labels": spec.num_labels, "problem_type": HF_PROBLEM_TYPES[spec.problem_type]}
    if spec.problem_type != "regression":
        label_kwargs.update(id2label=spec.id2label, label2id=spec.label2id)
    try:
        if cfg.head:
            from surefit.heads import HeadModel, build_head

            backbone = AutoModel.from_pretrained(path, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
            for k, v in label_kwargs.items():
                setattr(backbone.config, k, v)  # the saved backbone config carries the label mapping too
            head = build_head(cfg.head, json.loads(cfg.head_args or "{}"), backbone.config.hidden_size, spec.num_labels)
            n_head = sum(p.numel() for p in head.parameters())
            say(f"custom head {cfg.head}: {n_head:,} parameters on {type(backbone).__name__} hidden states")
            return HeadModel(backbone, head, spec.problem_type)
        base_config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=torch.float32, ignore_mismatched_sizes=True, trust_remote_code=cfg.trust_remote_code,
            **label_kwargs
        )
    except (OSError, ValueError) as e:
        raise ModelError(Problem(f"cannot load a classifier from {path}: {type(e).__name__}: {e}", "--model")) from e
    had_head = any(a.endswith("ForSequenceClassification") for a in (base_config.architectures or []))
    if not had_head or getattr(base_config, "num_labels", None) != spec.num_labels:
        say(f"new classification head initialised: {spec.num_labels} output{'s' if spec.num_labels != 1 else ''}")
    return model


def model_inputs(cfg: ClassifyConfig, model: Any, tokenizer: Any, say=print) -> tuple[int, list[str], set[str]]:
    """Agree on padding, cap the length at the model's positions, and list what the forward takes.

    Call it on the model before LoRA wraps it (a peft wrapper's forward hides the argument names).

    Returns:
        ``(max_len, tokenizer_keys, accepted)``: the longest input in tokens, the tokenizer's outputs, and the names
        the model's forward accepts.
    """
    if tokenizer.pad_token_id is None:
        # Decoder-only backbones often lack a pad token; padding is masked by attention_mask, and the classifier
        # finds the last real token through config.pad_token_id, so both must agree.
        tokenizer.pad_token = tokenizer.eos_token
        say(f"tokenizer has no pad token; using EOS ({tokenizer.eos_token!r}) for padding")
    config = getattr(model, "config", None) or model.backbone.config
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id

    max_len = cfg.max_seq_length
    limit = getattr(config, "max_position_embeddings", None)
    if limit and max_len > limit:
        say(f"--max_seq_length {max_len} exceeds the model's {limit} positions; using {limit}")
        max_len = limit
    accepted = set(inspect.signature(model.forward).parameters)
    tokenizer_keys = [k for k in tokenizer("a").keys()]
    return max_len, tokenizer_keys, accepted


def _apply_lora(model: Any, cfg: ClassifyConfig, say=print) -> Any:
    if cfg.lora_r == 0:
        say(f"full fine-tuning: {sum(p.numel() for p in model.parameters()):,} trainable parameters")
        return model
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = "all-linear" if cfg.lora_targets == "all-linear" else [
        t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    try:
        if cfg.head:  # adapters on the backbone; the user's head trains in full
            model.backbone = get_peft_model(model.backbone, LoraConfig(
                r=cfg.lora_r, lora_alpha=cfg.resolved_lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets))
        else:
            model = get_peft_model(model, LoraConfig(
                r=cfg.lora_r, lora_alpha=cfg.resolved_lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets,
                task_type="SEQ_CLS"))
    except ValueError as e:
        raise ConfigError(Problem(f"cannot apply LoRA: {e}", "--lora_targets", "use 'all-linear' or Linear module names")) from e
    fuse_lora(model)  # same weights and files; adapters summed in fp32, cheaper dropout (training/lora_fast.py)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    say(f"LoRA r={cfg.lora_r} alpha={cfg.resolved_lora_alpha}: {trainable:,} trainable of {total:,} parameters "
        f"({100.0 * trainable / total:.2f}%; the classification head trains in full)")
    return model


def loss_from_logits(logits: torch.Tensor, labels: torch.Tensor, problem_type: str) -> torch.Tensor:
    """Sum over examples (the loop divides by the example count of the whole accumulated batch)."""
    logits = logits.float()  # fp32 loss under mixed precision
    if problem_type == "single":
        return F.cross_entropy(logits, labels.long(), reduction="sum")
    if problem_type == "multi":
        return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(-1).sum()
    return F.mse_loss(logits.squeeze(-1), labels.float(), reduction="sum")


def make_loss_fn(problem_type: str):
    def loss_fn(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits
        return loss_from_logits(logits, batch["labels"], problem_type), int(batch["labels"].shape[0])

    return loss_fn


@torch.no_grad()
def predict_logits(model: Any, feats: list[dict[str, Any]], collate: Any, batch_size: int, accelerator: Any,
                   problem_type: str) -> tuple[torch.Tensor, float]:
    """Logits for every example (in order) and the mean loss per example (0.0 for examples without labels)."""
    was = model.training
    model.eval()
    order = sorted(range(len(feats)), key=lambda i: -len(feats[i]["input_ids"]))
    out: list[torch.Tensor | None] = [None] * len(feats)
    total = 0.0
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = {k: v.to(accelerator.device) for k, v in collate([feats[i] for i in idx]).items()}
        with accelerator.autocast():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        if "labels" in batch:  # unlabelled rows (surefit predict) have logits only
            total += loss_from_logits(logits, batch["labels"], problem_type).item()
        for j, i in enumerate(idx):
            out[i] = logits[j].cpu()
    model.train(was)
    return torch.stack(out), total / max(len(feats), 1)  # type: ignore[arg-type]


def scores(logits: torch.Tensor, feats: list[dict[str, Any]], spec: LabelSpec) -> tuple[dict[str, Any], list[Any]]:
    """Task metrics and the per-example predictions (as label names or values)."""
    if spec.problem_type == "single":
        preds = logits.argmax(-1).tolist()
        gold = [int(f["labels"]) for f in feats]
        k = spec.num_labels
        f1s = per_class_f1(preds, gold, k)
        return {
            "eval_accuracy": accuracy(preds, gold),
            "eval_macro_f1": macro_f1(preds, gold, k),
            "eval_per_class_f1": {spec.names[i]: f1s[i] for i in range(k)},
            "eval_confusion_matrix": confusion_matrix(preds, gold, k),
            "labels": spec.names,
        }, [spec.names[p] for p in preds]
    if spec.problem_type == "multi":
        pred = (logits.sigmoid() > 0.5).int()
        gold = torch.tensor([f["labels"] for f in feats]).int()
        tp = (pred & gold).sum(0).float()
        fp = (pred & (1 - gold)).sum(0).float()
        fn = ((1 - pred) & gold).sum(0).float()
        per = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).tolist()
        micro = float(2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()).clamp(min=1))
        names = [[spec.names[j] for j in range(spec.num_labels) if row[j]] for row in pred.tolist()]
        return {
            "eval_subset_accuracy": float((pred == gold).all(-1).float().mean()),
            "eval_micro_f1": micro,
            "eval_macro_f1": sum(per) / len(per),
            "eval_per_class_f1": {spec.names[i]: per[i] for i in range(spec.num_labels)},
            "labels": spec.names,
        }, names
    pred = logits.squeeze(-1)
    gold = torch.tensor([float(f["labels"]) for f in feats])
    pearson = float(torch.corrcoef(torch.stack([pred, gold]))[0, 1]) if len(gold) > 1 else float("nan")
    return {"eval_mse": float(((pred - gold) ** 2).mean()), "eval_pearson": pearson}, pred.tolist()


HEADLINE = {"single": ("eval_accuracy", "eval_macro_f1"), "multi": ("eval_micro_f1", "eval_macro_f1"),
            "regression": ("eval_mse", "eval_pearson")}


# ------------------------------------------------------------------------------------------------------------ run


def run(cfg: ClassifyConfig, say=print, doctor_only: bool = False) -> dict[str, Any]:
    """Train a classifier, evaluating before the first epoch and after each; save under ``cfg.output_dir``."""
    from accelerate.utils import set_seed
    from transformers import AutoTokenizer

    say = on_main(say)  # several processes: the main one reports and writes files, the others wait where needed
    quiet_libraries()
    out = Path(cfg.output_dir)
    set_seed(cfg.seed)

    early: list[Problem] = []
    try:
        source = resolve_model(cfg.model, default="encoder")
        if source.kind == "gguf":
            from surefit.models import model_folder

            path = model_folder(source, log=say)  # a GGUF causal LM can serve as a decoder-only classifier
        else:
            path = source.path
    except ModelError as e:
        early, source, path = e.problems, None, None
    if cfg.head:
        try:
            from surefit.heads import load_factory

            load_factory(cfg.head)
        except ConfigError as e:
            early += e.problems
    previous = check_output_dir(cfg, early)
    resume_from = resume_point(cfg, early, say)
    train_rows, val_rows, fields, spec, report = load_data(cfg, say, early)
    out = start_output_dir(cfg, previous, say, report)

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelError(Problem(f"cannot load the tokenizer of {source.name}: {type(e).__name__}: {e}", "--model")) from e
    model = build_model(cfg, path, spec, say)
    max_len, tokenizer_keys, accepted = model_inputs(cfg, model, tokenizer, say)
    keys = [k for k in tokenizer_keys if k in accepted]
    table = column_table(train_rows + val_rows, fields, spec, tokenizer_keys, accepted, type(model).__name__)
    say("columns:\n" + _render_table(table))
    if is_main_process():
        (out / "columns.json").write_text(json.dumps(table, indent=2), encoding="utf-8")

    train_feats, train_rep = encode(train_rows, tokenizer, fields, spec, max_len, keys, "train")
    val_feats, val_rep = encode(val_rows, tokenizer, fields, spec, max_len, keys, "validation")
    for rep in (train_rep, val_rep):
        if rep["truncated"]:
            say(f"{rep['split']}: {rep['truncated']} of {rep['rows']} texts truncated to {max_len} tokens "
                f"(longest {rep['longest_tokens']}; e.g. {', '.join(rep['truncated_rows'][:3])})")
    report["encoding"] = {"train": train_rep, "validation": val_rep}
    if is_main_process():
        (out / "data_report.json").write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")

    if cfg.gradient_checkpointing:
        target = model.backbone if cfg.head else model
        enable_gradient_checkpointing(target, lora=cfg.lora_r > 0)
        say("gradient checkpointing on: activations are recomputed in the backward pass")
    model = _apply_lora(model, cfg, say)
    accelerator = make_accelerator(cfg.precision, lora=cfg.lora_r > 0, report_to=cfg.trackers, project_dir=out)
    say(f"model {source.name}; precision {precision_name(accelerator)}; device {accelerator.device} (the batch is "
        "cut as the memory plan below says)")

    collate = PadCollator(pad_token_id=tokenizer.pad_token_id,
                          stack_keys=("labels",) if spec.problem_type == "multi" else ())
    doctor_report = run_doctor(lambda: check(model, tokenizer, train_feats, val_feats, collate,
                                             args={"batch_size": cfg.micro_batch_size}, task="classify"))
    gate(doctor_report, cfg, say, out, doctor_only)
    plan = plan_run(cfg, model, accelerator, features=train_feats, lengths=[len(f["input_ids"]) for f in train_feats],
                    counts=[1] * len(train_feats), collate=collate, loss_fn=make_loss_fn(spec.problem_type),
                    eval_lengths=[len(f["input_ids"]) for f in val_feats], lora=cfg.lora_r > 0, say=say, out=out)
    log = open_metrics_log(cfg, out, accelerator)
    if is_main_process():
        (out / "predictions").mkdir(exist_ok=True)
    first, second = HEADLINE[spec.problem_type]

    def evaluate(m: Any, epoch: int) -> dict[str, Any]:
        logits, loss = shrink_on_oom(
            lambda bs: predict_logits(m, val_feats, collate, bs, accelerator, spec.problem_type),
            plan.eval_batch_size, "evaluation", say)
        metrics, preds = scores(logits, val_feats, spec)
        with (out / "predictions" / f"epoch_{epoch}.jsonl").open("w", encoding="utf-8") as fh:
            for row, pred in zip(val_rows, preds, strict=True):
                fh.write(json.dumps({"where": row.where, "text": _text_of(row, fields),
                                     "gold": row.fields[spec.field], "prediction": pred}, ensure_ascii=False) + "\n")
        say(f"epoch {epoch}/{cfg.epochs}  {first}={metrics[first]:.4f}  {second}={metrics[second]:.4f}  "
            f"eval_loss={loss:.4f}")
        return {"eval_loss": loss, **metrics}

    def save_model(m: Any, folder: Path) -> None:
        m = accelerator.unwrap_model(m)
        if cfg.head:
            from safetensors.torch import save_file

            m.backbone.save_pretrained(folder / "backbone", safe_serialization=True)
            save_file({k: v.contiguous() for k, v in m.head.state_dict().items()}, folder / "head.safetensors")
            (folder / "surefit_head.json").write_text(json.dumps({
                "head": cfg.head, "head_args": json.loads(cfg.head_args or "{}"), "num_labels": spec.num_labels,
                "id2label": spec.id2label, "problem_type": spec.problem_type}, indent=2), encoding="utf-8")
        else:
            m.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    checkpointing = Checkpointing(folder=out / "checkpoints", save_every=cfg.save_every, keep=cfg.keep_checkpoints,
                                  export=save_model, resume_from=resume_from, resume_command=resume_command(cfg))

    settings = LoopSettings(epochs=cfg.epochs, batch_size=cfg.batch_size, micro_batch_size=plan.micro_batch_size,
                            lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_ratio=cfg.warmup_ratio,
                            max_grad_norm=cfg.max_grad_norm, seed=cfg.seed, log_every=cfg.log_every,
                            saved_activations=plan.saved_activations)
    try:
        history = fit(model, train_feats, [len(f["input_ids"]) for f in train_feats], [1] * len(train_feats),
                      loss_fn=make_loss_fn(spec.problem_type), collate=collate, settings=settings,
                      accelerator=accelerator, evaluate=evaluate, checkpointing=checkpointing, log=log, say=say)
    finally:
        log.close()
    final = save_final(out, lambda d: save_model(model, d))
    say(f"saved {'backbone + head' if cfg.head else 'adapter' if cfg.lora_r else 'model'} and tokenizer to {final}")
    write_run_report(out, accelerator, say)
    return {"output_dir": out, "final_dir": final, "history": history, "data_report": report}
