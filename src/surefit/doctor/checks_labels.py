"""Checks that compare the labels with what the model's head and loss expect, for any model.

Codes: ``label-shape``, ``label-dtype`` and ``label-one-hot`` (for models without a transformers config saying
``num_labels`` / ``problem_type``: derived from the logits of a dry forward and confirmed by probes),
``labels-pad-trained``, ``token-labels-misaligned``, ``new-head-frozen``, ``turn-end-masked``.

What the loss expects is read from the logits, not from class names: ``[B, C]`` is one prediction per row, ``[B, T,
C]`` one per token. When the dry forward fails, the labels are changed the way a suspected cause says they should
be (cast, argmax) and the forward runs again: a cause is reported only when that probe passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from surefit.doctor.checks_data import (
    IGNORE_INDEX,
    collator_name,
    collator_where,
    is_lm_collator,
    model_kind,
    rows_text,
    setup_tokenizer,
    special_ids,
    train_values,
    turn_terminator,
)
from surefit.doctor.core import Finding, Setup, Severity, describe, register

# ------------------------------------------------------------------------------------------------------------ helpers


def _batch_labels(setup: Setup) -> tuple[str, Any] | None:
    """``(key, tensor)`` of the dry-run batch's labels, or ``None``."""
    import torch

    batch, err = setup.batch()
    if err is None and isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[-1], torch.Tensor):
        return f"item[{len(batch) - 1}]", batch[-1]  # (inputs..., target): a plain loop's TensorDataset
    if err is not None or not isinstance(batch, Mapping):
        return None
    for key in setup.label_keys():
        if isinstance(batch[key], torch.Tensor):
            return key, batch[key]
    return None


def _batch_rows(setup: Setup) -> list[int]:
    """The dataset row of each dry-run batch row."""
    return [i for i, _ in setup.samples()[0]][: len(setup.batch_items())]


def _has_class_config(setup: Setup) -> bool:
    """A transformers config says num_labels / problem_type: the config-based label checks decide then."""
    cfg = setup.config
    return cfg is not None and hasattr(cfg, "num_labels") and model_kind(setup) in ("seq-cls", "token-cls") and \
        type(setup.base_model).__name__.endswith(("ForSequenceClassification", "ForTokenClassification"))


def _model_name(setup: Setup) -> str:
    return type(setup.base_model).__name__


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


# ---------------------------------------------------------------------------------- labels against the logits


