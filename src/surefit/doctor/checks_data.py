"""The doctor's checks on the data as the model will see it: labels, padding, EOS, the dry run's items and batch.

Codes: ``labels-not-padded``, ``ragged-batch``, ``eos-masked``, ``eos-missing``, ``no-supervised-tokens``,
``labels-preshifted``, ``label-out-of-range``, ``label-dtype``, ``label-not-numeric``, ``label-one-hot``,
``no-labels``, ``dataset-item-failed``, ``collate-failed``.

Whole columns are scanned where that is cheap (lists of dicts and ``datasets`` columns, up to :data:`SCAN_ROWS` rows
per split); otherwise the dry run's samples stand for the dataset. Collation problems are decided by what the
collator does with the dry run's items (and, to find the cause, with the same items less their ``labels``), never by
the collator's class name alone. A failure that a specific code explains is reported once, under that code.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from surefit.doctor.core import REGISTRY, Finding, Setup, describe, register
from surefit.doctor.patterns import codes_in

IGNORE_INDEX = -100
SCAN_ROWS = 20_000  # rows read per split and column by the whole-dataset scans
PRESHIFT_ROWS = 64  # rows compared position by position for labels-preshifted
LABEL_KEYS = ("labels", "label", "label_ids")
_PREFIX = "checks_data."
_PAD_FIX = ("use DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100) or surefit's PadCollator, which pad "
            "labels with -100")
_RAGGED_TEXT = re.compile(r"expected sequence of length|stack expects each tensor|equal size|Unable to create tensor|"
                          r"must match the size|Sizes of tensors must match", re.IGNORECASE)


# ------------------------------------------------------------------------------------------------------------ helpers


def _cached(setup: Setup, key: str, compute: Callable[[], Any]) -> Any:
    """Compute once per setup, in the setup's shared cache under this module's prefix."""
    cache = setup._cache
    if _PREFIX + key not in cache:
        cache[_PREFIX + key] = compute()
    return cache[_PREFIX + key]


def _py(value: Any) -> Any:
    """Tensors and arrays as plain Python values; anything else unchanged."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple, str, bytes)):
        return value.tolist()
    return value


def _is_seq(value: Any) -> bool:
    """A per-position sequence (list, tuple, tensor or array with at least one dimension), not text."""
    if isinstance(value, (list, tuple)):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) >= 1


def _is_int(x: Any) -> bool:
    """An integer (bools count: they become 0/1 ids); values read through :func:`_py` are plain Python."""
    return isinstance(x, int)


