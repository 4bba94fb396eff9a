"""Sequence classification with a pretrained backbone: data -> labels -> model -> loop -> final/, top to bottom.

Columns the model's forward does not take (``idx``, raw text, ...) never reach it: the batch is built from the
tokenizer's outputs that the forward accepts plus the mapped labels, and a kept / dropped / why table says so once
(the seeds' ``forward() got an unexpected keyword argument 'idx'``). The loss is computed here from the logits, as a
sum over examples normalised by the loop, so a custom head and a transformers classifier train the same way.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import surefit.startup as startup
import surefit.startup.cache as startup_cache
from surefit.config.task_configs import ClassifyConfig
from surefit.data import encoded_store
from surefit.data.classes import Fields, LabelSpec, build_label_spec, detect_fields
from surefit.data.collate import PadCollator
from surefit.data.encoded_store import EncodedStore, StoreUse, StoreWriter, chunked
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
from surefit.eval.progress import phase
from surefit.models import apply_lora, load_factory, model_folder, resolve_model
from surefit.run_folder import COLUMNS, Found
from surefit.tasks.baseline_eval import BaselineReuse, rows_digest
from surefit.tasks.classify.classify_store import (
    Record,
    StoredExamples,
    arrays_of,
    merge_truncation,
    say_store,
    store_key,
)
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


def data_columns(rows: list[Row]) -> list[str]:
    """The columns of the rows, in order of first appearance."""
    return list(dict.fromkeys(c for r in rows for c in r.fields))


def column_table(columns: list[str], fields: Fields, spec: LabelSpec, tokenizer_keys: list[str], accepted: set[str],
                 model_name: str) -> list[dict[str, str]]:
    """What happens to each data column (:func:`data_columns`) and each tokenizer output: kept (and as what) or
    dropped (and why)."""
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

    label_kwargs: dict[str, Any] = {"num_labels": spec.num_labels, "problem_type": HF_PROBLEM_TYPES[spec.problem_type]}
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


# ------------------------------------------------------------------------------------------------------------ encoded data


@dataclass
class ReadData:
    """The run's data as read, or as the encoded-data cache holds it (a hit), before encoding.

    Attributes:
        summary, fields, spec: what reading found: the report, the columns read, the labels.
        columns: the data's columns in order of appearance (the kept / dropped table).
        train_rows: the training rows to encode; ``None`` on a hit (the store holds their examples).
        val_rows: the validation rows (evaluation shows their text and gold label).
        tokenizer: the model's tokenizer.
        use: what the cache did or will do; store: the store a hit opened; target: ``(folder, key)`` a miss writes
            to; lines: what reading printed (saved in the store, for a hit to print).
    """

    summary: DataSummary
    fields: Fields
    spec: LabelSpec
    columns: list[str]
    train_rows: list[Row] | None
    val_rows: list[Row]
    tokenizer: Any
    use: StoreUse
    store: EncodedStore | None = None
    target: tuple[Path, Any] | None = None
    lines: list[str] = field(default_factory=list)


@dataclass
class EncodedClassify:
    """A run's encoded examples: the training ones in memory (``--no_cache``) or read from the store by position.

    Attributes:
        features, lengths, counts: the training examples as the collator takes them, their lengths, 1 each.
        where: a training example's index -> its source row in words.
        val_feats: the validation examples (in memory: every evaluation scores them all).
        identity: what identifies the training examples in the start-up cache's key (the store's checksums), or
            ``None`` (hash the examples).
    """

    features: Sequence[dict[str, Any]]
    lengths: Sequence[int]
    counts: Sequence[int]
    where: Callable[[int], str]
    val_feats: list[dict[str, Any]]
    identity: str | None = None

    def doctor_sample(self) -> Sequence[dict[str, Any]]:
        """What the doctor scans: every example in memory; from a store the rows its scans read (the first
        ``SCAN_ROWS``) and the longest, so that a large file is checked without holding it."""
        if isinstance(self.features, list):
            return self.features
        from surefit.doctor.checks_data import SCAN_ROWS

        head = list(self.features[:SCAN_ROWS])
        longest = max(range(len(self.lengths)), key=self.lengths.__getitem__) if self.lengths else None
        if longest is not None and longest >= SCAN_ROWS:
            head.append(self.features[longest])
        return head


def load_tokenizer(cfg: ClassifyConfig, name: str, path: str) -> Any:
    """The model's tokenizer (``name``: the model as the user gave it, for messages)."""
    from transformers import AutoTokenizer

    with startup.phase("tokenizer"):
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        except Exception as e:  # noqa: BLE001
            raise ModelError(Problem(f"cannot load the tokenizer of {name}: {type(e).__name__}: {e}", "--model")) from e


