"""The doctor's checks on the model side of a setup: inputs against layers, ids against tables, padding, LoRA targets.

Each check reads the :class:`~surefit.doctor.core.Setup` and returns findings; none changes the setup. Token ids,
sequence lengths and segment ids are scanned over whole columns where that is cheap (lists of dicts, ``datasets``
columns, up to :data:`SCAN_ROWS` rows per split), else over the dry run's samples, else over the collated batch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from surefit.doctor.core import REGISTRY, Finding, Setup, describe, input_embeddings, register
from surefit.doctor.patterns import codes_in

SCAN_ROWS = 50_000  # rows read per split and column by the scans
HUGE_MAX_LENGTH = 1_000_000  # a tokenizer.model_max_length at or above this means "unset"
LABEL_KEYS = ("labels", "label", "label_ids")
_PREFIX = "checks_model."


# ------------------------------------------------------------------------------------------------------------ helpers


def _cached(setup: Setup, key: str, compute: Callable[[], Any]) -> Any:
    """Compute once per setup, in the setup's own cache (shared by this module's checks)."""
    cache = setup._cache  # the doctor's shared per-setup cache
    if _PREFIX + key not in cache:
        cache[_PREFIX + key] = compute()
    return cache[_PREFIX + key]


def _as_ints(value: Any) -> list[int] | None:
    """A sequence of ids (list, tuple, tensor, numpy array; nested ones flattened) as a flat list of ints."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
    if isinstance(value, (int, float)) or value is None or isinstance(value, (str, bytes)):
        return None
    if not isinstance(value, (list, tuple)):
        return None
    out: list[int] = []
    for v in value:
        if isinstance(v, (list, tuple)):
            inner = _as_ints(v)
            if inner is None:
                return None
            out += inner
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        else:
            out.append(int(v))
    return out


class Row(NamedTuple):
    """What the checks need of one row's id sequence (kept instead of the ids, so large scans stay small)."""

    where: str  # "train_dataset", "eval_dataset" or "dry-run batch"
    row: int
    length: int
    lo: int
    hi: int
    head: tuple[int, ...]  # the first HEAD ids
    last: int


HEAD = 8


def _row(where: str, row: int, value: Any) -> Row | None:
    ids = _as_ints(value)
    if not ids:
        return None
    return Row(where, row, len(ids), min(ids), max(ids), tuple(ids[:HEAD]), ids[-1])


def _split_rows(setup: Setup, split: str, ds: Any, key: str) -> list[Row] | None:
    """The rows of ``key`` over one split, or ``None`` when the split cannot be scanned."""
    if isinstance(ds, (list, tuple)):
        found = [(i, item[key]) for i, item in enumerate(ds[:SCAN_ROWS]) if isinstance(item, Mapping) and key in item]
        return [r for i, v in found if (r := _row(split, i, v)) is not None] if found else None
    names = getattr(ds, "column_names", None)
    if isinstance(names, (list, tuple)) and key in names:
        try:
            n = Setup.length(ds) or 0
            column = (ds.select(range(SCAN_ROWS)) if n > SCAN_ROWS else ds)[key]
            return [r for i, v in enumerate(column) if (r := _row(split, i, v)) is not None]
        except Exception:  # noqa: BLE001 - fall back to the dry run's samples
            pass
    if split == "train_dataset":
        items, _ = setup.samples()
        found = [(i, item[key]) for i, item in items if isinstance(item, Mapping) and key in item]
        return [r for i, v in found if (r := _row(split, i, v)) is not None] if found else None
    return None


def _rows(setup: Setup, key: str) -> list[Row]:
    """The rows of ``key`` over the training and evaluation sets, else over the dry-run batch."""

    def compute() -> list[Row]:
        rows: list[Row] = []
        scanned = False
        for split, ds in (("train_dataset", setup.train_dataset), ("eval_dataset", setup.eval_dataset)):
            if ds is None:
                continue
            got = _split_rows(setup, split, ds, key)
            if got is not None:
                scanned = True
                rows += got
        if not scanned:  # e.g. raw text tokenized by the collator: read the collated batch
            batch, _ = setup.batch()
            if isinstance(batch, Mapping) and key in batch:
                value = batch[key]
                for i, v in enumerate(value.tolist() if hasattr(value, "tolist") else value):
                    if (r := _row("dry-run batch", i, v)) is not None:
                        rows.append(r)
        return rows

    return _cached(setup, f"rows.{key}", compute)