@register("label-shape", "label-dtype", "label-one-hot")
def check_labels_vs_logits(setup: Setup) -> list[Finding]:
    """Labels whose shape or dtype does not fit the head's logits (and the loss between them)."""
    import torch

    from_data = _label_shape_in_data(setup)
    if from_data:
        return from_data
    found = _batch_labels(setup)
    logits = setup.logits() if found is not None else None
    if found is None or not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        return []
    key, y = found
    batch, _ = setup.batch()
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    rows = _batch_rows(setup)
    model = _model_name(setup)
    where = f"{collator_where(setup)}, batch key '{key}'"
    shape_l, shape_y = list(logits.shape), list(y.shape)
    per_seq = logits.dim() == 2
    per_token = logits.dim() == 3
    # per-token labels for one prediction per row
    if per_seq and y.dim() == 2 and y.shape[1] != logits.shape[-1]:
        per_tok = (isinstance(ids, torch.Tensor) and tuple(y.shape) == tuple(ids.shape)) or \
            bool((y == IGNORE_INDEX).any())
        if not per_tok and setup.forward()[1] is None:
            return []  # [B, K] targets that the model's own loss accepts: its business
        c = setup.data_collator
        masked = int((y != IGNORE_INDEX).sum())
        if c is not None and getattr(c, "mlm", False) is True:
            source = (f": {collator_name(setup)} with mlm=True builds masked-LM labels (one per token, -100 except "
                      f"at the {masked} masked positions)")
        elif c is not None and any(k.__name__ == "DataCollatorForLanguageModeling" for k in type(c).__mro__):
            source = f": {collator_name(setup)} builds language-model labels, a copy of input_ids"
        else:
            source = ""
        what = "per token" if per_tok else f"{y.shape[1]} values per row"
        return [Finding(
            "label-shape", "error",
            f"{model} predicts one row of {logits.shape[-1]} scores per sequence (logits {shape_l}) but `{key}` is "
            f"{describe(y)}, {what}{source} (batch row 0 = dataset row {rows[0] if rows else 0}: "
            f"{y[0, :8].tolist()}{'...' if y.shape[1] > 8 else ''}); the loss cannot pair them (cross-entropy: "
            f"`Expected input batch_size ({shape_l[0]}) to match target batch_size ({shape_y[0] * shape_y[1]})`)",
            "give each row one class id (a 'label' column; for several labels per row, a float vector of "
            f"{logits.shape[-1]}) and pad with DataCollatorWithPadding(tokenizer); a language-model collator is for "
            "(masked-)LM training (AutoModelForMaskedLM / ForCausalLM), not for a sequence classifier", where)]
    # one label per row for one prediction per token
    if per_token and y.dim() == 1 and model_kind(setup) == "token-cls":
        return [Finding(
            "label-shape", "error",
            f"{model} predicts per token (logits {shape_l}) but `{key}` holds one value per row ({describe(y)}, "
            f"rows {rows[:4]}: {y[:4].tolist()}): the token-classification loss needs one label per token",
            "give each token a label (-100 on special tokens and continuation sub-words, aligned with "
            "tokenizer(...).word_ids()) and pad with DataCollatorForTokenClassification; for one label per text use a "
            "sequence classifier (AutoModelForSequenceClassification)", where)]
    if _has_class_config(setup):
        return []  # transformers classifiers: checks_data's label-dtype / label-one-hot read num_labels and problem_type
    n = logits.shape[-1]
    shown = f"rows {rows[:4]}: {y[:4].tolist()}"
    try:
        names, var_kw = setup.forward_params()
    except (TypeError, ValueError):
        return []
    if not var_kw and key not in names:
        return _loss_outside(setup, key, y, logits, shown, where)
    _, err = setup.forward()
    if err is None:
        if tuple(y.shape) != tuple(logits.shape) and y.numel() == logits.numel() and y.is_floating_point():
            return _broadcast(setup, key, y, logits, where)  # [B] against [B, 1]: a loss may broadcast to [B, B]
        return []  # the loss takes these labels; shape and dtype are the model's business
    if per_seq and n == 1 and y.dim() == 1 and setup.probe({key: y.float().unsqueeze(-1)}) is None:
        return [Finding(
            "label-shape", "error",
            f"`{key}` is {describe(y)}, one value per row, but {model}'s logits are {shape_l}: the loss needs both of "
            f"one shape (`{_first_line(err)}`); it passes with labels of shape {shape_l}",
            f"match the shapes in the loss: loss_fn(logits.squeeze(-1), {key}.float()) (or {key}.float()"
            ".unsqueeze(-1)); beware MSELoss, which broadcasts [B, 1] against [B] to [B, B] silently", where)]
    if y.is_floating_point() and (per_seq and y.dim() == 1 and n >= 2 or per_token and y.dim() == 2):
        if setup.probe({key: y.round().long()}) is None:
            integral = bool((y == y.round()).all())
            return [Finding(
                "label-dtype", "error",
                f"float labels ({describe(y)}, {shown}) for {model}, whose {n} class scores per "
                f"{'row' if per_seq else 'token'} go to cross-entropy, which needs integer class ids: the forward fails "
                f"with `{_first_line(err)}` and passes with the labels cast to int64",
                f"store the labels as integers (e.g. ds = ds.map(lambda r: {{'{key}': int(r['{key}'])}}), or "
                f"torch.long in the dataset)" + ("" if integral else "; some are not whole numbers: if they are "
                                                 "real-valued targets, use a regression loss and one output"), where)]
    if not y.is_floating_point() and y.dim() == 2 and per_seq and y.shape[1] == n:
        one_hot = bool(((y == 0) | (y == 1)).all()) and bool((y.sum(-1) == 1).all())
        if one_hot and setup.probe({key: y.argmax(-1)}) is None:
            return [Finding(
                "label-one-hot", "error",
                f"one-hot labels ({describe(y)}, {shown}) for {model}, whose loss takes one class id per row "
                f"(cross-entropy): the forward fails with `{_first_line(err)}` and passes with argmax(labels)",
                f"give the class id instead: ds = ds.map(lambda r: {{'{key}': r['{key}'].index(1)}}); for several "
                "labels per row use float multi-hot vectors and BCEWithLogitsLoss", where)]
        if setup.probe({key: y.float()}) is None:
            return [Finding(
                "label-dtype", "error",
                f"integer multi-hot labels ({describe(y)}, {shown}) for {model}, whose loss takes float targets per "
                f"class (BCEWithLogitsLoss): the forward fails with `{_first_line(err)}` and passes with float labels",
                f"store the vectors as floats: ds = ds.map(lambda r: {{'{key}': [float(x) for x in r['{key}']]}})",
                where)]
    if not y.is_floating_point() and (per_seq and n == 1 and y.dim() in (1, 2) or
                                      y.dim() == logits.dim() and tuple(y.shape) == tuple(logits.shape)):
        if setup.probe({key: y.float()}) is None:
            return [Finding(
                "label-dtype", "error",
                f"integer labels ({describe(y)}, {shown}) for {model}, whose loss takes float targets (logits "
                f"{shape_l}: BCEWithLogitsLoss or a regression loss): the forward fails with `{_first_line(err)}` "
                "and passes with float labels",
                f"store the labels as floats: ds = ds.map(lambda r: {{'{key}': float(r['{key}'])}}) (for vectors, "
                "each element)", where)]
    return []