def _first_line(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip()
    line = text.splitlines()[0] if text else ""
    line = line[: limit - 3] + "..." if len(line) > limit else line.rstrip(".")
    return f"{type(err).__name__}: {line}"


def rows_text(rows: list[int], limit: int = 5, noun: str = "row") -> str:
    """``"row 3"``, ``"rows 2, 4"``, ``"rows 0, 1, 2, 3, 4 and 7 more"``."""
    shown = ", ".join(str(r) for r in rows[:limit])
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return f"{noun}{'s' if len(rows) != 1 else ''} {shown}{more}"


def setup_tokenizer(setup: Setup) -> Any:
    """The setup's tokenizer, or the one the collator carries (``explain()`` is often called without one)."""
    if setup.tokenizer is not None:
        return setup.tokenizer
    c = setup.data_collator
    return getattr(c, "tokenizer", None) or getattr(c, "processing_class", None)


def special_ids(setup: Setup) -> tuple[int | None, int | None]:
    """``(eos_token_id, pad_token_id)`` from the tokenizer, else the model config (first id when a list)."""
    tok, cfg = setup_tokenizer(setup), setup.config
    out = []
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(tok, name, None) if tok is not None else None
        if value is None and cfg is not None:
            value = getattr(cfg, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        out.append(value if isinstance(value, int) else None)
    return out[0], out[1]


def _generation_eos(setup: Setup) -> set[int]:
    """The ids that end generation in the model's generation config (chat models often list an end-of-turn id)."""
    ids = getattr(getattr(setup.model, "generation_config", None), "eos_token_id", None)
    ids = ids if isinstance(ids, (list, tuple)) else [ids]
    return {i for i in ids if isinstance(i, int)}


def collator_name(setup: Setup) -> str:
    c = setup.data_collator
    if c is None:
        return "torch's default collate (data_collator=None)"
    c = getattr(c, "func", c)  # functools.partial
    if inspect.isfunction(c) or inspect.ismethod(c) or inspect.isbuiltin(c):
        return getattr(c, "__name__", "the collator")
    return type(c).__name__


def collator_where(setup: Setup) -> str:
    if setup.data_collator is None:
        return "data_collator=None (torch's default collate)"
    return f"data_collator ({collator_name(setup)})"


def is_lm_collator(setup: Setup) -> bool:
    c = setup.data_collator
    return c is not None and any(k.__name__ == "DataCollatorForLanguageModeling" for k in type(c).__mro__)


def model_kind(setup: Setup) -> str:
    """``"seq-cls"``, ``"token-cls"``, ``"causal"``, ``"seq2seq"`` or ``"other"``."""
    name = type(setup.base_model).__name__
    if name.endswith("ForTokenClassification"):
        return "token-cls"
    if name.endswith("ForSequenceClassification") or setup.task == "classify":
        return "seq-cls"
    if setup.is_causal_lm:
        return "causal"
    if getattr(setup.config, "is_encoder_decoder", False):
        return "seq2seq"
    return _cached(setup, "head-kind", lambda: _head_kind(setup))


def _head_kind(setup: Setup) -> str:
    """The kind of a model no class name tells (a user's ``nn.Module``), from the shape of its logits.

    ``[B, C]`` is one prediction per row (a sequence classifier or regressor); ``[B, T, C]`` with ``T`` the
    length of ``input_ids`` is one per token: a language model when ``C`` is the vocabulary, else a token
    classifier.
    """
    import torch

    try:
        logits = setup.logits()
    except Exception:  # noqa: BLE001 - no forward, no kind
        return "other"
    if not isinstance(logits, torch.Tensor):
        return "other"
    batch, _ = setup.batch()
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if logits.dim() == 2:
        return "seq-cls"
    if logits.dim() == 3 and isinstance(ids, torch.Tensor) and ids.dim() == 2 and logits.shape[1] == ids.shape[1]:
        vocab = getattr(setup.config, "vocab_size", None)
        emb = getattr(setup.base_model, "get_input_embeddings", None)
        try:
            rows = getattr(emb(), "num_embeddings", None) if callable(emb) else None
        except (NotImplementedError, AttributeError):
            rows = None
        if rows is None:  # a plain module: a language model scores every row of one of its embeddings
            from torch import nn

            rows = next((m.num_embeddings for m in setup.model.modules()
                         if isinstance(m, nn.Embedding) and m.num_embeddings == logits.shape[-1]), None)
        return "causal" if logits.shape[-1] in {vocab, rows} - {None} else "token-cls"
    return "other"


def _splits(setup: Setup) -> list[tuple[str, Any]]:
    """``[(name, dataset)]`` for the training set and every evaluation set (a dict of eval sets unfolded)."""
    out: list[tuple[str, Any]] = []
    if setup.train_dataset is not None:
        out.append(("train_dataset", setup.train_dataset))
    ev = setup.eval_dataset
    if isinstance(ev, Mapping):
        out += [(f"eval_dataset[{k!r}]", v) for k, v in ev.items() if v is not None and not isinstance(v, str)]
    elif ev is not None:
        out.append(("eval_dataset", ev))
    return out


def _column(setup: Setup, ds: Any, key: str) -> tuple[list[Any], bool] | None:
    """``(values, truncated)`` of one column of a list of dicts or a ``datasets`` dataset, or ``None``."""

    def compute() -> tuple[list[Any], bool] | None:
        keep = setup.kept_columns()
        if keep is not None and key not in keep:
            return None  # the trainer drops this column before collating: the model never sees it
        if isinstance(ds, (list, tuple)):
            if not ds or not all(isinstance(r, Mapping) for r in ds[:8]):
                return None
            if not any(key in r for r in ds[:8]):
                return None
            rows = ds[:SCAN_ROWS]
            return [_py(r.get(key)) if isinstance(r, Mapping) else None for r in rows], len(ds) > SCAN_ROWS
        names = getattr(ds, "column_names", None)
        if not isinstance(names, (list, tuple)) or key not in names:
            return None
        try:
            n = Setup.length(ds) or 0
            sub = ds.select(range(SCAN_ROWS)) if n > SCAN_ROWS else ds
            if hasattr(sub, "select_columns"):
                sub = sub.select_columns([key])
            if hasattr(sub, "with_format"):
                sub = sub.with_format(None)
            return [_py(v) for v in sub[:][key]], n > SCAN_ROWS
        except Exception:  # noqa: BLE001 - an unreadable column: the dry run's samples stand in
            return None

    return _cached(setup, f"column:{id(ds)}:{key}", compute)


def train_values(setup: Setup, key: str) -> tuple[list[tuple[int, Any]], str]:
    """``[(row, value)]`` of ``key`` over the training set (whole column if cheap, else the samples) and the scope."""
    col = _column(setup, setup.train_dataset, key) if setup.train_dataset is not None else None
    if col is not None:
        values, truncated = col
        scope = f"the first {len(values)} rows" if truncated else f"all {len(values)} rows"
        return [(i, v) for i, v in enumerate(values) if v is not None], scope
    items, _ = setup.samples()
    out = [(i, _py(it[key])) for i, it in items if isinstance(it, Mapping) and key in it]
    return out, f"the {len(items)} sampled rows"


def _collate(setup: Setup, items: list[Any]) -> tuple[Any, Exception | None]:
    """Collate some items with the setup's collator (for probes; the dry-run batch itself is ``setup.batch()``)."""
    try:
        return setup.collator(items), None
    except Exception as e:  # noqa: BLE001 - the caller decides what the failure means
        return None, e


def _offset(row: list[int], ids: list[int]) -> int | None:
    """Where an item's ``ids`` sit in its padded batch row (right or left padding), or ``None``."""
    n = len(ids)
    if n > len(row):
        return None
    if row[:n] == ids:
        return 0
    if row[len(row) - n:] == ids:
        return len(row) - n
    return None


def _shape(value: Any) -> tuple[int, ...] | None:
    """The shape default collate would need to agree across items; ``None`` for what it cannot stack anyway."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (list, tuple)):
        return tuple(int(s) for s in shape)
    if isinstance(value, (list, tuple)):
        nested = bool(value) and (isinstance(value[0], (list, tuple)) or hasattr(value[0], "shape"))
        return (len(value),) + ((_shape(value[0]) or ()) if nested else ())
    if isinstance(value, (int, float, bool)):
        return ()
    return None


def _fields(item: Any) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return dict(item)
    if isinstance(item, (list, tuple)):
        return {f"item[{i}]": v for i, v in enumerate(item)}
    return {"item": item}


def _explained(setup: Setup, fn: Callable[[Setup], list[Finding]]) -> list[Finding]:
    try:
        return fn(setup)
    except Exception:  # noqa: BLE001 - a crashing check explains nothing
        return []


# --------------------------------------------------------------------------------- labels-not-padded, ragged-batch


def _labels_not_padded(setup: Setup) -> list[Finding]:
    return _cached(setup, "labels-not-padded", lambda: _find_labels_not_padded(setup))


def _find_labels_not_padded(setup: Setup) -> list[Finding]:
    items = setup.batch_items()
    if not items or not all(isinstance(it, Mapping) for it in items):
        return []
    key = next((k for k in ("labels", "label") if k in items[0] and _is_seq(items[0][k])), None)
    kind = model_kind(setup)
    if key is None or kind == "seq-cls":
        return []  # sequence classifiers take one label (or one fixed-size vector) per row
    labels = [_py(it.get(key, [])) for it in items]
    if not all(isinstance(lab, list) for lab in labels):
        return []
    aligned = kind != "seq2seq" and all("input_ids" in it for it in items)
    rows = [i for i, _ in setup.samples()[0]][: len(items)]  # dataset row of each batch row
    lengths = [len(lab) for lab in labels]
    mismatch = [(rows[r], len(lab), len(_py(it["input_ids"])))
                for r, (it, lab) in enumerate(zip(items, labels, strict=True))
                if aligned and len(lab) != len(_py(it["input_ids"]))]
    ragged = len(set(lengths)) > 1
    if not ragged and all(isinstance(x, float) for lab in labels for x in lab[:8]):
        return []  # one fixed-width float vector per row (multi-label targets), not per-token ids
    if mismatch and kind == "token-cls":
        return []  # word-level tags against sub-word tokens: token-labels-misaligned names that cause
    probe, (batch, err) = items, setup.batch()
    if not ragged and not mismatch:
        col = _column(setup, setup.train_dataset, key) if setup.train_dataset is not None else None
        col_lengths = [(len(v), i) for i, v in enumerate(col[0]) if isinstance(v, list)] if col else []
        if len({n for n, _ in col_lengths}) <= 1:
            return _labels_replaced(setup, items, batch, err, key)
        rows = [min(col_lengths)[1], max(col_lengths, key=lambda t: (t[0], -t[1]))[1]]  # the sample happens to agree; these two do not
        try:
            probe = [setup.item(setup.train_dataset, i) for i in rows]
        except Exception:  # noqa: BLE001 - unreadable items are dataset-item-failed's business
            return []
        batch, err = _collate(setup, probe)
        lengths = [len(_py(p.get(key, []))) for p in probe]
        ragged = True
    if err is None and _labels_ok(batch, key, aligned):
        return _labels_replaced(setup, probe, batch, err, key)
    stripped = [{k: v for k, v in it.items() if k != key} for it in probe]
    if _collate(setup, stripped)[1] is not None:
        return []  # collation fails without the labels too: ragged-batch or collate-failed says why
    if not mismatch and _collate(setup, [probe[0], probe[0]])[1] is not None:
        return []  # the labels fail even at one length (e.g. strings): not a padding problem
    name, where = collator_name(setup), f"{collator_where(setup)}, key '{key}'"
    fix = _PAD_FIX
    if kind == "token-cls":
        fix = "use DataCollatorForTokenClassification(tokenizer) or surefit's PadCollator, which pad labels with -100"
    lm = (" DataCollatorForLanguageModeling would also overwrite the labels with a copy of input_ids, discarding a "
          "prompt mask (-100 over the prompt)." if is_lm_collator(setup) else "")
    outcome = (f"collation fails: {_first_line(err)}" if err is not None else
               f"the batch's `{key}` comes out as {describe(_batch_value(batch, key))}, not a tensor lined up with "
               "input_ids")
    if mismatch and not ragged:
        row, n_lab, n_ids = mismatch[0]
        return [Finding("labels-not-padded", "error",
                        f"row {row}: `{key}` has {n_lab} entries but `input_ids` has {n_ids}, so {name} cannot line "
                        f"them up and {outcome}",
                        f"build labels with one entry per input token (-100 where there is no loss), then {fix}", where)]
    short, long_ = lengths.index(min(lengths)), lengths.index(max(lengths))
    pads = (" (it pads only what the tokenizer pads: input_ids, attention_mask)"
            if hasattr(setup.data_collator, "tokenizer") else "")
    also = ""
    if mismatch:
        row, n_lab, n_ids = mismatch[0]
        also = f" Row {row} also has {n_lab} `{key}` for {n_ids} input_ids."
        fix = f"build labels with one entry per input token (-100 on padding and where there is no loss), then {fix}"
    return [Finding("labels-not-padded", "error",
                    f"the items carry pre-built per-token `{key}` of different lengths (row {rows[short]}: "
                    f"{lengths[short]} tokens, row {rows[long_]}: {lengths[long_]}) and {name} does not pad `{key}`"
                    f"{pads}, so {outcome}.{lm}{also}", fix + (" (keep the labels you built)" if lm else ""), where)]


def _batch_value(batch: Any, key: str) -> Any:
    if not isinstance(batch, Mapping):
        return batch
    return batch.get(key, batch.get("labels"))


def _labels_ok(batch: Any, key: str, aligned: bool) -> bool:
    """The collated labels are one padded tensor (lined up with ``input_ids`` where they must be)."""
    import torch

    if not isinstance(batch, Mapping):
        return True  # not a dict batch: nothing to say about labels here
    if key not in batch and "labels" not in batch:
        return True  # dropped: no-labels says so
    value = _batch_value(batch, key)
    if not isinstance(value, torch.Tensor):
        return False
    ids = batch.get("input_ids")
    if aligned and isinstance(ids, torch.Tensor):
        return tuple(value.shape) == tuple(ids.shape)
    return True


def _labels_replaced(setup: Setup, items: list[Mapping], batch: Any, err: Exception | None,
                     key: str) -> list[Finding]:
    """A collator that overwrites the items' own labels, training positions the data masks with -100."""
    import torch

    if err is not None or not isinstance(batch, Mapping):
        return []
    lab, ids = batch.get("labels"), batch.get("input_ids")
    if not isinstance(lab, torch.Tensor) or not isinstance(ids, torch.Tensor) or lab.shape != ids.shape:
        return []
    trained, example = 0, None
    for r, it in enumerate(items):
        own, row_ids = _py(it.get(key)), _py(it.get("input_ids"))
        if not isinstance(own, list) or not isinstance(row_ids, list) or len(own) != len(row_ids):
            continue
        off = _offset(ids[r].tolist(), row_ids)
        if off is None:
            continue
        got = lab[r, off:off + len(own)].tolist()
        n = sum(1 for a, b in zip(own, got, strict=True) if a == IGNORE_INDEX and b != IGNORE_INDEX)
        trained += n
        if n and example is None:
            example = r
    if not trained:
        return []
    name = collator_name(setup)
    return [Finding("labels-not-padded", "error",
                    f"{name} replaces the items' pre-built `{key}` with its own (a copy of input_ids): {trained} "
                    f"positions the data masks with -100 (e.g. the prompt of batch row {example}) are trained, so the "
                    "prompt mask is discarded and the model learns to reproduce prompts",
                    _PAD_FIX + " (they keep the labels you built)", f"{collator_where(setup)}, key '{key}'")]


@register("labels-not-padded", "ragged-batch")
def check_padding(setup: Setup) -> list[Finding]:
    """Per-token labels the collator does not pad (the seeds' crash), or items of different lengths with no padding."""
    found = _labels_not_padded(setup)
    return found or _ragged_batch(setup)


def _ragged_batch(setup: Setup) -> list[Finding]:
    return _cached(setup, "ragged-batch", lambda: _find_ragged_batch(setup))


def _find_ragged_batch(setup: Setup) -> list[Finding]:
    if _labels_not_padded(setup):
        return []
    items = setup.batch_items()
    if not items:
        return []
    fields = [_fields(it) for it in items]
    ragged: dict[str, list[tuple[int, ...]]] = {}
    for k in fields[0]:
        shapes = [_shape(f.get(k)) for f in fields]
        if all(s is not None for s in shapes) and len(set(shapes)) > 1:
            ragged[k] = shapes  # type: ignore[assignment]
    batch, err = setup.batch()
    scope = "the dry run's items"
    if not ragged and setup.data_collator is None and setup.train_dataset is not None:
        col = _column(setup, setup.train_dataset, "input_ids")
        lengths = sorted({len(v) for v in col[0] if isinstance(v, list)}) if col else []
        if len(lengths) > 1:
            ragged["input_ids"] = [(n,) for n in lengths]
            scope = "the dataset's rows"
    if not ragged:
        return []
    if setup.data_collator is not None and (err is None or not _RAGGED_TEXT.search(str(err))
                                            or _collate(setup, [items[0], items[0]])[1] is not None):
        return []  # the collator pads, or fails for another reason (even on items of one length)
    name = collator_name(setup)
    parts = "; ".join(f"'{k}' has shapes {', '.join(str(list(s)) for s in sorted(set(v))[:4])}"
                      for k, v in ragged.items())
    crash = f": {_first_line(err)}" if err is not None else " (later batches will crash)"
    has_labels = any(_is_seq(f.get(k)) for f in fields for k in LABEL_KEYS)
    fix = ("pass a padding collator: " + (_PAD_FIX[4:] if has_labels else
           "DataCollatorWithPadding(tokenizer) (or surefit's PadCollator)") +
           "; or pad every item to one length when tokenizing (padding='max_length', max_length=N)")
    return [Finding("ragged-batch", "error",
                    f"{name} stacks items as they are, but in {scope} they differ in length ({parts}), so they "
                    f"cannot be stacked into one tensor{crash}", fix, f"{collator_where(setup)}, keys "
                    + ", ".join(repr(k) for k in ragged))]


# ------------------------------------------------------------------------------------------------------------ EOS


def turn_terminator(tok: Any) -> tuple[int, str] | None:
    """The token the chat template puts right after an assistant message's text (``<|im_end|>``, ``<|eot_id|>``,
    ``<end_of_turn>``...), when it is a special token; ``None`` without a template."""
    if tok is None or not getattr(tok, "chat_template", None) or not hasattr(tok, "apply_chat_template"):
        return None
    answer = "zq"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}],
                                       tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this has no terminator to check
        return None
    at = text.rfind(answer)
    suffix = text[at + len(answer):] if at >= 0 else ""
    if not suffix.strip():
        return None
    ids = tok(suffix.lstrip(" "), add_special_tokens=False)["input_ids"]
    if not ids:
        return None
    special = set(getattr(tok, "all_special_ids", []) or []) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    if ids[0] not in special:
        return None
    return ids[0], tok.convert_ids_to_tokens(ids[0])