def read_data(cfg: ClassifyConfig, model: tuple[str, str] | None, say: Say, early: list[Problem]) -> ReadData:
    """The run's rows, labels and split, or what the encoded-data cache holds for an identical run (the data files'
    content, the tokenizer, the model's config, every reading and encoding setting and the code unchanged: a hit
    prints what reading printed, and nothing is read or encoded). ``model``: ``(name, folder)``, ``None`` when it
    could not be resolved (its problem is in ``early``, reported with the data's).

    The data files are hashed first; the tokenizer is loaded before the rows are read only when a store for these
    files exists, so a data problem in new data still costs seconds.
    """
    use, data_key = encoded_store.store_use(cfg.no_cache, cfg.trust_remote_code, [cfg.data, cfg.val_data])
    tokenizer, key = None, None
    if model is not None and data_key is not None and encoded_store.has_any(data_key):
        tokenizer = load_tokenizer(cfg, *model)
        key = store_key(cfg, data_key, model[1], tokenizer)
        if key is not None:
            store, use = encoded_store.lookup(data_key, key, say)
            if store is not None:
                raise_with_rejected(early, [])  # the run folder's problems, found before the data
                rec = Record.from_json(store.record, str(store.folder / encoded_store.HEADER))
                for line in rec.lines:
                    say(line)
                return ReadData(rec.data_summary(str(store.folder / encoded_store.HEADER)), rec.fields_read(),
                                rec.label_spec(), rec.columns, None, encoded_store.rows_of(rec.validation_rows),
                                tokenizer, use, store=store)
    record = encoded_store.Recorder(say)
    with startup.phase("reading data"), phase("reading data"):
        train_rows, val_rows, fields, spec, report = load_data(cfg, record, early)
    assert model is not None  # a model problem was raised above, with the data's
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg, *model)
    if data_key is not None and key is None:
        key = store_key(cfg, data_key, model[1], tokenizer)
        use = StoreUse("miss") if key is not None else StoreUse("not cacheable", why="the model is not a local folder")
    target = None
    if key is not None:
        if encoded_store.rows_record(val_rows) is None:
            use = StoreUse("not cacheable", why="a validation row holds a value JSON cannot hold")
        else:
            target = (encoded_store.locate(data_key, key), key)
    return ReadData(report, fields, spec, data_columns(train_rows + val_rows), train_rows, val_rows, tokenizer, use,
                    target=target, lines=record.lines)


def _encode_into(writer: StoreWriter, rows: list[Row], data: ReadData, max_len: int, keys: list[str],
                 split: str) -> dict[str, Any]:
    """Encode ``rows`` on every core, chunk by chunk, into ``writer``; the truncation report."""
    tokenizer, fields, spec = data.tokenizer, data.fields, data.spec

    def chunk(a: int, b: int) -> tuple[Any, dict[str, Any]]:
        feats, rep = encode(rows[a:b], tokenizer, fields, spec, max_len, keys, split)
        return arrays_of(feats, rows[a:b], spec, keys), rep

    reports = []
    for arrays, rep in chunked(chunk, len(rows), encoded_store.cores()):
        writer.add(split, arrays)
        reports.append(rep)
    if not reports:
        writer.add(split, arrays_of([], [], spec, keys))
        return encode([], tokenizer, fields, spec, max_len, keys, split)[1]
    return merge_truncation(reports)