def _label_shape_in_data(setup: Setup) -> list[Finding]:
    """The label column itself holds the other head's shape (found before any collator has to cope with it)."""
    from surefit.doctor.checks_data import label_values

    kind = model_kind(setup)
    scan = label_values(setup) if kind in ("seq-cls", "token-cls") else None
    if not scan or not scan[2]:
        return []
    split, key, values, scope = scan
    where = f"{split} column '{key}', row {values[0][0]}"
    model = _model_name(setup)
    if kind == "seq-cls":
        ids = dict(train_values(setup, "input_ids")[0])
        n = getattr(setup.config, "num_labels", None)
        per_token = [(i, v) for i, v in values if isinstance(v, list) and isinstance(ids.get(i), list)
                     and len(v) == len(ids[i]) and len(v) != n]
        if len(per_token) * 2 <= len(values) or len({len(v) for _, v in per_token}) < 2:
            return []
        i, v = per_token[0]
        return [Finding(
            "label-shape", "error",
            f"column '{key}' of {split} holds one label per token in {len(per_token)} of {len(values)} rows ({scope}; "
            f"row {i}: {len(v)} values, as many as its input_ids: {v[:6]}{'...' if len(v) > 6 else ''}) but {model} "
            "predicts one class per row", "give each row one class id (for several labels per row, a float vector "
            "of num_labels); per-token labels belong to a token classifier or a language model", where)]
    scalars = [(i, v) for i, v in values if not isinstance(v, list)]
    if len(scalars) * 2 <= len(values):
        return []
    i, v = scalars[0]
    return [Finding(
        "label-shape", "error",
        f"column '{key}' of {split} holds one label per row in {len(scalars)} of {len(values)} rows ({scope}; row {i}: "
        f"{v!r}) but {model} predicts one class per token", "give each token a label (-100 on special tokens and "
        "continuation sub-words, aligned with tokenizer(...).word_ids()); for one label per text use a sequence "
        "classifier (AutoModelForSequenceClassification)", where)]