@register("eos-masked")
def check_eos_masked(setup: Setup) -> list[Finding]:
    """Real EOS tokens whose label is -100 right after trained tokens: the model never learns to stop."""
    import torch

    eos, pad = special_ids(setup)
    batch, err = setup.batch()
    if eos is None or err is not None or not isinstance(batch, Mapping) or _preshifted(setup):
        return []  # pre-shifted labels move the EOS label one place left: labels-preshifted explains it
    ids, lab = batch.get("input_ids"), batch.get("labels")
    if not isinstance(ids, torch.Tensor) or not isinstance(lab, torch.Tensor) or ids.shape != lab.shape \
            or ids.dim() != 2:
        return []
    items = setup.batch_items()
    hits: list[tuple[int, int, Any]] = []
    for r, it in enumerate(items[: ids.shape[0]]):
        if not isinstance(it, Mapping) or "input_ids" not in it:
            continue
        row_ids = _py(it["input_ids"])
        off = _offset(ids[r].tolist(), row_ids) if isinstance(row_ids, list) else None
        if off is None:
            continue
        own = _py(it.get("labels"))
        own = own if isinstance(own, list) and len(own) == len(row_ids) else None
        mask = _py(it.get("attention_mask"))
        real = mask if isinstance(mask, list) and len(mask) == len(row_ids) else [1] * len(row_ids)
        got = lab[r].tolist()
        for j in range(1, len(row_ids)):
            if row_ids[j] == eos and real[j] and got[off + j] == IGNORE_INDEX and got[off + j - 1] != IGNORE_INDEX:
                hits.append((r, j, own[j] if own else None))
    if not hits:
        return []
    r, j, own_label = hits[0]
    name = collator_name(setup)
    rows = sorted({h[0] for h in hits})
    what = (f"{len(hits)} real EOS token{'s' if len(hits) != 1 else ''} (id {eos}) in batch {rows_text(rows)} "
            f"have label -100 right after trained tokens: the model never learns to stop")
    if own_label == IGNORE_INDEX:
        cause = ("; the items' own labels already hold -100 there (labels built by masking every token equal to the "
                 f"pad id{', and pad == eos' if pad == eos else ''})")
        fix = ("keep the EOS label (labels[i] = eos id at the end of each target) and mask padding by position, "
               "never by comparing token ids with the pad id")
    elif pad == eos:
        cause = (f"; the tokenizer's pad token is its EOS (id {eos}) and {name} set these labels to -100: it masks "
                 "every position where input_ids == pad id, which also hits the real EOS")
        fix = (f"build labels when tokenizing (EOS kept) and {_PAD_FIX} by position; or give "
               "the tokenizer a pad token distinct from EOS (tokenizer.add_special_tokens({'pad_token': '<pad>'}) "
               "and model.resize_token_embeddings(len(tokenizer)))")
    else:
        cause = f"; {name} sets their labels to -100"
        fix = "keep the label of the final EOS (mask padding by position with -100, not EOS)"
    return [Finding("eos-masked", "error", what + cause, fix, f"batch key 'labels', row {r} position {j}")]