def _at(where: str, row: int, key: str) -> str:
    return f"{where} row {row}, key '{key}'"


def _tokenizer(setup: Setup) -> Any:
    """The setup's tokenizer, else the collator's (transformers' padding collators carry one)."""
    return setup.tokenizer if setup.tokenizer is not None else getattr(setup.data_collator, "tokenizer", None)


def _batch_size(setup: Setup) -> int | None:
    """The configured batch size; without one, that of the dry run (``None`` when unknown)."""
    size = setup.args.get("batch_size")
    if size is not None:
        return int(size)
    n = Setup.length(setup.train_dataset)
    return None if n is None else min(n, 8)  # transformers' default per-device batch size is 8


def _position_limit(setup: Setup) -> tuple[int, str] | None:
    """The model's longest usable sequence and the config field that says so."""
    cfg = setup.config
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            if getattr(cfg, "model_type", "") in {"roberta", "xlm-roberta", "camembert"}:
                value -= (getattr(cfg, "pad_token_id", None) or 0) + 1  # positions start after the pad id
            return value, f"config.{name}"
    return None


def _forward_inputs(setup: Setup, batch: Mapping) -> dict[str, Any]:
    """The batch keys :meth:`Setup.forward` passes to the model."""
    names, var_kw = setup.forward_params()
    return {k: v for k, v in batch.items() if var_kw or k in names}


def _accepted(setup: Setup) -> tuple[set[str], bool]:
    """Names the forward really uses, and whether unknown keyword arguments are silently swallowed.

    transformers' models end their signature with ``**kwargs: Unpack[TransformersKwargs]``: a fixed set of extra
    names, not arbitrary columns (older versions raised ``unexpected keyword argument`` for those).
    """
    names, var_kw = setup.forward_params()
    names = names - {"self"}
    if not var_kw:
        return names, False
    model = setup.base_model
    if any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        try:
            from transformers.utils.generic import TransformersKwargs

            return names | set(TransformersKwargs.__annotations__), True
        except ImportError:
            pass
    return names, True


def _pad_collator_tokenizer_pad(setup: Setup) -> tuple[str, Any] | None:
    """The collator's own pad id when it has one (surefit's PadCollator), as ``(where, value)``."""
    if setup.data_collator is not None and hasattr(setup.data_collator, "pad_token_id"):
        return "data_collator.pad_token_id", setup.data_collator.pad_token_id
    return None


# ------------------------------------------------------------------------------------------------------ shapes


def _trace(setup: Setup) -> tuple[Any, dict[str, Any]] | None:
    """The shapes trace of one forward on the dry-run batch, or ``None`` when there is nothing to trace.

    When the plain forward already ran and succeeded, no trace is needed (layers with a shape rule fail loudly).
    When it has not run yet, the traced pass is the forward and fills :meth:`Setup.forward`'s cache.
    """

    def compute() -> tuple[Any, dict[str, Any]] | None:
        from torch import nn

        batch, err = setup.batch()
        if err is not None or not isinstance(batch, Mapping) or not isinstance(setup.model, nn.Module):
            return None
        previous = setup._cache.get("forward")
        if previous is not None and previous[1] is None:
            return None
        import torch

        from surefit.doctor.shapes import trace

        inputs = _forward_inputs(setup, batch)
        model = setup.model
        result: dict[str, Any] = {}

        def call() -> None:
            with torch.no_grad():
                result["out"] = model(**inputs)

        was = model.training
        try:
            model.eval()
            tr = trace(model, inputs, call)
        finally:
            model.train(was)
        if previous is None:
            setup._cache["forward"] = (result.get("out"), tr.error)  # one pass, not two
        return tr, inputs

    return _cached(setup, "trace", compute)