def _broadcast(setup: Setup, key: str, y: Any, logits: Any, where: str) -> list[Finding]:
    """A loss that ran, but broadcast labels against logits of another shape (torch warns, training goes on)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if setup.probe({}) is not None:
            return []
    said = next((str(w.message) for w in caught if "broadcast" in str(w.message).lower()), None)
    if said is None:
        return []
    return [Finding(
        "label-shape", "error",
        f"`{key}` is {describe(y)} but {_model_name(setup)}'s logits are {list(logits.shape)}: the loss broadcasts "
        f"them to {[y.shape[0]] * 2} and compares every prediction with every row's target, so it trains on the "
        f"wrong pairs without failing (torch warns: \"{said.splitlines()[0][:160]}\")",
        f"give the loss tensors of one shape: loss_fn(logits.squeeze(-1), {key}) or loss_fn(logits, {key}"
        ".unsqueeze(-1))", where)]


def _loss_outside(setup: Setup, key: str, y: Any, logits: Any, shown: str, where: str) -> list[Finding]:
    """The forward does not take the labels (the loss is computed outside the model): what no loss can take.

    Against ``[B, C]`` logits with ``C >= 2``, one value per row can only be a class index (cross-entropy,
    NLL), so it must be an integer; integer ``[B, C]`` vectors fit neither cross-entropy (class ids or float
    probabilities) nor BCE (float targets).
    """
    model = _model_name(setup)
    n = logits.shape[-1]
    if logits.dim() != 2 or n < 2:
        return []
    if key.startswith("item[") and y.dim() == 1 and not y.is_floating_point():
        return _tuple_range(setup, key, n, model, logits, where)
    if y.dim() == 1 and y.is_floating_point() and bool((y == y.round()).all()):
        return [Finding(
            "label-dtype", "error",
            f"float labels ({describe(y)}, {shown}) against {model}'s logits {list(logits.shape)}: one value per row "
            f"against {n} scores per row can only be a class index (cross-entropy), which must be an integer "
            "(`expected scalar type Long but found Float`)",
            f"store the labels as integers (torch.long), e.g. ds = ds.map(lambda r: {{'{key}': int(r['{key}'])}})",
            where)]
    if y.dim() == 2 and y.shape[1] == n and not y.is_floating_point():
        one_hot = bool(((y == 0) | (y == 1)).all()) and bool((y.sum(-1) == 1).all())
        if one_hot:
            return [Finding(
                "label-one-hot", "error",
                f"integer one-hot labels ({describe(y)}, {shown}) against {model}'s logits {list(logits.shape)}: "
                "cross-entropy takes class ids (or float probabilities), BCE takes float targets; integer vectors "
                "fit neither",
                f"for one class per row give its id: ds = ds.map(lambda r: {{'{key}': r['{key}'].index(1)}}); for "
                "several labels per row, float vectors with BCEWithLogitsLoss", where)]
        return [Finding(
            "label-dtype", "error",
            f"integer multi-hot labels ({describe(y)}, {shown}) against {model}'s logits {list(logits.shape)}: "
            "BCEWithLogitsLoss needs float targets (`result type Float can't be cast to the desired output type "
            "Long`)", f"store the vectors as floats: [float(x) for x in r['{key}']]", where)]
    return []


TUPLE_SCAN = 20_000  # items read from a tuple dataset for the class-id range


def _tuple_range(setup: Setup, key: str, n: int, model: str, logits: Any, where: str) -> list[Finding]:
    """Class ids outside ``[0, C)`` in the target element of ``(inputs..., target)`` items."""
    ds = setup.train_dataset
    size = min(Setup.length(ds) or 0, TUPLE_SCAN)
    index = int(key[5:-1])
    bad: dict[int, list[int]] = {}
    for i in range(size):
        try:
            value = ds[i][index]
            value = int(value.item() if hasattr(value, "item") else value)
        except Exception:  # noqa: BLE001 - an unreadable item is dataset-item-failed's business
            return []
        if not 0 <= value < n:
            bad.setdefault(value, []).append(i)
    if not bad:
        return []
    rows = sorted({i for r in bad.values() for i in r})
    listing = "; ".join(f"{v} in {rows_text(r, 3, noun='item')}" for v, r in sorted(bad.items())[:5])
    high = max(bad)
    fix = (f"if there are {high + 1} classes, build the head with {high + 1} outputs; if the ids start at 1, "
           "subtract 1; " if high >= n else "") + "drop or relabel rows marked -1 (unlabelled)"
    return [Finding(
        "label-out-of-range", "error",
        f"the targets ({key} of each item) hold class ids outside [0, {n}) for {model}'s {n} outputs (logits "
        f"{list(logits.shape)}) in {len(rows)} of {size} items: {listing}; cross-entropy fails with `Target N is out "
        "of bounds` (on a GPU: a device-side assert)", fix, f"train_dataset item {rows[0]}, {key}")]


# ------------------------------------------------------------------------------------------- labels-pad-trained


def _padding(ids: list, mask: list | None, pad: int | None, eos: int | None) -> list[int]:
    """Positions of one row that are padding: attention mask 0, or (without a mask) the trailing run of pad ids.

    When the first padding position right after the text holds EOS (pad == eos, `padding="max_length"`), it is
    the row's end-of-sequence token, predicted from the last real token: it is kept out, so a labelled EOS there
    is not counted as padding (and ``eos-missing`` does not fire for it).
    """
    if isinstance(mask, list) and len(mask) == len(ids) and 0 in mask:
        out = [j for j, m in enumerate(mask) if not m]
    elif pad is not None:
        n = len(ids)
        while n and ids[n - 1] == pad:
            n -= 1
        out = list(range(n, len(ids)))
    else:
        return []
    if out and eos is not None and ids[out[0]] == eos and out[0] > 0 and (out[0] - 1) not in out:
        out = out[1:]  # the EOS that ends the text (right padding): a label the model needs
    return out


def _pad_fix(setup: Setup, in_data: bool, pad_is_eos: bool) -> str:
    """The fix that works with the user's collator."""
    name = collator_name(setup)
    label_pad = getattr(setup.data_collator, "label_pad_token_id", None)
    keep_eos = (" To keep the stop signal, make EOS a real token first: tokenize text + tokenizer.eos_token "
                "(attention_mask 1 there), so it keeps its label" if pad_is_eos else "")
    if not in_data:
        if label_pad not in (None, IGNORE_INDEX):
            return (f"pad labels with -100: {name}(..., label_pad_token_id=-100) (DataCollatorForSeq2Seq's default)"
                    + keep_eos)
        return (f"{name} builds the labels: make it set them to -100 where attention_mask is 0 (mask padding by "
                "position, never by token id)" + keep_eos)
    by_position = ("set the labels of padded positions to -100 when tokenizing: labels = [t if m else -100 for t, m "
                   "in zip(input_ids, attention_mask)]")
    if "Seq2Seq" in name or name in ("PadCollator", "DataCollatorWithPadding"):
        alt = (f"; better, tokenize without padding='max_length' (padding=False) and let {name} pad: it pads "
               "labels with -100")
    elif is_lm_collator(setup):
        alt = "; or drop the labels column: DataCollatorForLanguageModeling(mlm=False) builds them with padding masked"
    else:
        alt = ""
    return by_position + alt + ("." + keep_eos if keep_eos else "")