@register("eos-missing")
def check_eos_missing(setup: Setup) -> list[Finding]:
    """Causal-LM training sequences that do not end with EOS."""
    eos, pad = special_ids(setup)
    if not setup.is_causal_lm or eos is None or setup.train_dataset is None:
        return []
    values, scope = train_values(setup, "input_ids")
    masks = dict(train_values(setup, "attention_mask")[0])
    # chat rows end with the template's turn terminator (and maybe a newline after it): that is their end
    term = turn_terminator(setup_tokenizer(setup))
    ends_turn = set() if term is None else {term[0]}
    # A chat template ends a turn with its own token (Gemma's <end_of_turn>); the generation config lists it.
    stops = {eos} | _generation_eos(setup)
    missing: list[int] = []
    packed = total = 0
    ends: list[int] = []
    labels = dict(train_values(setup, "labels")[0])
    for i, ids in values:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids[:1]):
            continue
        lab = labels.get(i)
        if isinstance(lab, list) and len(lab) == len(ids) and eos in ids and lab[ids.index(eos)] != IGNORE_INDEX:
            total += 1
            continue  # EOS labelled at its first occurrence (pad == eos, padded to max_length): the model sees the end
        mask = masks.get(i)
        if isinstance(mask, list) and len(mask) == len(ids) and 0 in mask:
            ids = [t for t, m in zip(ids, mask, strict=True) if m]
        elif pad is not None and pad != eos:
            while ids and ids[-1] == pad:
                ids = ids[:-1]
        if not ids:
            continue
        total += 1
        if ends_turn and (ids[-1] in ends_turn or (len(ids) > 1 and ids[-2] in ends_turn)):
            continue
        if ids[-1] not in stops:
            missing.append(i)
            ends.append(ids[-1])
            packed += eos in ids
    if not total or len(missing) * 2 <= total or packed * 2 >= len(missing):
        return []  # most rows end with EOS, or EOS separates packed documents inside the rows
    tok = setup_tokenizer(setup)
    label = f" ({tok.eos_token!r})" if getattr(tok, "eos_token", None) else ""
    sft = setup.task == "sft" or any(isinstance(v, list) and IGNORE_INDEX in v
                                     for _, v in train_values(setup, "labels")[0][:PRESHIFT_ROWS])
    return [Finding("eos-missing", "error" if sft else "warning",
                    f"{len(missing)} of {total} training sequences ({scope}) do not end with EOS (id {eos}{label}), "
                    f"e.g. {rows_text(missing)} (row {missing[0]} ends with token {ends[0]}): the model never sees "
                    "where a sequence stops, so generation runs on to the length limit",
                    "append tokenizer.eos_token_id to input_ids when tokenizing (and keep it in labels, not -100), "
                    "e.g. ids = tokenizer(text)['input_ids'] + [tokenizer.eos_token_id]",
                    "train_dataset column 'input_ids'")]