@register("input-dim-mismatch")
def check_input_dims(setup: Setup) -> list[Finding]:
    """An input whose shape (or dtype) does not fit the first layer that consumes it."""
    import torch
    from torch import nn

    from surefit.doctor.shapes import describe_layer, diagnose, expectation

    traced = _trace(setup)
    if traced is None:
        return []
    tr, inputs = traced
    findings: list[Finding] = []
    layer = tr.failed_layer
    if tr.error is not None and layer is not None and tr.failed_inputs:
        shape, dtype_name = tr.failed_inputs[0], tr.failed_dtypes[0]
        dtype = getattr(torch, dtype_name, torch.float32)
        expects, ok = expectation(layer, shape, dtype)
        source = tr.failed_sources[0] if tr.failed_sources else None
        where = f"layer '{tr.failed_module}'" + (f", input '{source}'" if source else "")
        weight = getattr(layer, "weight", None)
        if ok is False:
            message = diagnose(tr, inputs)
            findings.append(Finding(
                "input-dim-mismatch", "error", message or f"{where}: expects {expects}, got {list(shape)}",
                f"make {repr(source) if source else 'the input'} arrive with {expects}, as the likely cause above "
                f"says, or build layer '{tr.failed_module}' for the data's shape", where))
        elif (ok and isinstance(layer, (nn.Linear, nn.modules.conv._ConvNd, nn.RNNBase))
              and isinstance(weight, torch.Tensor) and dtype.is_floating_point and dtype != weight.dtype):
            wdt = str(weight.dtype).replace("torch.", "")
            findings.append(Finding(
                "input-dim-mismatch", "error",
                f"dtype mismatch at layer '{tr.failed_module}' ({describe_layer(layer)}): "
                f"{repr(source) if source else 'its input'} arrives as {list(shape)} {dtype_name} but the layer's "
                f"weights are {wdt} (the raw error was: {type(tr.error).__name__}: {str(tr.error).splitlines()[0]})",
                f"store the features as {wdt} in the dataset (e.g. numpy .astype('{wdt}')), not {dtype_name}", where))
    if not findings:
        for use in tr.uses.values():
            if use.agrees is False:
                findings.append(Finding(
                    "input-dim-mismatch", "error",
                    f"'{use.input}' arrives at layer '{use.module}' ({use.layer}) as {list(use.shape)} {use.dtype}, "
                    f"but the layer expects {use.expects}",
                    f"reshape or convert '{use.input}' to what '{use.module}' expects ({use.expects}), or build the "
                    "layer for the data's shape", f"layer '{use.module}', input '{use.input}'"))
    return findings


# --------------------------------------------------------------------------------------------------- batch keys


@register("unexpected-columns")
def check_unexpected_columns(setup: Setup) -> list[Finding]:
    """Batch keys the forward does not take (the seeds' ``forward() got an unexpected keyword argument 'idx'``)."""
    removed = [k for k in setup.dropped_columns() if k not in LABEL_KEYS]
    if removed:  # remove_unused_columns=True took them out before collation: nothing reaches the forward
        model = type(setup.base_model).__name__
        return [Finding("unexpected-columns", "info",
                        f"{model}.forward() does not take {', '.join(repr(k) for k in removed)} from the dataset's "
                        "items; with remove_unused_columns=True the Trainer drops them silently before collating",
                        "nothing to do if they are not inputs; otherwise rename them to the forward's parameter names",
                        "dataset columns " + ", ".join(repr(k) for k in removed))]
    batch, _ = setup.batch()
    if isinstance(batch, Mapping):
        keys = list(batch)
        source = "the collated batch"
    else:
        items, _ = setup.samples()
        if not items or not isinstance(items[0][1], Mapping):
            return []
        keys = list(items[0][1])
        source = "the dataset's items"
    try:
        names, swallowed = _accepted(setup)
        named, var_kw = setup.forward_params()
    except (TypeError, ValueError):
        return []
    if var_kw and not swallowed:
        return []  # a plain **kwargs forward takes anything
    extra = [k for k in keys if k not in names]
    if not extra:
        return []
    model = type(setup.base_model).__name__
    params = ", ".join(sorted(named - {"self"})) + (", **kwargs" if var_kw else "")
    cols = ", ".join(repr(k) for k in extra)
    where = "batch keys " + cols
    hint = " (rename 'label' to 'labels')" if "label" in extra and "labels" in names else ""
    dropped = [k for k in extra if k not in LABEL_KEYS]
    if setup.args.get("remove_unused_columns") is True and dropped:
        return [Finding("unexpected-columns", "info",
                        f"{model}.forward() does not take {', '.join(repr(k) for k in dropped)} from {source}; with "
                        f"remove_unused_columns=True the Trainer drops them silently (forward takes: {params})",
                        "nothing to do if they are not inputs; otherwise rename them to the forward's parameter names",
                        where)]
    if setup.args.get("remove_unused_columns") is True:
        return []
    fix = (f"drop the columns before training (dataset.remove_columns([{cols}])), or set remove_unused_columns=True "
           f"so the Trainer drops them; surefit drops unused columns itself and prints the table{hint}")
    if swallowed:
        return [Finding("unexpected-columns", "warning",
                        f"{model}.forward() takes no {cols}, yet {source} carries {'it' if len(extra) == 1 else 'them'}:"
                        f" its **kwargs swallows {'it' if len(extra) == 1 else 'them'} silently (older transformers "
                        f"raise `forward() got an unexpected keyword argument '{extra[0]}'`); forward takes: {params}",
                        fix, where)]
    return [Finding("unexpected-columns", "error",
                    f"{source} has keys {cols} that {model}.forward() does not accept: training raises "
                    f"`forward() got an unexpected keyword argument '{extra[0]}'`; forward takes: {params}",
                    fix, where)]