def _pad_by_position(setup: Setup) -> list[Finding] | None:
    """Labels trained at padded positions (attention mask 0, or after the row's end), whatever the pad id.

    Returns ``None`` when the position test does not apply (labels not aligned with input_ids), so the pad-id
    test decides.
    """
    import torch

    eos, pad = special_ids(setup)
    values, scope = train_values(setup, "labels")
    ids_by_row = dict(train_values(setup, "input_ids")[0])
    masks = dict(train_values(setup, "attention_mask")[0])
    hits: list[tuple[int, list[int]]] = []
    total = aligned = 0
    for i, lab in values:
        ids = ids_by_row.get(i)
        if not isinstance(lab, list) or not isinstance(ids, list) or len(lab) != len(ids):
            continue
        aligned += 1
        total += len(lab)
        trained = [j for j in _padding(ids, masks.get(i), pad, eos) if lab[j] != IGNORE_INDEX]
        if trained:
            hits.append((i, trained))
    found = _batch_labels(setup)
    batch, err = setup.batch()
    bmask = batch.get("attention_mask") if err is None and isinstance(batch, Mapping) else None
    bids = batch.get("input_ids") if err is None and isinstance(batch, Mapping) else None
    batch_hits: list[tuple[int, list[int]]] = []
    if found is not None and isinstance(bids, torch.Tensor) and found[1].shape == bids.shape and bids.dim() == 2 \
            and not found[1].is_floating_point():
        y = found[1]
        for r in range(y.shape[0]):
            m = bmask[r].tolist() if isinstance(bmask, torch.Tensor) and bmask.shape == y.shape else None
            row = y[r].tolist()
            trained = [j for j in _padding(bids[r].tolist(), m, pad, eos) if row[j] != IGNORE_INDEX]
            if trained:
                batch_hits.append((r, trained))
    if not aligned and found is None:
        return None
    if hits:
        rows_in_batch = set(_batch_rows(setup))
        if found is not None and rows_in_batch & {i for i, _ in hits} and not batch_hits:
            return []  # the collator rebuilds labels (padding masked): the column's padded labels never train
        count = sum(len(p) for _, p in hits)
        i, ps = hits[0]
        eos_note = (f"; pad == EOS (id {pad}), so these are copies of EOS after the row's end (the first, the row's "
                    "real EOS, is not counted)" if pad is not None and pad == eos else "")
        return [Finding(
            "labels-pad-trained", "error",
            f"{count} of {total} label positions ({count / max(total, 1):.0%}) in {len(hits)} rows of train_dataset "
            f"({scope}) are padding (attention_mask 0, or after the row's end) and are trained: e.g. row {i}, "
            f"positions {ps[:3]}{'...' if len(ps) > 3 else ''} of {len(ids_by_row[i])}{eos_note}; padding then "
            "dominates the loss and the model learns to emit it",
            _pad_fix(setup, True, pad is not None and pad == eos), f"train_dataset column 'labels', row {i}")]
    if batch_hits and found is not None:  # batch_hits come from found's labels
        key = found[0]
        rows = _batch_rows(setup)
        r, ps = batch_hits[0]
        count = sum(len(p) for _, p in batch_hits)
        bad_rows = sorted(rows[b] if b < len(rows) else b for b, _ in batch_hits)
        label_pad = getattr(setup.data_collator, "label_pad_token_id", None)
        cause = (f"{collator_name(setup)} pads labels with label_pad_token_id={label_pad}" if label_pad not in
                 (None, IGNORE_INDEX) else f"{collator_name(setup)} leaves them trained")
        return [Finding(
            "labels-pad-trained", "error",
            f"the batch's `{key}` trains {count} padded positions (attention_mask 0, or after the row's end) of "
            f"{found[1].numel()}: {len(ps)} in batch row {r} ({rows_text(bad_rows)} in all): {cause}, so padding "
            "is trained", _pad_fix(setup, False, pad is not None and pad == eos),
            f"{collator_where(setup)}, key '{key}'")]
    return [] if aligned or found is not None and isinstance(bids, torch.Tensor) and found[1].shape == bids.shape \
        else None