# ------------------------------------------------------------------------------------------------ token labels


def _token_label_rows(setup: Setup, ds: Any, split: str) -> tuple[list[tuple[int, list]], str] | None:
    """Per-token label lists of one split (``None`` when it has none or cannot be scanned)."""
    if split == "train_dataset":
        values, scope = train_values(setup, "labels")
    else:
        col = _column(setup, ds, "labels")
        if col is None:
            return None
        values = list(enumerate(col[0]))
        scope = f"the first {len(col[0])} rows" if col[1] else f"all {len(col[0])} rows"
    rows = [(i, v) for i, v in values if isinstance(v, list) and all(_is_int(t) for t in v[:4])]
    return (rows, scope) if rows else None


@register("no-supervised-tokens")
def check_no_supervised(setup: Setup) -> list[Finding]:
    """Rows (or a whole collated batch) whose labels are all -100: nothing to learn, NaN loss."""
    import torch

    if model_kind(setup) == "seq-cls":
        return []
    findings: list[Finding] = []
    train_rows_flagged = False
    for split, ds in _splits(setup):
        got = _token_label_rows(setup, ds, split)
        if got is None:
            continue
        rows, scope = got
        empty = [i for i, v in rows if all(t == IGNORE_INDEX for t in v)]
        if not empty:
            continue
        train_rows_flagged |= split == "train_dataset"
        findings.append(Finding(
            "no-supervised-tokens", "error",
            f"{len(empty)} of {len(rows)} rows of {split} ({scope}) {'has' if len(empty) == 1 else 'have'} no "
            "supervised token (every label is -100), "
            f"e.g. {rows_text(empty)}: they teach nothing, and a batch made only of them has loss 0/0 = NaN",
            "the target was probably truncated away or masked with the prompt: truncate the prompt, not the answer "
            "(or raise max_length), check the prompt mask, and drop rows whose labels are all -100",
            f"{split} column 'labels', row {empty[0]}"))
    if not train_rows_flagged:
        batch, err = setup.batch()
        lab = batch.get("labels") if err is None and isinstance(batch, Mapping) else None
        if isinstance(lab, torch.Tensor) and lab.dim() >= 2 and not lab.is_floating_point() and lab.numel() \
                and bool((lab == IGNORE_INDEX).all()):
            name = collator_name(setup)
            findings.append(Finding(
                "no-supervised-tokens", "error",
                f"the collated batch ({describe(lab)}) from {name} has no supervised token: every label is -100, "
                "so its loss is 0/0 = NaN",
                f"check what {name} masks: the response template or pad id it searches for must occur in the "
                "tokenized text, and labels must keep the answer tokens", "batch key 'labels'"))
    return findings


@register("labels-preshifted")
def check_preshifted(setup: Setup) -> list[Finding]:
    """Labels already shifted left by one for a causal LM, which shifts them itself."""
    return _preshifted(setup)