@register("missing-attention-mask")
def check_attention_mask(setup: Setup) -> list[Finding]:
    """Padded ``input_ids`` reaching a model that takes ``attention_mask`` without one."""
    batch, _ = setup.batch()
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "attention_mask" in batch:
        return []
    names, _ = setup.forward_params()
    if "attention_mask" not in names:
        return []
    reason = None
    lengths = [r.length for r in _rows(setup, "input_ids")]
    if len(set(lengths)) > 1 and (_batch_size(setup) or 2) > 1:
        reason = f"item lengths vary from {min(lengths)} to {max(lengths)} tokens, so batches are padded"
    else:
        tok = _tokenizer(setup)
        pad = getattr(tok, "pad_token_id", None)
        if pad is not None and pad != getattr(tok, "eos_token_id", None):
            padded = [(r.where, r.row) for r in _rows(setup, "input_ids") if r.length > 1 and r.last == pad]
            if padded:
                reason = (f"{len(padded)} item(s) end with the pad id {pad} (first: {padded[0][0]} row {padded[0][1]}),"
                          " so they were padded when tokenized")
    if reason is None:
        return []
    return [Finding("missing-attention-mask", "error",
                    f"{reason}, but the batch has no 'attention_mask' (keys: {', '.join(batch)}): the model attends "
                    "to the padding and each row's output depends on its batch-mates",
                    "keep the tokenizer's attention_mask column (return_attention_mask=True, and do not drop it), or "
                    "use a collator that builds it from the lengths (surefit's PadCollator, transformers' "
                    "DataCollatorWithPadding)", "batch key 'attention_mask'")]


# ------------------------------------------------------------------------------------------------- ids and lengths


@register("token-id-out-of-range")
def check_token_ids(setup: Setup) -> list[Finding]:
    """Token ids outside the input embedding (tokens added to the tokenizer without resizing the model)."""
    rows_n = getattr(input_embeddings(setup.base_model), "num_embeddings", None)
    if not isinstance(rows_n, int):
        return []
    tok = _tokenizer(setup)
    n_tok = len(tok) if tok is not None and hasattr(tok, "__len__") else None
    fix = (f"model.resize_token_embeddings(len(tokenizer)) after adding tokens (the tokenizer has {n_tok} tokens)"
           if n_tok is not None and n_tok > rows_n else
           "tokenize with the model's own tokenizer, or resize the model: model.resize_token_embeddings(len(tokenizer))")
    high = [(r.where, r.row, r.hi) for r in _rows(setup, "input_ids") if r.hi >= rows_n]
    low = [(r.where, r.row, r.lo) for r in _rows(setup, "input_ids") if r.lo < 0]
    crash = "the forward fails with `index out of range in self` (on GPU: a device-side assert)"
    if high:
        w, r, top = max(high, key=lambda b: b[2])
        return [Finding("token-id-out-of-range", "error",
                        f"token id {top} ({_at(w, r, 'input_ids')}) is >= the {rows_n} rows of the model's input "
                        f"embedding ({len(high)} row(s) affected): {crash}", fix, _at(w, r, "input_ids"))]
    if low:
        w, r, bottom = low[0]
        return [Finding("token-id-out-of-range", "error",
                        f"token id {bottom} ({_at(w, r, 'input_ids')}) is negative ({len(low)} row(s) affected): "
                        f"{crash}", "input_ids must be real token ids: -100 belongs in labels only; pad input_ids "
                        "with the tokenizer's pad id", _at(w, r, "input_ids"))]
    if n_tok is not None and n_tok > rows_n:
        return [Finding("token-id-out-of-range", "warning",
                        f"the tokenizer has {n_tok} tokens but the model's input embedding has {rows_n} rows: any id "
                        f">= {rows_n} (e.g. an added token) will fail with `index out of range in self`",
                        "model.resize_token_embeddings(len(tokenizer))", "model.get_input_embeddings()")]
    return []