def encode_data(cfg: ClassifyConfig, data: ReadData, max_len: int, keys: list[str], say: Say) -> EncodedClassify:
    """Tokenize (to ``max_len`` tokens, truncations counted) and label every example: into the encoded-data cache and
    read back from it by position, or in memory (``--no_cache``, or not cacheable). A hit reads the store, after
    checking that it was encoded to the same length and inputs, and prints what encoding printed."""
    if data.store is not None:
        rec = Record.from_json(data.store.record, str(data.store.folder / encoded_store.HEADER))
        if (rec.max_len, rec.keys) == (max_len, keys):
            for line in rec.encode_lines:
                say(line)
            return _from_store(data, data.store, keys, say)
        # The key holds what decides both (the model's config, transformers' version): this is a safety net.
        why = f"it was encoded to {rec.max_len} tokens of {rec.keys}, the model takes {max_len} of {keys}"
        say(f"note: the encoded-data cache {data.store.folder} does not fit this model ({why}); the data is read and "
            "encoded again, in memory")
        data.train_rows, data.val_rows, *_ = load_data(cfg, lambda _: None)
        data.store, data.use = None, StoreUse("not cacheable", why=why)
    assert data.train_rows is not None
    train_rows, val_rows, spec = data.train_rows, data.val_rows, data.spec
    record = encoded_store.Recorder(say)
    writer = None
    if data.target is not None:
        try:
            writer = StoreWriter(*data.target)
        except OSError as e:  # a cache is a speed-up: one that cannot be written costs the next run an encoding
            data.use = StoreUse("not cacheable", why=f"the cache cannot be written: {e}")
    try:
        with startup.phase("encoding data"), phase("encoding data"):
            train_feats: list[dict[str, Any]] = []
            if writer is None:
                train_feats, train_rep = encode(train_rows, data.tokenizer, data.fields, spec, max_len, keys, "train")
            else:
                train_rep = _encode_into(writer, train_rows, data, max_len, keys, "train")
            val_feats, val_rep = encode(val_rows, data.tokenizer, data.fields, spec, max_len, keys, "validation")
        for rep in (train_rep, val_rep):
            say_truncated(rep, max_len, record, split=True)
        data.summary.encoding = {"train": train_rep, "validation": val_rep}
        if writer is None:
            say_store(data.use, len(train_feats), data.summary, say)
            return EncodedClassify(train_feats, [len(f["input_ids"]) for f in train_feats], [1] * len(train_feats),
                                   lambda i: train_rows[i].where, val_feats)
        writer.add("validation", arrays_of(val_feats, val_rows, spec, keys))
        rows = encoded_store.rows_record(val_rows)
        assert rows is not None  # checked by read_data
        rec = Record(encoded_store.summary_record(data.summary), data.lines, record.lines, asdict(spec),
                     asdict(data.fields), data.columns, rows, max_len, keys)
        with startup.phase("encoded data write"):
            folder = writer.commit(rec.to_json())
    except OSError as e:
        if writer is None:
            raise
        writer.discard()
        say(f"note: the encoded-data cache cannot be written ({e}); the data is encoded again, in memory")
        data.target, data.use = None, StoreUse("not cacheable", why=f"the cache cannot be written: {e}")
        encoded = encode_data(cfg, data, max_len, keys, lambda _: None)
        say_store(data.use, len(encoded.features), data.summary, say)
        return encoded
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    assert data.target is not None
    data.train_rows = None  # the rows are in the store now: what stays in memory does not grow with them
    store = EncodedStore.open(folder, data.target[1], say)
    assert store is not None, f"the encoded-data cache just written to {folder} does not check out"
    return _from_store(data, store, keys, say)


def _from_store(data: ReadData, store: EncodedStore, keys: list[str], say: Say) -> EncodedClassify:
    """The examples of an opened store: the training ones read by position, the validation ones in memory."""
    train, val = store.split("train"), store.split("validation")
    features = StoredExamples(train, store.extras(train), keys, data.spec.problem_type)
    held_out = StoredExamples(val, store.extras(val), keys, data.spec.problem_type)
    val_feats = list(held_out)
    held_out.close()
    data.use.folder = str(store.folder)
    say_store(data.use, len(features), data.summary, say)
    return EncodedClassify(features, train.lengths, train.counts, train.where, val_feats,
                           identity=f"store:{store.digest}")


# ------------------------------------------------------------------------------------------------------------ prepare