def _preshifted(setup: Setup) -> list[Finding]:
    return _cached(setup, "labels-preshifted", lambda: _find_preshifted(setup))


def _find_preshifted(setup: Setup) -> list[Finding]:
    if not setup.is_causal_lm or setup.train_dataset is None:
        return []
    labels = dict(train_values(setup, "labels")[0][:PRESHIFT_ROWS])
    if not labels:
        return []
    ids_by_row = dict(train_values(setup, "input_ids")[0][:PRESHIFT_ROWS])
    n = shifted = same = 0
    example = None
    for i, lab in labels.items():
        ids = ids_by_row.get(i)
        if not isinstance(lab, list) or not isinstance(ids, list):
            continue
        row_shifted = 0
        for p in range(min(len(lab), len(ids) - 1)):
            if lab[p] == IGNORE_INDEX:
                continue
            n += 1
            row_shifted += lab[p] == ids[p + 1]
            same += lab[p] == ids[p]
        shifted += row_shifted
        if row_shifted and example is None:
            example = i
    if n < 4 or shifted < 0.9 * n or same >= 0.5 * n or example is None:
        return []
    ids, lab = ids_by_row[example], labels[example]
    return [Finding("labels-preshifted", "error",
                    f"labels equal input_ids shifted left by one in {shifted} of {n} supervised positions (row "
                    f"{example}: input_ids starts {ids[:5]}, labels {lab[:5]}); {type(setup.base_model).__name__} "
                    "shifts labels itself, so it would learn to predict the token two places ahead",
                    "give labels lined up with input_ids (labels[i] = input_ids[i], -100 where there is no loss); "
                    "the model does the shift", f"train_dataset column 'labels', row {example}")]


# ----------------------------------------------------------------------------------------------- class labels


def _class_info(setup: Setup) -> tuple[int | None, str | None, bool]:
    """``(num_labels, problem_type, has_config)`` of a classifier; num_labels from the logits when no config says."""
    cfg = setup.config
    if cfg is not None and hasattr(cfg, "num_labels"):
        return int(cfg.num_labels), getattr(cfg, "problem_type", None), True
    n = getattr(setup.base_model, "num_labels", None)
    if n is None:
        logits = setup.logits()  # from a forward without labels: the labels may be what fails
        shape = getattr(logits, "shape", None)
        n = int(shape[-1]) if shape is not None and len(shape) >= 2 else None
    return n, None, False


def _label_scans(setup: Setup) -> list[tuple[str, str, list[tuple[int, Any]], str]]:
    """``(split, key, [(row, value)], scope)`` of the label column of every split that has one."""

    def compute() -> list[tuple[str, str, list[tuple[int, Any]], str]]:
        out = []
        for split, ds in _splits(setup):
            for key in LABEL_KEYS:
                if split == "train_dataset":
                    values, scope = train_values(setup, key)
                    if not values:
                        continue
                else:
                    col = _column(setup, ds, key)
                    if col is None:
                        continue
                    values = [(i, v) for i, v in enumerate(col[0]) if v is not None]
                    scope = f"the first {len(col[0])} rows" if col[1] else f"all {len(col[0])} rows"
                out.append((split, key, values, scope))
                break
        return out

    return _cached(setup, "label-scans", compute)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, str)]
    return []


@register("label-not-numeric")
def check_label_not_numeric(setup: Setup) -> list[Finding]:
    """String labels that would reach tensors."""
    findings = []
    for split, key, values, scope in _label_scans(setup):
        bad = [(i, s) for i, v in values for s in _strings(v)[:1]]
        if not bad:
            continue
        names = sorted({s for i, v in values for s in _strings(v)})
        label2id = getattr(setup.config, "label2id", None) or {}
        if not set(names) <= set(label2id):
            label2id = {s: n for n, s in enumerate(names)}
        table = ", ".join(f"{s!r}: {n}" for s, n in list(label2id.items())[:6]) + (", ..." if len(label2id) > 6 else "")
        shown = ", ".join(repr(s) for s in names[:5]) + (", ..." if len(names) > 5 else "")
        per_token = any(isinstance(v, (list, tuple)) for _, v in values[:50])
        mapping = f"[label2id[t] for t in r['{key}']]" if per_token else f"label2id[r['{key}']]"
        encode = "" if per_token else f" (or ds.class_encode_column('{key}'))"
        findings.append(Finding(
            "label-not-numeric", "error",
            f"column '{key}' of {split} holds strings ({shown}) in {len(bad)} of {len(values)} rows ({scope}), e.g. "
            f"{rows_text([i for i, _ in bad])}: a tensor cannot hold them (collation fails with `too many "
            "dimensions 'str'` or `Unable to create tensor`)",
            f"map them to class ids with label2id = {{{table}}}: ds = ds.map(lambda r: {{'{key}': {mapping}}}){encode},"
            f" and build the model with num_labels={'len(label2id)' if per_token else len(label2id)}, id2label and "
            "label2id",
            f"{split} column '{key}', row {bad[0][0]}"))
    return findings


