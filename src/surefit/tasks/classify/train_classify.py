"""Sequence classification with a pretrained backbone: data -> labels -> model -> loop -> final/, top to bottom.

Columns the model's forward does not take (``idx``, raw text, ...) never reach it: the batch is built from the
tokenizer's outputs that the forward accepts plus the mapped labels, and a kept / dropped / why table says so once
(the seeds' ``forward() got an unexpected keyword argument 'idx'``). The loss is computed here from the logits, as a
sum over examples normalised by the loop, so a custom head and a transformers classifier train the same way.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import surefit.startup as startup
import surefit.startup.cache as startup_cache
from surefit.config.task_configs import ClassifyConfig
from surefit.data.classes import Fields, LabelSpec, build_label_spec, detect_fields
from surefit.data.collate import PadCollator
from surefit.data.readers import Rejected, check_text_fields, read_splits
from surefit.data.rows import Row
from surefit.data.split import normalize_key, split_or_check
from surefit.data.summary import ClassifyFacts, DataSummary
from surefit.doctor import check
from surefit.errors import (
    ConfigError,
    ModelError,
    Problem,
    raise_with_rejected,
)
from surefit.eval.classification import accuracy, confusion_matrix, macro_f1, per_class_f1
from surefit.models import apply_lora, load_factory, model_folder, resolve_model
from surefit.run_folder import COLUMNS, Found
from surefit.tasks.runner import Evaluation, Prepared, RunResult, render_columns, train
from surefit.training.dropout import seed_dropout
from surefit.training.loss import PROBLEM_LOSS, classification_loss_sum
from surefit.training.memory import enable_gradient_checkpointing, shrink_on_oom
from surefit.training.precision import make_accelerator, precision_name
from surefit.training.speedups.lora_fast import SavedActivationsIn, fuse_lora
from surefit.training.work import PlanInputs, TrainingWork

Say = Callable[[str], None]
HF_PROBLEM_TYPES = {"single": "single_label_classification", "multi": "multi_label_classification",
                    "regression": "regression"}
TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")
# The column flags of a classify run (``surefit eval`` / ``predict`` take them for other data).
FIELDS = ("text_field", "text_pair_field", "label_field")


def final_files(cfg: ClassifyConfig) -> list[tuple[str, ...]]:
    """What ``final/`` holds: backbone + head, or a transformers classifier (full, or its LoRA adapter)."""
    if cfg.head:
        return [("backbone", "head.safetensors", "surefit_head.json")]
    return [("adapter_config.json",), ("config.json",)]


# ------------------------------------------------------------------------------------------------------------ data


def load_data(cfg: ClassifyConfig, say: Say = print, problems: list[Problem] | None = None
              ) -> tuple[list[Row], list[Row], Fields, LabelSpec, DataSummary]:
    """Read, detect columns, type the labels, split. Every problem in every file is reported at once (a problem
    raised carries the rows rejected under ``--on_bad_rows skip``: ``error.rejected``).

    Returns:
        ``(train_rows, val_rows, fields, label_spec, summary)``.
    """
    problems = list(problems or [])
    assert cfg.data is not None  # required: the config's checks say so first
    found: list[Rejected] = []
    report = DataSummary(notes=[], rejected=found)
    notes = report.notes
    assert notes is not None
    sources = [("train", cfg.data)] + ([("validation", cfg.val_data)] if cfg.val_data else [])
    rejects: list[Rejected] | None = found if cfg.on_bad_rows == "skip" else None
    loaded = read_splits(cfg.data, cfg.val_data, cfg.limit, problems, rejects, notes)
    fields: Fields | None = None
    if loaded["train"]:
        fields = detect_fields(loaded["train"], str(cfg.data), problems, text_field=cfg.text_field,
                               text_pair_field=cfg.text_pair_field, label_field=cfg.label_field)
    spec: LabelSpec | None = None
    if fields is not None:
        text_fields = [(fields.text, "--text_field")] + ([(fields.pair, "--text_pair_field")] if fields.pair else [])
        for name, path in sources:
            if loaded[name]:
                loaded[name], more = check_text_fields(loaded[name], text_fields, problems, str(path), rejects=rejects)
                notes += more
            if rejects is not None:
                loaded[name] = _reject_missing_labels(loaded[name], fields.label, rejects)
        spec = build_label_spec([(str(path), loaded[name]) for name, path in sources], fields.label,
                                cfg.problem_type, problems)
    raise_with_rejected(problems, found)
    assert fields is not None and spec is not None
    notes[:0] = fields.notes

    key = lambda r: normalize_key(text_of(r, fields))  # noqa: E731
    train_rows, val, more = split_or_check(loaded["train"], loaded.get("validation"), cfg.val_fraction, cfg.seed,
                                           key, "text")
    notes += more
    if not cfg.val_data:
        # label2id comes from the training rows, as with a validation file: built from --data before the split, it
        # would hold a class the split put wholly in validation, which the model never sees (it is an error instead).
        splits = [(f"{cfg.data} (training split)", train_rows)]
        if val:  # --val_fraction 0: training without validation data
            splits.append((f"{cfg.data} (validation split)", val))
        spec = build_label_spec(splits, fields.label, cfg.problem_type, problems)
        raise_with_rejected(problems, found)
        assert spec is not None
    notes += [spec.how, spec.summary()]
    report.train_rows, report.val_rows = len(train_rows), len(val)
    report.facts = ClassifyFacts(problem_type=spec.problem_type,
                                 label2id=spec.label2id if spec.problem_type != "regression" else None,
                                 text_field=fields.text, pair_field=fields.pair, label_field=fields.label)
    for note in notes:
        say(note)
    return train_rows, val, fields, spec, report


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


def text_of(row: Row, fields: Fields) -> str:
    """The row's text (and second text of a pair), as shown in predictions and compared for leakage."""
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
    # No rows (training without validation data): the fast tokenizers fail on an empty batch.
    full = tokenizer(texts, pairs, truncation=False)["input_ids"] if rows else []
    enc = tokenizer(texts, pairs, truncation=True, max_length=max_len) if rows else {}
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