@register("sequence-too-long")
def check_sequence_length(setup: Setup) -> list[Finding]:
    """Sequences (or a tokenize ``max_length``) longer than the model's position limit."""
    limit = _position_limit(setup)
    if limit is None:
        return []
    n, field_name = limit
    findings: list[Finding] = []
    rows = [(r.where, r.row, r.length) for r in _rows(setup, "input_ids")]
    over = [x for x in rows if x[2] > n]
    if over:
        w, r, longest = max(over, key=lambda x: x[2])
        findings.append(Finding("sequence-too-long", "error",
                                f"the longest sequence has {longest} tokens ({_at(w, r, 'input_ids')}) but the model "
                                f"has {n} positions ({field_name}); {len(over)} row(s) are longer",
                                f"truncate when tokenizing: truncation=True, max_length={n} (or less)",
                                _at(w, r, "input_ids")))
    tokenize = setup.args.get("tokenize")
    if isinstance(tokenize, Mapping) and isinstance(tokenize.get("max_length"), int) and tokenize["max_length"] > n:
        findings.append(Finding("sequence-too-long", "error",
                                f"tokenize max_length={tokenize['max_length']} is above the model's {n} positions "
                                f"({field_name}): sequences that long fail or run off the position table",
                                f"use max_length={n} or less", f"tokenize column '{tokenize.get('column', '?')}'"))
    return findings


@register("no-max-length")
def check_max_length(setup: Setup) -> list[Finding]:
    """Truncation requested with no maximum length anywhere: it silently truncates nothing."""
    tokenize = setup.args.get("tokenize")
    if not isinstance(tokenize, Mapping) or not tokenize.get("truncation") or tokenize.get("max_length") is not None:
        return []
    tok = _tokenizer(setup)
    model_max = getattr(tok, "model_max_length", None)
    if tok is None or (isinstance(model_max, (int, float)) and model_max < HUGE_MAX_LENGTH):
        return []
    shown = f"{model_max:.3g}" if isinstance(model_max, (int, float)) else repr(model_max)
    limit = _position_limit(setup)
    suggest = f"max_length={limit[0]} (the model's {limit[1]})" if limit else "max_length=<the model's context length>"
    column = tokenize.get("column", "?")
    return [Finding("no-max-length", "error",
                    f"tokenize asks for truncation=True with max_length=None, and tokenizer.model_max_length is "
                    f"{shown} (unset): truncation silently does nothing and long rows stay long",
                    f"pass {suggest} when tokenizing, or set tokenizer.model_max_length", f"tokenize column '{column}'")]


@register("token-type-out-of-range")
def check_token_types(setup: Setup) -> list[Finding]:
    """``token_type_ids`` at or above ``config.type_vocab_size``."""
    size = getattr(setup.config, "type_vocab_size", None)
    if not isinstance(size, int):
        return []
    bad = [(r.where, r.row, r.hi) for r in _rows(setup, "token_type_ids") if r.hi >= size or r.lo < 0]
    if not bad:
        return []
    w, r, top = max(bad, key=lambda b: b[2])
    return [Finding("token-type-out-of-range", "error",
                    f"token_type_ids value {top} ({_at(w, r, 'token_type_ids')}) is outside the model's "
                    f"type_vocab_size {size} ({len(bad)} row(s) affected): the forward fails with "
                    "`index out of range in self`",
                    f"{'drop token_type_ids (return_token_type_ids=False) - this model has one segment' if size == 1 else f'keep segment ids below {size}'}; "
                    "tokenize with the model's own tokenizer", _at(w, r, "token_type_ids"))]


# ------------------------------------------------------------------------------------------------------ padding