@register("labels-pad-trained")
def check_pad_trained(setup: Setup) -> list[Finding]:
    """Labels trained at padded positions, whatever the pad id; for seq2seq targets, labels equal to the pad id."""
    import torch

    if model_kind(setup) not in ("causal", "seq2seq"):
        return []
    if model_kind(setup) == "causal":
        by_position = _pad_by_position(setup)
        if by_position is not None:
            return by_position
    eos, pad = special_ids(setup)
    if pad is None or pad == eos:
        return []
    tok = setup_tokenizer(setup)
    name = f" ({tok.pad_token!r})" if getattr(tok, "pad_token", None) else ""
    seq2seq = model_kind(setup) == "seq2seq"
    fix_data = ("replace the pad ids in labels with -100 when tokenizing, e.g. labels = [[(t if t != "
                "tokenizer.pad_token_id else -100) for t in row] for row in labels]; better, tokenize the targets "
                "without padding and let " + ("DataCollatorForSeq2Seq(tokenizer, model=model)" if seq2seq else
                                               "DataCollatorForSeq2Seq(tokenizer)") +
                " pad labels with -100 (its default label_pad_token_id)")
    values, scope = train_values(setup, "labels")
    hits = [(i, [p for p, t in enumerate(v) if t == pad]) for i, v in values if isinstance(v, list)]
    hits = [(i, ps) for i, ps in hits if ps]
    found = _batch_labels(setup)
    if hits and found is not None and set(_batch_rows(setup)) & {i for i, _ in hits} \
            and not bool((found[1] == pad).any()):
        return []  # the collator rebuilds labels (e.g. from input_ids, padding masked): the column's pads never train
    if hits:
        i, ps = hits[0]
        count = sum(len(p) for _, p in hits)
        return [Finding(
            "labels-pad-trained", "error",
            f"{count} label positions in {len(hits)} rows of train_dataset ({scope}) hold the pad id {pad}{name}, "
            f"which differs from EOS, so the loss trains them: e.g. row {i}, positions {ps[:3]}"
            f"{'...' if len(ps) > 3 else ''} (of {len(values[[r for r, _ in values].index(i)][1])}); the model learns "
            f"to emit padding{' after the target' if seq2seq else ''}, and padding dominates the loss",
            fix_data, f"train_dataset column 'labels', row {i}")]
    if found is None:
        return []
    key, y = found
    if y.is_floating_point() or y.dim() != 2:
        return []
    mask = y == pad
    if not bool(mask.any()):
        return []
    rows = _batch_rows(setup)
    r = int(torch.nonzero(mask)[0, 0])
    bad_rows = sorted({rows[int(b)] if int(b) < len(rows) else int(b) for b in torch.nonzero(mask)[:, 0]})
    label_pad = getattr(setup.data_collator, "label_pad_token_id", None)
    cause = (f"{collator_name(setup)} pads labels with label_pad_token_id={label_pad}, the pad id"
             if label_pad == pad else f"the collated labels hold it at {int(mask.sum())} positions")
    return [Finding(
        "labels-pad-trained", "error",
        f"the batch's `{key}` holds the pad id {pad}{name} (not EOS) at {int(mask[r].sum())} positions of batch row "
        f"{r} ({rows_text(bad_rows)} in all): {cause}, so padding is trained",
        f"pad labels with -100: {collator_name(setup)}(..., label_pad_token_id=-100) (DataCollatorForSeq2Seq's "
        "default), or set the pad positions of labels to -100", f"{collator_where(setup)}, key '{key}'")]