def say_truncated(rep: dict[str, Any], max_len: int, say: Say, split: bool = False) -> None:
    if rep["truncated"]:
        head = f"{rep['split']}: " if split else ""
        longest = f"longest {rep['longest_tokens']}; " if split else ""
        say(f"{head}{rep['truncated']} of {rep['rows']} texts truncated to {max_len} tokens "
            f"({longest}e.g. {', '.join(rep['truncated_rows'][:3])})")


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


# ------------------------------------------------------------------------------------------------------------ model


class HeadModel(nn.Module):
    """Backbone (any transformers encoder/decoder returning hidden states) + a user head, by composition.

    A head factory is any callable ``Factory(hidden_size=H, num_labels=K, **head_args) -> nn.Module`` whose module's
    ``forward(hidden_states, attention_mask, pooled=None)`` returns logits ``[batch, num_labels]``; nobody subclasses
    anything of ours. ``forward`` takes the tokenizer's outputs and returns an object with ``.logits``, like a
    transformers sequence-classification model, so the loop, evaluation and the doctor treat both the same.
    """

    def __init__(self, backbone: nn.Module, head: nn.Module, problem_type: str = "single"):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.problem_type = problem_type
        self._accepts = set(inspect.signature(backbone.forward).parameters)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> Any:
        """Logits, and with ``labels`` the mean loss over the batch (as a transformers classifier returns it)."""
        from transformers.modeling_outputs import SequenceClassifierOutput

        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and "token_type_ids" in self._accepts:
            kwargs["token_type_ids"] = token_type_ids
        out = self.backbone(**kwargs)
        pooled = getattr(out, "pooler_output", None)
        logits = self.head(out.last_hidden_state, attention_mask, pooled)
        loss = None
        if labels is not None:
            loss = classification_loss_sum(logits, labels, PROBLEM_LOSS[self.problem_type]) / labels.shape[0]
        return SequenceClassifierOutput(loss=loss, logits=logits)


def build_head(spec: str, head_args: dict[str, Any], hidden_size: int, num_labels: int) -> nn.Module:
    """The user's head from ``--head`` (imports the module the user named) and ``--head_args``."""
    factory = load_factory(spec)
    try:
        head = factory(hidden_size=hidden_size, num_labels=num_labels, **head_args)
    except TypeError as e:
        raise ConfigError(
            Problem(
                f"{spec} could not be called as Factory(hidden_size={hidden_size}, num_labels={num_labels}, "
                f"**{head_args}): {e}",
                "--head",
                "a head factory takes hidden_size and num_labels keywords, plus what --head_args gives",
            )
        ) from e
    if not isinstance(head, nn.Module):
        raise ConfigError(Problem(f"{spec} returned {type(head).__name__}, not a torch.nn.Module", "--head"))
    return head