def _padding_reason(setup: Setup) -> str | None:
    tokenize = setup.args.get("tokenize")
    if isinstance(tokenize, Mapping) and tokenize.get("padding") not in (None, False, "do_not_pad"):
        return f"tokenize asks for padding={tokenize['padding']!r}"
    size = _batch_size(setup)
    if size is not None and size <= 1:
        return None
    lengths = {r.length for r in _rows(setup, "input_ids")}
    if len(lengths) > 1:
        return f"item lengths vary from {min(lengths)} to {max(lengths)} tokens"
    if getattr(setup.data_collator, "tokenizer", None) is not None:
        return f"the padding collator {type(setup.data_collator).__name__} pads every batch"
    return None


@register("no-pad-token")
def check_pad_token(setup: Setup) -> list[Finding]:
    """Padding is needed and the tokenizer (or the collator) has no pad token."""
    reason = _padding_reason(setup)
    if reason is None:
        return []
    collator_pad = _pad_collator_tokenizer_pad(setup)
    if collator_pad is not None and collator_pad[1] is None:
        return [Finding("no-pad-token", "error", f"padding is needed ({reason}) but {collator_pad[0]} is None",
                        "build the collator with the tokenizer's pad id (set tokenizer.pad_token = tokenizer.eos_token "
                        "first if it has none; the collator masks padding by position)", collator_pad[0])]
    tok = _tokenizer(setup)
    if tok is None or getattr(tok, "pad_token", "") is not None:
        return []
    eos = getattr(tok, "eos_token", None)
    return [Finding("no-pad-token", "error",
                    f"padding is needed ({reason}) but the tokenizer has no pad token (tokenizer.pad_token is None): "
                    "padding raises `Asking to pad but the tokenizer does not have a padding token`",
                    f"tokenizer.pad_token = tokenizer.eos_token ({eos!r}); safe with a collator that masks padding by "
                    "position (surefit's PadCollator), but transformers' DataCollatorForLanguageModeling then masks "
                    "EOS labels too: there add a distinct pad token (tokenizer.add_special_tokens({'pad_token': "
                    "'<pad>'}) and model.resize_token_embeddings(len(tokenizer)))", "tokenizer.pad_token")]


@register("classifier-no-pad-id")
def check_classifier_pad_id(setup: Setup) -> list[Finding]:
    """A decoder-only sequence classifier finds each row's last token via ``config.pad_token_id``."""
    name = type(setup.base_model).__name__
    if not (setup.is_decoder_only and name.endswith("ForSequenceClassification")):
        return []
    cfg = setup.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    config_pad = getattr(text_cfg, "pad_token_id", None)
    tok = _tokenizer(setup)
    tok_pad = getattr(tok, "pad_token_id", None)
    collator_pad = _pad_collator_tokenizer_pad(setup)
    pad_used = collator_pad[1] if collator_pad is not None and collator_pad[1] is not None else tok_pad
    size = _batch_size(setup)
    if config_pad is None:
        if size is None or size <= 1:
            return []
        set_to = f"tokenizer.pad_token_id (= {tok_pad})" if tok_pad is not None else (
            "tokenizer.pad_token_id, after tokenizer.pad_token = tokenizer.eos_token")
        return [Finding("classifier-no-pad-id", "error",
                        f"{name} reads each row's last real token by config.pad_token_id, which is None; with batches "
                        f"of {size} rows transformers raises `Cannot handle batch sizes > 1 if no padding token is "
                        "defined`", f"model.config.pad_token_id = {set_to}", "model.config.pad_token_id")]
    if pad_used is not None and pad_used != config_pad:
        return [Finding("classifier-no-pad-id", "error",
                        f"{name} finds each row's last real token by config.pad_token_id = {config_pad}, but batches "
                        f"are padded with id {pad_used}: on padded rows it classifies from a padding position",
                        f"model.config.pad_token_id = {pad_used}", "model.config.pad_token_id")]
    return []


@register("double-bos")
def check_double_bos(setup: Setup) -> list[Finding]:
    """Rows that start with BOS twice (a rendered chat template tokenized with special tokens added)."""
    tok = _tokenizer(setup)
    bos = getattr(tok, "bos_token_id", None)
    if bos is None:
        bos = getattr(setup.config, "bos_token_id", None)
    if not isinstance(bos, int):
        return []
    pad = getattr(tok, "pad_token_id", None)
    doubled = []
    rows = _rows(setup, "input_ids")
    for row in rows:
        ids = row.head
        if pad is not None and pad != bos:
            k = 0
            while k < len(ids) and ids[k] == pad:
                k += 1
            ids = ids[k:]
        if len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            doubled.append((row.where, row.row))
    if not doubled:
        return []
    w, r = doubled[0]
    return [Finding("double-bos", "warning",
                    f"{len(doubled)} of {len(rows)} row(s) start with the BOS token (id {bos}) twice (first: "
                    f"{_at(w, r, 'input_ids')}): the chat template already adds BOS and the tokenizer added another; "
                    "the model trains on a prefix it never sees at inference",
                    "tokenize rendered chat templates with add_special_tokens=False (or apply_chat_template("
                    "tokenize=True))", _at(w, r, "input_ids"))]