@register("label-out-of-range")
def check_label_range(setup: Setup) -> list[Finding]:
    """Class ids outside ``[0, num_labels)`` (including -1 and -100) for a sequence or token classifier."""
    kind = model_kind(setup)
    if kind not in ("seq-cls", "token-cls"):
        return []
    n, problem, _ = _class_info(setup)
    if n is None or problem in ("regression", "multi_label_classification") or n < 2:
        return []  # regression and multi-label targets are not class ids; num_labels=1 is label-dtype's case
    findings = []
    for split, key, values, scope in _label_scans(setup):
        bad: dict[int, list[int]] = {}
        for i, v in values:
            if kind == "seq-cls" and _is_int(v) and not isinstance(v, bool):
                if not 0 <= v < n:
                    bad.setdefault(int(v), []).append(i)
            elif kind == "token-cls" and isinstance(v, list):
                for t in v:
                    if _is_int(t) and t != IGNORE_INDEX and not 0 <= t < n:
                        bad.setdefault(int(t), []).append(i)
                        break
        if not bad:
            continue
        rows = sorted({i for r in bad.values() for i in r})
        listing = "; ".join(f"{v} in {rows_text(r, 3)}" for v, r in sorted(bad.items())[:5])
        notes = []
        if set(bad) - {IGNORE_INDEX}:
            notes.append("cross-entropy fails with `Target N is out of bounds` (on a GPU: a device-side assert)")
        if IGNORE_INDEX in bad:
            notes.append("-100 is not a class: the loss silently ignores those rows, so they train nothing (and a "
                         "batch of only such rows gives NaN)")
        high = max(bad)
        if kind == "token-cls":
            fix = "give tokens without a class label -100 (the loss ignores it), not -1 or another value"
        else:
            fix = ("drop unlabeled rows (-1 / -100 mark them, e.g. in GLUE test splits): ds = ds.filter(lambda r: "
                   f"0 <= r['{key}'] < {n})")
        if high >= n:
            fix = (f"if the data really has {high + 1} classes, build the model with num_labels={high + 1} (and "
                   f"id2label / label2id); otherwise remap the labels into 0..{n - 1}; " + fix)
        findings.append(Finding(
            "label-out-of-range", "error",
            f"column '{key}' of {split} has class ids outside [0, {n}) for a model with num_labels={n} in "
            f"{len(rows)} row{'s' if len(rows) != 1 else ''} ({scope}): {listing}; " + "; ".join(notes), fix,
            f"{split} column '{key}', row {rows[0]}"))
    return findings


def label_values(setup: Setup) -> tuple[str, str, list[tuple[int, Any]], str] | None:
    scans = [s for s in _label_scans(setup) if s[0] == "train_dataset"]
    return scans[0] if scans else None


def _batch_label_dtype(setup: Setup) -> str | None:
    """``"int"`` or ``"float"``: what the collated batch's labels are, else what the items' values are."""
    import torch

    batch, err = setup.batch()
    if err is None and isinstance(batch, Mapping):
        lab = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        if isinstance(lab, torch.Tensor):
            return "float" if lab.is_floating_point() else "int"
    scan = label_values(setup)
    if scan is None:
        return None
    flat = []
    for _, v in scan[2][:200]:
        flat += v if isinstance(v, list) else [v]
    if any(isinstance(x, str) for x in flat) or not flat:
        return None
    return "float" if any(isinstance(x, float) for x in flat) else "int"


@register("label-dtype")
def check_label_dtype(setup: Setup) -> list[Finding]:
    """Label dtype that does not fit the classifier's loss (float for cross-entropy, integer for BCE / regression)."""
    if model_kind(setup) != "seq-cls":
        return []
    n, problem, has_config = _class_info(setup)
    scan = label_values(setup)
    dtype = _batch_label_dtype(setup)
    if not has_config or n is None or scan is None or dtype is None:
        return []
    split, key, values, _ = scan
    vectors = [v for _, v in values if isinstance(v, list)]
    scalars = [v for _, v in values if not isinstance(v, list)]
    where = f"{split} column '{key}'"
    model = type(setup.base_model).__name__
    example = values[0][1] if values else None
    if problem is None and n == 1 and dtype == "int" and scalars:
        distinct = sorted({v for v in scalars if _is_int(v)})[:6]
        return [Finding("label-dtype", "error",
                        f"integer labels (values {distinct}) for {model} with num_labels=1: transformers treats "
                        "num_labels=1 as regression and trains them with MSELoss, so class ids become numbers to "
                        "approximate",
                        f"for classification build the model with num_labels={max(2, len(distinct))}; for regression "
                        "cast the labels to float and set problem_type='regression'", where)]
    if problem == "regression" and dtype == "int" and scalars:
        return [Finding("label-dtype", "warning",
                        f"integer labels (e.g. {example!r}) for problem_type='regression' (MSELoss): fine if they are "
                        "scores, wrong if they are class ids",
                        f"cast them to float for regression; for class ids use problem_type='single_label_"
                        f"classification' with num_labels={n if n > 1 else 'the number of classes'}", where)]
    if problem == "multi_label_classification":
        if scalars:
            return [Finding("label-dtype", "error",
                            f"one {dtype} label per row (e.g. {example!r}) but problem_type='multi_label_classification'"
                            f" trains BCEWithLogitsLoss on float multi-hot vectors of length {n}",
                            f"give each row a float vector of {n} 0/1 values, or use problem_type="
                            "'single_label_classification' for one class id per row", where)]
        if dtype == "int" and vectors:
            return [Finding("label-dtype", "error",
                            f"integer multi-hot labels (e.g. {example!r}) for problem_type='multi_label_classification':"
                            " BCEWithLogitsLoss needs float targets (`result type Float can't be cast to the desired "
                            "output type Long`)",
                            f"store the vectors as floats, e.g. ds = ds.map(lambda r: {{'{key}': [float(x) for x in "
                            f"r['{key}']]}}) or cast_column('{key}', Sequence(Value('float32')))", where)]
        return []
    single = problem == "single_label_classification" or (problem is None and n > 1)
    if single and dtype == "float" and scalars:
        integral = all(float(v).is_integer() for v in scalars if isinstance(v, (int, float)))
        loss = ("cross-entropy needs integer class ids (`expected target dtype to be Long`)"
                if problem == "single_label_classification" else
                "transformers takes float labels for multi-label targets (BCEWithLogitsLoss) and the shapes do not fit")
        return [Finding("label-dtype", "error",
                        f"float labels (e.g. {example!r}) for {model}, a {n}-class single-label classifier: {loss}",
                        (f"cast them to int: ds = ds.map(lambda r: {{'{key}': int(r['{key}'])}})" if integral else
                         "give integer class ids in [0, num_labels); for real-valued targets use num_labels=1 and "
                         "problem_type='regression'"), where)]
    return []