# --------------------------------------------------------------------------------------- token-labels-misaligned


@register("token-labels-misaligned")
def check_token_labels_aligned(setup: Setup) -> list[Finding]:
    """Per-token labels of a token classifier whose length differs from the row's input_ids."""
    if model_kind(setup) != "token-cls":
        return []
    labels = dict(train_values(setup, "labels")[0])
    key = "labels"
    if not labels:
        labels, key = dict(train_values(setup, "label")[0]), "label"
    ids, scope = train_values(setup, "input_ids")
    bad = [(i, len(labels[i]), len(v)) for i, v in ids
           if isinstance(v, list) and isinstance(labels.get(i), list) and len(labels[i]) != len(v)]
    if not bad:
        return []
    i, n_lab, n_ids = bad[0]
    shorter = sum(1 for _, a, b in bad if a < b)
    collator = collator_name(setup)
    silent = ("DataCollatorForTokenClassification pads the shorter labels with -100 to the batch's length, so "
              "training runs and each tag lands on the wrong token" if "TokenClassification" in collator else
              f"{collator} cannot line them up")
    return [Finding(
        "token-labels-misaligned", "error",
        f"{len(bad)} rows of train_dataset ({scope}) have a different number of `{key}` than input_ids, e.g. row {i}: "
        f"{n_lab} labels for {n_ids} tokens ({shorter} of them have fewer labels than tokens: word-level tags, "
        f"while the tokenizer adds special tokens and splits words into sub-words); {silent}",
        "align the tags to the tokens: enc = tokenizer(words, is_split_into_words=True, truncation=True); "
        "word_ids = enc.word_ids(); label = -100 where word_ids[j] is None (special tokens) and on the second and "
        "later sub-words of a word, else the tag of word word_ids[j]",
        f"train_dataset column '{key}', row {i}")]


# ----------------------------------------------------------------------------------------------- new-head-frozen


_PEFT_HEADS = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"),
               "QUESTION_ANS": ("qa_outputs",)}


def _new_modules(base: Any) -> list[tuple[str, Any, Severity]]:
    """``(name, module, severity)`` of the modules the loader initialised fresh.

    The checkpoint's ``config.architectures`` names the class it was saved from; modules outside the backbone
    (``base_model_prefix``) of another class were not in it. Without ``architectures`` (a model built from a
    config), a classifier's layers producing ``num_labels`` outputs are taken as new. Head-side poolers (DeBERTa's
    ``pooler``) are outside the backbone and count; a pooler inside the backbone is in most base checkpoints.
    """
    from torch import nn

    cfg = getattr(base, "config", None)
    prefix = getattr(base, "base_model_prefix", "")
    backbone = getattr(base, prefix, None) if prefix else None
    if cfg is None or not isinstance(backbone, nn.Module):
        return []
    arch = getattr(cfg, "architectures", None) or []
    cls = type(base).__name__
    if cls in arch:
        return []
    n = getattr(cfg, "num_labels", None)
    shared = {p.data_ptr() for p in backbone.parameters()}
    out: list[tuple[str, Any, Severity]] = []
    for name, module in base.named_children():
        params = list(module.parameters())
        if module is backbone or not params or all(p.data_ptr() in shared for p in params):
            continue  # no weights, or weights tied to the backbone's (an LM head tied to the embeddings)
        if arch:
            out.append((name, module, "error"))
        else:
            outs = {getattr(m, "out_features", None) for m in module.modules()}
            if n in outs and not cls.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM")):
                out.append((name, module, "error"))
    return out