@register("generation-right-padding")
def check_generation_padding(setup: Setup) -> list[Finding]:
    """Batched generation with a decoder-only model padded on the right."""
    if not setup.args.get("generation") or not setup.is_decoder_only:
        return []
    tok = _tokenizer(setup)
    if getattr(tok, "padding_side", None) != "right":
        return []
    return [Finding("generation-right-padding", "error",
                    f"generation is on with the decoder-only {type(setup.base_model).__name__} but "
                    "tokenizer.padding_side is 'right': shorter prompts end in padding, so the model continues "
                    "from pad tokens and their outputs are garbage",
                    "tokenizer.padding_side = 'left' for generation (keep 'right' for training batches)",
                    "tokenizer.padding_side")]


# --------------------------------------------------------------------------------------------------------- LoRA


HEAD_NAMES = {"lm_head", "score", "classifier", "head", "embed_out", "output"}
ATTENTION_NAMES = ("q_proj", "v_proj", "query", "value", "c_attn", "qkv_proj", "Wqkv", "query_key_value", "q", "v")


def _linear_names(model: Any) -> tuple[list[str], list[str]]:
    """The layers LoRA can wrap, and a suggestion for ``target_modules``.

    Returns:
        The unique last name components of Linear, Conv, Embedding and GPT-2 Conv1D layers; and two of them to
        suggest (the attention projections if present, else the first linear layers that are not the head).
    """
    from torch import nn

    seen: dict[str, None] = {}
    inner: dict[str, None] = {}
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if name and (isinstance(module, (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd))
                     or type(module).__name__ == "Conv1D"):
            seen.setdefault(short, None)
            if not isinstance(module, nn.Embedding) and short not in HEAD_NAMES:
                inner.setdefault(short, None)
    attention = [n for n in ATTENTION_NAMES if n in inner]
    return list(seen), (attention or list(inner))[:2]


def _matches(target: str, names: Iterable[str]) -> bool:
    return any(n == target or n.endswith("." + target) for n in names)


@register("lora-targets-missing")
def check_lora_targets(setup: Setup) -> list[Finding]:
    """``peft_config.target_modules`` naming no module of the model."""
    cfg = setup.peft_config
    if cfg is None:
        return []
    get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)
    targets = get("target_modules")
    model = setup.base_model
    if not hasattr(model, "named_modules"):
        return []
    names = [n for n, _ in model.named_modules() if n]
    have, suggest = _linear_names(model)
    listing = ", ".join(have) if have else "(none)"
    where = "peft_config.target_modules"
    if targets is None:
        if get("target_parameters") is not None:
            return []
        model_type = getattr(setup.config, "model_type", None)
        try:
            from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
        except ImportError:
            return []
        if model_type in defaults:
            return []
        return [Finding("lora-targets-missing", "error",
                        f"peft_config.target_modules is None and peft has no default targets for "
                        f"{type(model).__name__} (model_type {model_type!r}); the model's linear layers are: {listing}",
                        f"pass target_modules, e.g. {suggest or ['...']} or 'all-linear'", where)]
    if isinstance(targets, str):
        if targets == "all-linear" or any(re.fullmatch(targets, n) for n in names):
            return []
        return [Finding("lora-targets-missing", "error",
                        f"target_modules regex {targets!r} matches no module of {type(model).__name__} (it must match "
                        f"a full module name{f' such as {names[-1]!r}' if names else ''}); the layers LoRA can wrap are: {listing}",
                        f"use names that exist, e.g. target_modules={suggest}, or 'all-linear'", where)]
    targets = list(targets)
    missing = [t for t in targets if not _matches(t, names)]
    if not missing:
        return []
    if len(missing) == len(targets):
        return [Finding("lora-targets-missing", "error",
                        f"target_modules {sorted(missing)} match no module of {type(model).__name__}: peft raises "
                        f"`Target modules ... not found in the base model`; the layers LoRA can wrap are: {listing}",
                        f"use names that exist, e.g. target_modules={suggest}, or 'all-linear'", where)]
    return [Finding("lora-targets-missing", "warning",
                    f"target_modules {sorted(missing)} match no module of {type(model).__name__} (the others do): LoRA "
                    f"is added only to {sorted(set(targets) - set(missing))}; the layers LoRA can wrap are: {listing}",
                    f"remove {sorted(missing)} or use names that exist", where)]