def prepare(cfg: ClassifyConfig, say: Say = print, problems: list[Problem] | None = None) -> Prepared:
    """Everything the loop needs: rows -> typed labels and tokens (through the encoded-data cache), the classifier
    (with LoRA or a custom head), the collator, the loss and the per-epoch evaluation. Nothing is written to the run
    folder."""
    early = list(problems or [])
    model_at: tuple[str, str] | None = None
    try:
        source = resolve_model(cfg.model, default="encoder")
        # a GGUF causal LM can serve as a decoder-only classifier
        model_at = (source.name, model_folder(source, log=say) if source.kind == "gguf" else source.path)
    except ModelError as e:
        early = early + e.problems
    if cfg.head:
        try:
            load_factory(cfg.head)
        except ConfigError as e:
            early += e.problems
    data = read_data(cfg, model_at, say, early)
    assert model_at is not None  # a model problem was raised above, with the data's
    name, path = model_at
    fields, spec, report, tokenizer, val_rows = data.fields, data.spec, data.summary, data.tokenizer, data.val_rows

    with startup.phase("model load"):
        model = build_model(cfg, path, spec, say)
    max_len, tokenizer_keys, accepted = model_inputs(cfg, model, tokenizer, say)
    keys = [k for k in tokenizer_keys if k in accepted]
    table = column_table(data.columns, fields, spec, tokenizer_keys, accepted, type(model).__name__)
    say("columns:\n" + render_columns(table))
    encoded = encode_data(cfg, data, max_len, keys, say)
    train_feats, val_feats = encoded.features, encoded.val_feats

    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model.backbone if cfg.head else model, lora=cfg.lora_r > 0)
        say("gradient checkpointing on: activations are recomputed in the backward pass")
    model = _apply_lora(model, cfg, say)
    seed_dropout(model)  # masks fixed by (seed, step, example): an out-of-memory split draws the same ones
    accelerator = make_accelerator(cfg.precision, lora=cfg.lora_r > 0, report_to=cfg.trackers,
                                   project_dir=cfg.output_dir)
    say(f"model {name}; precision {precision_name(accelerator)}; device {accelerator.device} (the batch is "
        "cut as the memory plan below says)")

    collate = make_collator(tokenizer, spec)
    first, second = HEADLINE[spec.problem_type]

    # Epoch 0 reused when nothing it reads changed (tasks/baseline_eval.py); a new head's weights are in its key, so
    # another --seed draws another head and recomputes. A custom head is user code: no content to key on.
    reusable = not cfg.head and not cfg.trust_remote_code and Path(path).exists()
    baseline = BaselineReuse(None if not reusable else lambda: {
        "model": startup_cache.files_identity(path), "tokenizer": startup_cache.tokenizer_identity(tokenizer),
        "labels": repr(spec), "fields": repr(fields), "validation": startup_cache.features_digest(val_feats),
        "rows": rows_digest(val_rows)})

    def evaluate(m: Any, epoch: int | float, batch_size: int) -> Evaluation:
        result = baseline.evaluation(epoch, m, {"batch_size": batch_size}, lambda: evaluate_features(
            m, Scored(val_rows, val_feats, fields, spec), collate, batch_size, accelerator, say))
        metrics = result.metrics
        say(f"epoch {epoch}/{cfg.epochs}  {first}={metrics[first]:.4f}  {second}={metrics[second]:.4f}  "
            f"eval_loss={metrics['eval_loss']:.4f}")
        return result

    loss_fn = make_loss_fn(spec.problem_type)
    work = TrainingWork(features=train_feats, lengths=encoded.lengths, counts=encoded.counts, collate=collate,
                        loss_fn=loss_fn, evaluate=evaluate, where=encoded.where,
                        plan=PlanInputs(eval_lengths=[len(f["input_ids"]) for f in val_feats], lora=cfg.lora_r > 0),
                        activation_store=SavedActivationsIn)
    return Prepared(
        cfg=cfg, model=model, accelerator=accelerator, work=work,
        save=lambda m, folder: save(m, tokenizer, cfg, spec, folder),
        check=lambda: check(model, tokenizer, encoded.doctor_sample(), val_feats or None, collate,
                            args={"batch_size": cfg.micro_batch_size}, task="classify"),
        # A custom head is user code, and remote code is the model's: neither has a content identity to key on.
        cache_key=None if cfg.head or cfg.trust_remote_code or not Path(path).exists() else lambda: {
            "model": startup_cache.files_identity(path), "tokenizer": startup_cache.tokenizer_identity(tokenizer),
            "labels": repr(spec), "train": encoded.identity or startup_cache.features_digest(train_feats),
            "validation": startup_cache.features_digest(val_feats)},
        baseline=baseline, found=Found(report, files={COLUMNS: table}),
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