def build_model(cfg: ClassifyConfig, path: str, spec: LabelSpec, say: Say = print) -> Any:
    """A transformers sequence classifier, or backbone + custom head, with the label mapping in its config."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    label_kwargs = {"num_labels": spec.num_labels, "problem_type": HF_PROBLEM_TYPES[spec.problem_type]}
    if spec.problem_type != "regression":
        label_kwargs.update(id2label=spec.id2label, label2id=spec.label2id)
    try:
        if cfg.head:
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


def model_inputs(cfg: ClassifyConfig, model: Any, tokenizer: Any, say: Say = print) -> tuple[int, list[str], set[str]]:
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


def _apply_lora(model: Any, cfg: ClassifyConfig, say: Say) -> Any:
    """Adapters on the backbone; the classification head (a transformers one, or the user's) trains in full."""
    note = "; the classification head trains in full"
    if cfg.head:
        model = apply_lora(model, cfg, None, say, note, part="backbone")
    else:
        model = apply_lora(model, cfg, "SEQ_CLS", say, note)
    if cfg.lora_r:
        fuse_lora(model)  # the same weights and files; adapters summed in fp32 (training/speedups/lora_fast.py)
    return model


def make_loss_fn(problem_type: str):
    kind = PROBLEM_LOSS[problem_type]

    def loss_fn(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs).logits
        return classification_loss_sum(logits, batch["labels"], kind), int(batch["labels"].shape[0])

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
            total += classification_loss_sum(logits, batch["labels"], PROBLEM_LOSS[problem_type]).item()
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
        on = (logits.sigmoid() > 0.5).int()
        truth = torch.tensor([f["labels"] for f in feats]).int()
        tp = (on & truth).sum(0).float()
        fp = (on & (1 - truth)).sum(0).float()
        fn = ((1 - on) & truth).sum(0).float()
        per = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).tolist()
        micro = float(2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()).clamp(min=1))
        names = [[spec.names[j] for j in range(spec.num_labels) if row[j]] for row in on.tolist()]
        return {
            "eval_subset_accuracy": float((on == truth).all(-1).float().mean()),
            "eval_micro_f1": micro,
            "eval_macro_f1": sum(per) / len(per),
            "eval_per_class_f1": {spec.names[i]: per[i] for i in range(spec.num_labels)},
            "labels": spec.names,
        }, names
    estimate = logits.squeeze(-1)
    target = torch.tensor([float(f["labels"]) for f in feats])
    pearson = float(torch.corrcoef(torch.stack([estimate, target]))[0, 1]) if len(target) > 1 else float("nan")
    return {"eval_mse": float(((estimate - target) ** 2).mean()), "eval_pearson": pearson}, estimate.tolist()


HEADLINE = {"single": ("eval_accuracy", "eval_macro_f1"), "multi": ("eval_micro_f1", "eval_macro_f1"),
            "regression": ("eval_mse", "eval_pearson")}


def make_collator(tokenizer: Any, spec: LabelSpec) -> PadCollator:
    return PadCollator(pad_token_id=tokenizer.pad_token_id,
                       stack_keys=("labels",) if spec.problem_type == "multi" else ())


@dataclass
class Scored:
    """Rows to score: the rows, their encoded features, the columns read and the labels."""

    rows: list[Row]
    feats: list[dict[str, Any]]
    fields: Fields
    spec: LabelSpec


def evaluate_features(model: Any, data: Scored, collate: Any, batch_size: int, accelerator: Any,
                      say: Say) -> Evaluation:
    """Loss, the task's metrics and every row's prediction (after each epoch, and by ``surefit eval``)."""
    rows, feats, fields, spec = data.rows, data.feats, data.fields, data.spec
    logits, loss = shrink_on_oom(
        lambda bs: predict_logits(model, feats, collate, bs, accelerator, spec.problem_type),
        batch_size, "evaluation", say)
    metrics, preds = scores(logits, feats, spec)
    records = [{"where": row.where, "text": text_of(row, fields), "gold": row.fields[spec.field], "prediction": pred}
               for row, pred in zip(rows, preds, strict=True)]
    return Evaluation({"eval_loss": loss, **metrics}, records)


# ------------------------------------------------------------------------------------------------------------ prepare