@register("new-head-frozen")
def check_new_head_frozen(setup: Setup) -> list[Finding]:
    """Freshly initialised layers that PEFT leaves frozen: they stay random through training."""
    model, cfg = setup.model, setup.peft_config
    wrapped = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    if not wrapped and cfg is None:
        return []
    base = setup.base_model
    new = _new_modules(base)
    if not new:
        return []
    findings = []
    for name, module, severity in new:
        short = name.rsplit(".", 1)[-1]
        if wrapped:
            frozen = not any(p.requires_grad for p in module.parameters())
            saved = set()
            for c in getattr(model, "peft_config", {}).values():
                saved |= set(getattr(c, "modules_to_save", None) or [])
            task = next((str(getattr(c, "task_type", "")) for c in getattr(model, "peft_config", {}).values()), "")
        else:
            get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)
            saved = set(get("modules_to_save") or [])
            task = str(get("task_type") or "")
            saved |= set(_PEFT_HEADS.get(task.rsplit(".", 1)[-1], ()))
            frozen = short not in saved and name not in saved
        if not frozen:
            continue
        size = sum(p.numel() for p in module.parameters())
        arch = getattr(base.config, "architectures", None)
        origin = (f"the checkpoint was saved from {', '.join(arch)}, not {type(base).__name__}, so the loader "
                  "initialised it at random" if arch else "it is not part of the pretrained backbone")
        kind = {"SEQ_CLS", "TaskType.SEQ_CLS"}
        hint = "" if task in kind else " (or task_type='SEQ_CLS' / 'TOKEN_CLS', which adds classifier/score)"
        findings.append(Finding(
            "new-head-frozen", severity,
            f"layer '{name}' ({type(module).__name__}, {size:,} values) is newly initialised ({origin}) and under "
            f"PEFT it is neither trainable nor in modules_to_save (task_type {task or 'None'}): it stays random, so "
            "predictions are noise whatever the adapters learn (and it is not saved with them)",
            f"add it to the LoRA config: modules_to_save=['{short}']{hint}", f"layer '{name}'"))
    return findings


# ----------------------------------------------------------------------------------------------- turn-end-masked


@register("turn-end-masked")
def check_turn_end_masked(setup: Setup) -> list[Finding]:
    """The chat template's end-of-turn token right after a trained answer has label -100: the model never learns
    to end its turn (generation runs on into a new turn)."""
    import torch

    tok = setup_tokenizer(setup)
    term = turn_terminator(tok)
    eos, _ = special_ids(setup)
    if term is None or term[0] == eos:
        return []  # the terminator is EOS: eos-masked checks it
    tid, text = term
    hits: list[tuple[int, int]] = []
    labels = dict(train_values(setup, "labels")[0])
    scope = "train_dataset"
    if labels:
        for i, ids in train_values(setup, "input_ids")[0]:
            lab = labels.get(i)
            if not isinstance(ids, list) or not isinstance(lab, list) or len(lab) != len(ids):
                continue
            hits += [(i, j) for j in range(1, len(ids))
                     if ids[j] == tid and lab[j] == IGNORE_INDEX and lab[j - 1] != IGNORE_INDEX]
    else:
        batch, err = setup.batch()
        if err is not None or not isinstance(batch, Mapping):
            return []
        ids, lab = batch.get("input_ids"), batch.get("labels")
        if not isinstance(ids, torch.Tensor) or not isinstance(lab, torch.Tensor) or ids.shape != lab.shape:
            return []
        rows = _batch_rows(setup)
        scope = "the dry-run batch (labels built by " + collator_name(setup) + ")"
        for r in range(ids.shape[0]):
            a, b = ids[r].tolist(), lab[r].tolist()
            hits += [(rows[r] if r < len(rows) else r, j) for j in range(1, len(a))
                     if a[j] == tid and b[j] == IGNORE_INDEX and b[j - 1] != IGNORE_INDEX]
    if not hits:
        return []
    rows_hit = sorted({i for i, _ in hits})
    i, j = hits[0]
    return [Finding(
        "turn-end-masked", "error",
        f"the chat template ends each assistant turn with {text!r} (id {tid}), and in {len(hits)} places in "
        f"{rows_text(rows_hit)} of {scope} it has label -100 right after a trained answer (first: row {i}, position "
        f"{j}): the model never learns to end its turn, so at inference it runs on into a new turn",
        f"train the terminator as part of each answer: the supervised span must cover the assistant text plus "
        f"{text!r} (surefit's sft encoding does; with TRL use assistant_only_loss with a template whose "
        f"{{% generation %}} block includes {text!r}, or a completion that ends with it). Appending EOS does not fix "
        f"this: the model ends turns with {text!r}, not EOS, and generation stops there",
        f"train_dataset row {i}, position {j}" if labels else f"batch key 'labels', row {i} position {j}")]