@register("label-one-hot")
def check_label_one_hot(setup: Setup) -> list[Finding]:
    """One-hot (or multi-hot) label vectors for a single-label cross-entropy."""
    if model_kind(setup) != "seq-cls":
        return []
    n, problem, has_config = _class_info(setup)
    scan = label_values(setup)
    if not has_config or n is None or n < 2 or scan is None:
        return []
    split, key, values, _ = scan
    vectors = [(i, v) for i, v in values if isinstance(v, list) and len(v) == n
               and all(isinstance(x, (int, float)) for x in v)]
    if not vectors or len(vectors) < len(values) / 2:
        return []
    dtype = _batch_label_dtype(setup)
    if not (problem == "single_label_classification" or (problem is None and dtype == "int")):
        return []
    one_hot = all(sorted(v) == [0] * (n - 1) + [1] for _, v in vectors)
    i, v = vectors[0]
    shape = "one-hot" if one_hot else "multi-hot"
    return [Finding("label-one-hot", "error",
                    f"column '{key}' of {split} holds {shape} vectors of length {n} (row {i}: {v}) but the model's "
                    "loss is single-label cross-entropy, which takes one class id per row (training fails with "
                    "`Expected input batch_size ... to match target batch_size` or `multi-target not supported`)",
                    (f"give the class id instead: ds = ds.map(lambda r: {{'{key}': r['{key}'].index(1)}}) (argmax)"
                     if one_hot else "") + ("; " if one_hot else "") +
                    "for several labels per row, use float multi-hot vectors with problem_type="
                    "'multi_label_classification'", f"{split} column '{key}', row {i}")]


# ------------------------------------------------------------------------------------------------------- no labels


@register("no-labels")
def check_no_labels(setup: Setup) -> list[Finding]:
    """Nothing reaches the model as labels, so it cannot return a loss."""
    batch, err = setup.batch()
    if err is not None or not isinstance(batch, Mapping) or setup.task == "custom" or setup.train_dataset is None:
        return []
    try:
        names, _ = setup.forward_params()
    except (TypeError, ValueError):
        return []
    label_params = {p for p in names if "label" in p} | ({"start_positions", "end_positions"} & names)
    if any(k in batch for k in (*LABEL_KEYS, *label_params)):
        return []
    if not label_params and setup.task not in ("sft", "classify"):
        return []
    model = type(setup.base_model).__name__
    name = collator_name(setup)
    keys = ", ".join(repr(k) for k in batch)
    if model_kind(setup) == "causal":
        fix = ("for causal-LM training build labels when tokenizing (labels = input_ids, -100 over the prompt) and "
               f"{_PAD_FIX}; or use DataCollatorForLanguageModeling(tokenizer, mlm=False), "
               "which copies input_ids into labels")
    else:
        fix = ("keep the label column in the dataset (named 'labels' or 'label'; with remove_unused_columns=True "
               "other names are dropped) and use a collator that passes it on")
    dropped = setup.dropped_columns()
    removed = (f"; remove_unused_columns=True dropped the columns {', '.join(repr(k) for k in dropped)} before "
               "collating (a label column must be named 'labels', 'label', 'label_ids' or be in label_names)"
               if dropped else "")
    return [Finding("no-labels", "error",
                    f"the batch from {name} has no labels (keys: {keys}) while {model}.forward takes "
                    f"{', '.join(sorted(label_params)) or 'labels'}: the model cannot return a loss, and training "
                    f"fails (`element 0 of tensors does not require grad`) or learns nothing{removed}", fix,
                    "batch keys")]


# -------------------------------------------------------------------------------------------- dry-run failures


@register("dataset-item-failed")
def check_item_failed(setup: Setup) -> list[Finding]:
    """Reading an item of the training set failed in the dry run."""
    _, err = setup.samples()
    if err is None:
        return []
    index = setup._cache.get("failed_index")
    ds = setup.train_dataset
    n = Setup.length(ds)
    size = f", {n} rows" if n is not None else ""
    return [Finding("dataset-item-failed", "error",
                    f"reading train_dataset[{index}] ({type(ds).__name__}{size}) failed: {_first_line(err)}",
                    f"make {type(ds).__name__}.__getitem__({index}) work: check that row (its file, its fields) and "
                    f"the transform applied to it; run train_dataset[{index}] by hand for the full traceback",
                    f"train_dataset[{index}]")]


@register("collate-failed")
def check_collate_failed(setup: Setup) -> list[Finding]:
    """Collating the dry run's items failed and no more specific check explains why."""
    _, err = setup.batch()
    if err is None:
        return []
    if setup._cache.get(_PREFIX + "in-collate-failed"):
        return []  # a cross-check came back here: no recursion
    setup._cache[_PREFIX + "in-collate-failed"] = True
    try:
        if _explained_by_others(setup, err):
            return []
    finally:
        setup._cache.pop(_PREFIX + "in-collate-failed", None)
    items = setup.batch_items()
    name = collator_name(setup)
    rows = [i for i, _ in setup.samples()[0]]
    shown = []
    for r, it in zip(rows, items[:3], strict=False):
        parts = ", ".join(f"{k}: {describe(_py(v)) if not isinstance(v, (int, float, str)) else type(v).__name__}"
                          for k, v in _fields(it).items())
        shown.append(f"row {r} {{{parts}}}")
    return [Finding("collate-failed", "error",
                    f"{name} could not collate {len(items)} items of train_dataset: {_first_line(err)} (items: "
                    f"{'; '.join(shown)})",
                    "make the collator accept these items: every key it turns into a tensor needs numbers of one "
                    "shape per batch (pad sequences, map strings to ids, drop keys it does not know); call the "
                    "collator on train_dataset[:2] by hand for the full traceback", collator_where(setup))]


def _explained_by_others(setup: Setup, err: BaseException) -> bool:
    """Whether a more specific check (this module's or another's) reports the cause of the collate failure."""
    text = f"{type(err).__name__}: {err}"
    candidates = {"labels-not-padded", "ragged-batch", "label-not-numeric", "label-one-hot", "no-pad-token",
                  "token-labels-misaligned", "label-shape"}
    for codes in codes_in(text):
        candidates |= set(codes)
    candidates -= {"collate-failed", "dataset-item-failed", "forward-failed"}
    for registered, fn in list(REGISTRY):
        own = set(registered.split(","))
        if own & {"collate-failed", "forward-failed"} or not own & candidates:
            continue
        if any(f.code in candidates and f.severity == "error" for f in _explained(setup, fn)):
            return True
    return False