# ------------------------------------------------------------------------------------------------------ weights


def all_finite(t: Any) -> bool:
    """Whether every value of a floating-point tensor is finite, in one pass that allocates nothing.

    The smallest and largest values are finite exactly when every value is: a NaN makes both NaN (``aminmax``
    propagates it), an infinity is the largest or the smallest. About 30x faster than ``isfinite(t).sum()``,
    which writes a mask as large as the tensor: 0.1 s instead of 2 s over the 135M weights of SmolLM2."""
    import torch

    try:
        low, high = torch.aminmax(t.detach().reshape(-1))
    except RuntimeError:  # a dtype without aminmax (float8): the caller counts value by value, as before
        return False
    return bool(torch.isfinite(low) and torch.isfinite(high))


@register("nonfinite-weights")
def check_nonfinite_weights(setup: Setup) -> list[Finding]:
    """NaN or infinite values in the weights the model was loaded with. Found before step 1, they are named as the
    model's; found by the first loss, they would be blamed on the rows of that batch."""
    import torch

    model = setup.base_model  # the names then read as in the model's own weight files
    if not hasattr(model, "named_parameters"):
        return []
    bad: list[tuple[str, int, int]] = []
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point() or t.device.type == "meta" or t.numel() == 0:
                continue  # quantised (integer) storage holds no NaN; a meta tensor holds no values here
            if all_finite(t):
                continue
            n = t.numel() - int(torch.isfinite(t).sum())
            if n:
                bad.append((name, n, t.numel()))
    if not bad:
        return []
    shown = "; ".join(f"{name}: {n:,} of {total:,} values" for name, n, total in bad[:5])
    more = f"; and {len(bad) - 5} more tensors" if len(bad) > 5 else ""
    return [Finding("nonfinite-weights", "error",
                    f"{type(setup.base_model).__name__} holds NaN or infinite weights as loaded ({len(bad)} tensor"
                    f"{'s' if len(bad) != 1 else ''}): {shown}{more}; every loss would be NaN, whatever the rows",
                    "the model's files are damaged or were converted badly: download or export the model again, and "
                    "check the tensors above in its weight files (safetensors.safe_open)", bad[0][0])]


# ------------------------------------------------------------------------------------------------------ forward


@register("forward-failed")
def check_forward(setup: Setup) -> list[Finding]:
    """The dry run's forward failed and no more specific check explains why."""
    _, err = setup.forward()
    if err is None:
        return []
    text = f"{type(err).__name__}: {err}"
    if "Cannot handle batch sizes > 1" in text and (_batch_size(setup) or 2) <= 1:
        return []  # the dry run batches two items; training with batches of one never hits this
    # the checks of this module that find inputs the forward cannot take: their errors explain any failure
    candidates = {"input-dim-mismatch", "token-id-out-of-range", "token-type-out-of-range", "sequence-too-long",
                  "classifier-no-pad-id", "label-shape", "label-dtype", "label-one-hot"}
    for codes in codes_in(text):
        candidates |= set(codes)
    for registered, fn in list(REGISTRY):
        own = set(registered.split(","))
        if "forward-failed" in own or not own & candidates:
            continue
        try:
            if any(f.code in candidates and f.severity == "error" for f in fn(setup)):
                return []
        except Exception:  # noqa: BLE001 - a crashing check explains nothing
            continue
    batch, _ = setup.batch()
    keys = "; ".join(f"{k}: {describe(v)}" for k, v in batch.items()) if isinstance(batch, Mapping) else describe(batch)
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return [Finding("forward-failed", "error",
                    f"the dry-run forward pass of {type(setup.base_model).__name__} failed: {type(err).__name__}: "
                    f"{first} (batch: {keys})",
                    "check that each batch key has the shape and dtype the model's forward expects; run the forward "
                    "on this batch by hand to see the full traceback", "model.forward")]