def prepare(cfg: ClassifyConfig, say: Say = print, problems: list[Problem] | None = None) -> Prepared:
    """Everything the loop needs: rows -> typed labels and tokens, the classifier (with LoRA or a custom head), the
    collator, the loss and the per-epoch evaluation. Nothing is written to the run folder."""
    from transformers import AutoTokenizer

    early = list(problems or [])
    try:
        source = resolve_model(cfg.model, default="encoder")
        # a GGUF causal LM can serve as a decoder-only classifier
        path = model_folder(source, log=say) if source.kind == "gguf" else source.path
    except ModelError as e:
        early, source, path = early + e.problems, None, None
    if cfg.head:
        try:
            load_factory(cfg.head)
        except ConfigError as e:
            early += e.problems
    train_rows, val_rows, fields, spec, report = load_data(cfg, say, early)
    assert source is not None and path is not None  # a model problem was raised above, with the data's

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelError(Problem(f"cannot load the tokenizer of {source.name}: {type(e).__name__}: {e}", "--model")) from e
    with startup.phase("model load"):
        model = build_model(cfg, path, spec, say)
    max_len, tokenizer_keys, accepted = model_inputs(cfg, model, tokenizer, say)
    keys = [k for k in tokenizer_keys if k in accepted]
    table = column_table(train_rows + val_rows, fields, spec, tokenizer_keys, accepted, type(model).__name__)
    say("columns:\n" + render_columns(table))

    train_feats, train_rep = encode(train_rows, tokenizer, fields, spec, max_len, keys, "train")
    val_feats, val_rep = encode(val_rows, tokenizer, fields, spec, max_len, keys, "validation")
    for rep in (train_rep, val_rep):
        say_truncated(rep, max_len, say, split=True)
    report.encoding = {"train": train_rep, "validation": val_rep}

    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model.backbone if cfg.head else model, lora=cfg.lora_r > 0)
        say("gradient checkpointing on: activations are recomputed in the backward pass")
    model = _apply_lora(model, cfg, say)
    seed_dropout(model)  # masks fixed by (seed, step, example): an out-of-memory split draws the same ones
    accelerator = make_accelerator(cfg.precision, lora=cfg.lora_r > 0, report_to=cfg.trackers,
                                   project_dir=cfg.output_dir)
    say(f"model {source.name}; precision {precision_name(accelerator)}; device {accelerator.device} (the batch is "
        "cut as the memory plan below says)")

    collate = make_collator(tokenizer, spec)
    first, second = HEADLINE[spec.problem_type]

    def evaluate(m: Any, epoch: int | float, batch_size: int) -> Evaluation:
        result = evaluate_features(m, Scored(val_rows, val_feats, fields, spec), collate, batch_size, accelerator, say)
        metrics = result.metrics
        say(f"epoch {epoch}/{cfg.epochs}  {first}={metrics[first]:.4f}  {second}={metrics[second]:.4f}  "
            f"eval_loss={metrics['eval_loss']:.4f}")
        return result

    loss_fn = make_loss_fn(spec.problem_type)
    work = TrainingWork(features=train_feats, lengths=[len(f["input_ids"]) for f in train_feats],
                        counts=[1] * len(train_feats), collate=collate, loss_fn=loss_fn, evaluate=evaluate,
                        where=lambda i: train_rows[i].where,
                        plan=PlanInputs(eval_lengths=[len(f["input_ids"]) for f in val_feats], lora=cfg.lora_r > 0),
                        activation_store=SavedActivationsIn)
    return Prepared(
        cfg=cfg, model=model, accelerator=accelerator, work=work,
        save=lambda m, folder: save(m, tokenizer, cfg, spec, folder),
        check=lambda: check(model, tokenizer, train_feats, val_feats or None, collate,
                            args={"batch_size": cfg.micro_batch_size}, task="classify"),
        # A custom head is user code, and remote code is the model's: neither has a content identity to key on.
        cache_key=None if cfg.head or cfg.trust_remote_code or not Path(path).exists() else lambda: {
            "model": startup_cache.files_identity(path), "tokenizer": startup_cache.tokenizer_identity(tokenizer),
            "labels": repr(spec), "train": startup_cache.features_digest(train_feats),
            "validation": startup_cache.features_digest(val_feats)},
        found=Found(report, files={COLUMNS: table}),
        saved=f"{'backbone + head' if cfg.head else 'adapter' if cfg.lora_r else 'model'} and tokenizer")


def run(cfg: ClassifyConfig, say: Say = print) -> RunResult:
    """Train a classifier, evaluating before the first epoch and after each; see :func:`surefit.tasks.runner.train`."""
    return train(cfg, prepare, say)


def save(model: Any, tokenizer: Any, cfg: ClassifyConfig, spec: LabelSpec, folder: Path) -> None:
    """``final/``: the classifier (or its LoRA adapter) with label2id in its config, or backbone/ + the head's
    weights and ``surefit_head.json`` (factory, arguments, labels); the tokenizer either way."""
    if cfg.head:
        from safetensors.torch import save_file

        model.backbone.save_pretrained(folder / "backbone", safe_serialization=True)
        save_file({k: v.contiguous() for k, v in model.head.state_dict().items()}, folder / "head.safetensors")
        (folder / "surefit_head.json").write_text(json.dumps({
            "head": cfg.head, "head_args": json.loads(cfg.head_args or "{}"), "num_labels": spec.num_labels,
            "id2label": spec.id2label, "problem_type": spec.problem_type}, indent=2), encoding="utf-8")
    else:
        model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
