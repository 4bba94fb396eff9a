"""Checks on how the run is set up rather than on what one batch looks like: workers, splits, precision, memory.

Codes: ``unpicklable-worker-data``, ``empty-dataset``, ``split-leakage``, ``fp16-master-weights``,
``memory-over-budget``. Like every check, these read the :class:`~surefit.doctor.core.Setup` and change nothing;
only the memory estimate runs its own (hooked, no-grad) forward pass, and only for models without a transformers
config.
"""

from __future__ import annotations

import math
import multiprocessing
import pickle
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from surefit.data.split import normalize_key
from surefit.doctor.core import Finding, Setup, register
from surefit.training.plan import footprint, model_dims
from surefit.units import GiB, human_bytes

GB = GiB

# ---------------------------------------------------------------------------------------------------- helpers


def _splits(setup: Setup) -> list[tuple[str, Any]]:
    """``[(name, dataset)]`` for the training set and every evaluation set (a dict of eval sets is unfolded)."""
    out: list[tuple[str, Any]] = []
    if setup.train_dataset is not None:
        out.append(("train_dataset", setup.train_dataset))
    ev = setup.eval_dataset
    if isinstance(ev, Mapping) and ev and all(_is_dataset(v) for v in ev.values()):
        out += [(f"eval_dataset[{name!r}]", ds) for name, ds in ev.items()]
    elif ev is not None:
        out.append(("eval_dataset", ev))
    return out


def _is_dataset(value: Any) -> bool:
    return not isinstance(value, (str, bytes, Mapping)) and (hasattr(value, "__getitem__") or hasattr(value, "__iter__"))


class _Sink:
    """A file that discards what is written: pickling to it costs no memory however big the object is."""

    def write(self, data: bytes) -> int:
        return len(data)


def _pickle_error(obj: Any) -> Exception | None:
    try:
        pickle.Pickler(_Sink(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except RecursionError:
        return None  # deeply nested but picklable in principle; not what this check is about
    except Exception as e:  # noqa: BLE001 - PicklingError, TypeError, AttributeError: all mean "cannot pickle"
        return e
    return None


def _parts(obj: Any) -> Iterator[tuple[str, Any]]:
    """The named pieces of an object pickle would descend into (attributes, partial's function, first items)."""
    import functools

    if isinstance(obj, functools.partial):
        yield ".func", obj.func
        yield from ((f".args[{i}]", a) for i, a in enumerate(obj.args))
        yield from ((f".keywords[{k!r}]", v) for k, v in obj.keywords.items())
        return
    if isinstance(obj, Mapping):
        yield from ((f"[{k!r}]", v) for k, v in list(obj.items())[:1000])
        return
    if isinstance(obj, (list, tuple)):
        yield from ((f"[{i}]", v) for i, v in enumerate(obj[:1000]))
        return
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        yield from ((f".{k}", v) for k, v in state.items())


def _culprit(obj: Any, path: str, depth: int = 3) -> tuple[str, Any]:
    """The most specific ``(path, value)`` below ``path`` that still fails to pickle (``obj`` itself if none)."""
    if depth > 0:
        for name, part in _parts(obj):
            if part is not obj and _pickle_error(part) is not None:
                return _culprit(part, path + name, depth - 1)
    return path, obj


def _start_method(setup: Setup) -> str:
    """The start method DataLoader workers will use: the one given in the args, else the process default."""
    ctx = setup.args.get("multiprocessing_context")
    if ctx is not None:
        return ctx.get_start_method() if hasattr(ctx, "get_start_method") else str(ctx)
    # get_start_method(allow_none=True) does not fix the default as a side effect; the first listed is the default.
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- worker pickling


@register("unpicklable-worker-data")
def check_worker_pickling(setup: Setup) -> list[Finding]:
    """DataLoader workers started by spawn/forkserver receive the dataset and collator pickled; fork copies them."""
    workers = int(setup.args.get("num_workers") or 0)
    if workers <= 0:
        return []
    objects = [*_splits(setup)]
    if setup.data_collator is not None:
        objects.append(("data_collator", setup.data_collator))
    method = _start_method(setup)
    findings = []
    for name, obj in objects:
        err = _pickle_error(obj)
        if err is None:
            continue
        where, value = _culprit(obj, name)
        what = f"{where} ({_short(value)})"
        reason = f"{type(err).__name__}: {err}"
        fix = ("define the collator / transform as a module-level function or class (no lambda, no function "
               "defined inside another, no open file or lock held by the dataset: open files lazily in "
               "__getitem__), or set num_workers 0")
        if method == "fork":
            findings.append(Finding(
                "unpicklable-worker-data", "warning",
                f"{what} cannot be pickled ({reason}); it works here only because workers start with 'fork' "
                f"(num_workers={workers}): with 'spawn' or 'forkserver' (the default on macOS and Windows, and on "
                f"Linux from Python 3.14) the DataLoader fails when it starts its workers", fix, where))
        else:
            findings.append(Finding(
                "unpicklable-worker-data", "error",
                f"{what} cannot be pickled, but num_workers={workers} with start method {method!r} sends it to "
                f"each worker pickled, so the DataLoader fails when it starts its workers: {reason}", fix, where))
    return findings


# --------------------------------------------------------------------------------------------------- empty splits


@register("empty-dataset")
def check_empty(setup: Setup) -> list[Finding]:
    """A split with no rows: training does zero steps (or the sampler raises), evaluation divides by zero."""
    findings = []
    for name, ds in _splits(setup):
        if setup.length(ds) == 0:
            effect = ("training would run zero steps (or fail with 'num_samples should be a positive integer')"
                      if name == "train_dataset" else "evaluation has nothing to score")
            findings.append(Finding(
                "empty-dataset", "error", f"{name} has 0 rows: {effect}",
                "check the file path, the split name and any filter/select that ran before (a filter on a column "
                "that does not exist or a max_length shorter than every row empties a split)", name))
    return findings


# --------------------------------------------------------------------------------------------------- split leakage

TEXT_COLUMNS = ("text", "sentence", "input", "question", "content")
MAX_ROWS = 200_000  # per split for column stores (datasets.Dataset); beyond this the first rows are compared
MAX_ITEMS = 20_000  # per split for datasets read item by item (a torch Dataset may load or tokenize per item)


def _columnar(ds: Any) -> bool:
    return hasattr(ds, "column_names") and hasattr(ds, "select")


def _limit(ds: Any) -> int:
    """How many rows of a split the leakage check compares."""
    return min(Setup.length(ds) or 0, MAX_ROWS if _columnar(ds) else MAX_ITEMS)


def _text_keys(ds: Any, columns: Sequence[str], tokenizer: Any) -> list[str] | None:
    """One normalised key per row, from the text columns, else from input_ids (decoded when possible)."""
    n = _limit(ds)
    if n == 0:
        return []
    if _columnar(ds):  # datasets.Dataset: read whole columns, not rows
        part = ds.select(range(n)) if n < len(ds) else ds
        if columns:
            cols = [part[c] for c in columns]
            return [normalize_key(" \n ".join(str(v) for v in vals)) for vals in zip(*cols, strict=True)]
        if "input_ids" in ds.column_names:
            return _id_keys(part["input_ids"], tokenizer)
        return None
    first = ds[0]
    if not isinstance(first, Mapping) or not (columns or "input_ids" in first):
        return None  # nothing to compare: decided on one item, before reading them all
    rows = [first] + [ds[i] for i in range(1, n)]
    if not all(isinstance(r, Mapping) for r in rows):
        return None
    if columns:
        return [normalize_key(" \n ".join(str(r.get(c, "")) for c in columns)) for r in rows]
    if all("input_ids" in r for r in rows):
        return _id_keys([r["input_ids"] for r in rows], tokenizer)
    return None


def _id_keys(ids: list[Any], tokenizer: Any) -> list[str]:
    ids = [x.tolist() if hasattr(x, "tolist") else list(x) for x in ids]
    if tokenizer is not None and hasattr(tokenizer, "batch_decode"):
        return [normalize_key(t) for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    return [" ".join(map(str, x)) for x in ids]


def _columns(ds: Any) -> list[str]:
    if hasattr(ds, "column_names") and isinstance(ds.column_names, list):
        names = ds.column_names
    else:
        try:
            first = ds[0] if Setup.length(ds) else None
        except Exception:  # noqa: BLE001 - an unreadable dataset is dataset-item-failed's business
            return []
        names = list(first) if isinstance(first, Mapping) else []
    return [c for c in TEXT_COLUMNS if c in names]


@register("split-leakage")
def check_leakage(setup: Setup) -> list[Finding]:
    """Evaluation rows whose normalised text also appears in training: the score measures memory."""
    splits = _splits(setup)
    if not splits or splits[0][0] != "train_dataset" or len(splits) < 2:
        return []
    train = splits[0][1]
    train_cols = _columns(train)
    findings = []
    train_keys: dict[tuple[str, ...], dict[str, int] | None] = {}
    for name, ev in splits[1:]:
        cols = tuple(c for c in _columns(ev) if c in train_cols)
        if cols not in train_keys:
            keys = _text_keys(train, cols, setup.tokenizer)
            first_of: dict[str, int] = {}
            for i, k in enumerate(keys or []):
                if k:
                    first_of.setdefault(k, i)
            train_keys[cols] = None if keys is None else first_of
        index = train_keys[cols]
        eval_keys = _text_keys(ev, cols, setup.tokenizer) if index is not None else None
        if not index or not eval_keys:
            continue
        hits = [(j, index[k]) for j, k in enumerate(eval_keys) if k and k in index]
        if not hits:
            continue
        share = len(hits) / len(eval_keys)
        basis = f"normalised {', '.join(repr(c) for c in cols)}" if cols \
            else "decoded input_ids" if hasattr(setup.tokenizer, "batch_decode") else "identical input_ids"
        j, i = hits[0]
        shown = ", ".join(str(jj) for jj, _ in hits[:8]) + (", ..." if len(hits) > 8 else "")
        partial = any(_limit(d) < (setup.length(d) or 0) for d in (train, ev))
        scope = f" (first {_limit(train):,} / {_limit(ev):,} rows compared)" if partial else ""
        findings.append(Finding(
            "split-leakage", "error" if share >= 0.01 else "warning",
            f"{len(hits)} of {len(eval_keys)} rows ({100 * share:.1f}%) of {name} also appear in train_dataset "
            f"({basis}){scope}: eval rows {shown}; e.g. eval row {j} = train row {i}: {_short(eval_keys[j])}. "
            "Scores on them measure memorisation, not generalisation",
            "deduplicate before splitting and keep equal inputs on one side (surefit.data.split.split_rows does "
            "this), or drop these rows from the evaluation set; split before augmenting", name))
    return findings


# ------------------------------------------------------------------------------------------------ fp16 weights


def _trainable(model: Any) -> list[tuple[str, Any]]:
    named = getattr(model, "named_parameters", None)
    return [(n, p) for n, p in named() if p.requires_grad] if callable(named) else []


@register("fp16-master-weights")
def check_fp16_weights(setup: Setup) -> list[Finding]:
    """fp16 mixed precision with float16 trainable weights: GradScaler refuses to unscale fp16 gradients."""
    if not setup.args.get("fp16"):
        return []
    import torch

    half = [(n, p) for n, p in _trainable(setup.model) if p.dtype == torch.float16]
    if not half:
        return []
    values = sum(p.numel() for _, p in half)
    return [Finding(
        "fp16-master-weights", "error",
        f"fp16=True but {len(half)} trainable parameters ({values:,} values) are float16, e.g. {half[0][0]!r}: the "
        "gradient scaler raises 'Attempting to unscale FP16 gradients' at the first optimizer step (and fp16 "
        "weights lose small updates to rounding even without it)",
        "keep the trainable weights in float32 (no model.half(); load with dtype=torch.float32, or with a "
        "half-precision frozen base cast the trainable/LoRA parameters to float32): fp16=True is autocast, the "
        "master weights stay fp32", half[0][0])]


# ------------------------------------------------------------------------------------------------------ memory


def _gb(n_bytes: float) -> str:
    return human_bytes(n_bytes, unit="GB")


def _seq_len(setup: Setup) -> int:
    """The longest training sequence: from input_ids, else the dry-run batch, else the max length setting."""
    import torch

    longest = 0
    ds = setup.train_dataset
    i = setup.longest_index(ds) if ds is not None else None
    if i is not None:
        try:
            longest = len(setup.item(ds, i)["input_ids"])
        except Exception:  # noqa: BLE001
            longest = 0
    batch, _ = setup.batch()
    if isinstance(batch, Mapping):
        key = next((k for k in ("input_ids", "inputs_embeds") if k in batch), None)
        value = batch.get(key) if key else None
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            longest = max(longest, int(value.shape[1]))
    if not longest and setup.args.get("max_length"):
        longest = int(setup.args["max_length"])
    return max(longest, 1)


def _lora_estimate(model: Any, peft_config: Any) -> int | None:
    """Trainable values once a not-yet-applied LoRA config is applied (``None`` when it cannot be worked out)."""
    from torch import nn

    r = getattr(peft_config, "r", None)
    targets = getattr(peft_config, "target_modules", None)
    if not isinstance(r, int) or targets is None:
        return None
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if isinstance(targets, str):
            hit = (name != "lm_head" and not name.endswith(".lm_head")) if targets == "all-linear" \
                else re.fullmatch(targets, name) is not None
        else:
            hit = name.split(".")[-1] in set(targets)
        if hit:
            total += r * (module.in_features + module.out_features)
    return total


def _measured_activations(setup: Setup) -> tuple[int, int] | None:
    """Bytes of every leaf module's output in one hooked forward of the dry-run batch, and that batch's size."""
    import torch

    batch, err = setup.batch()
    model = setup.model
    if err is not None or not isinstance(batch, Mapping) or not hasattr(model, "modules"):
        return None
    names, var_kw = setup.forward_params()
    inputs = {k: v for k, v in batch.items() if var_kw or k in names}
    size = next((int(v.shape[0]) for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim()), 0)
    if not size:
        return None
    total = 0

    def hook(_module: Any, _inp: Any, out: Any) -> None:
        nonlocal total
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    was = getattr(model, "training", False)
    try:
        model.eval()
        with torch.no_grad():
            model(**inputs)
    except Exception:  # noqa: BLE001 - a failing forward is reported by the forward checks
        return None
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return total, size


@register("memory-over-budget")
def check_memory(setup: Setup) -> list[Finding]:
    """Estimated training peak (weights, gradients, AdamW states, activations, logits) against ``memory_gb``."""
    budget = setup.args.get("memory_gb")
    model = setup.model
    if not budget or not hasattr(model, "parameters"):
        return []
    explicit = setup.args.get("batch_size")
    batch_size = int(explicit or 8)
    bs_note = "" if explicit else " (batch_size not given: 8 assumed, the Trainer default)"
    mixed = bool(setup.args.get("fp16") or setup.args.get("bf16"))
    seq = _seq_len(setup)
    base = setup.base_model
    flag = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"  # transformers 5 renamed it and warns on the old name
    checkpointing = bool(getattr(base, flag, False))
    # The planner's estimator, so that the doctor and `surefit train` size a model the same way.
    fp = footprint(model, mixed=mixed, measured_act=None)
    weights, train_values, grads = fp.weights, fp.trainable, fp.trainable_bytes
    lora_note = ""
    applied = hasattr(model, "peft_config") or hasattr(model, "get_base_model")
    if setup.peft_config is not None and not applied:
        lora = _lora_estimate(setup.base_model, setup.peft_config)
        train_values = lora if lora is not None else max(1, train_values // 100)
        grads = train_values * 4
        weights += grads
        lora_note = " (LoRA adapters of the given peft_config)"
    optimizer = train_values * 8  # AdamW: exp_avg and exp_avg_sq, fp32 each

    dims = model_dims(model)
    if fp.act_per_token:
        per_token = fp.ckpt_per_token if checkpointing else fp.act_per_token
        acts = math.ceil(batch_size * seq * per_token)
        act_how = (f"{batch_size} x {seq} tokens x {human_bytes(per_token)} a token: hidden {dims['hidden']} x "
                   f"{dims['layers']} layers, from the model config{', gradient checkpointing' if checkpointing else ''}")
    else:
        measured = _measured_activations(setup)
        if measured:
            acts = math.ceil(measured[0] * batch_size / measured[1])
            if mixed:
                acts //= 2
            act_how = f"layer outputs of one forward, scaled to batch {batch_size}"
        else:
            acts, act_how = 0, "unknown: no config and no dry-run forward"
    vocab = dims.get("vocab")
    logits = batch_size * seq * vocab * 4 if setup.is_causal_lm and vocab else 0

    parts = [("weights", weights, ""), ("gradients", grads, lora_note), ("AdamW states", optimizer, ""),
             ("activations", acts, f" ({act_how})")]
    if logits:
        parts.append(("logits", logits, f" ({batch_size} x {seq} x vocab {vocab} x 4 bytes)"))
    total = sum(b for _, b, _ in parts)
    if total <= budget * GB:
        return []
    shown = " + ".join(f"{name} {_gb(b)}{note}" for name, b, note in parts)
    fixed = weights + grads + optimizer
    per_item = (acts + logits) / batch_size
    tips = []
    if fixed < budget * GB and per_item > 0:
        fits = int((budget * GB - fixed) // per_item)
        if 1 <= fits < batch_size:
            tips.append(f"batch_size {fits} with gradient accumulation {math.ceil(batch_size / fits)} (same "
                        "effective batch)")
        elif fits < 1:
            tips.append("even batch_size 1 does not fit at this length: shorten the maximum length")
    else:
        tips.append("weights, gradients and optimizer states alone exceed the budget: train LoRA adapters "
                    "(gradients and AdamW states only for the adapters) or pick a smaller model")
    tips += ["a smaller batch with gradient accumulation", "gradient checkpointing (activations ~1 layer)",
             "LoRA instead of full fine-tuning", "a shorter max length (activations and logits scale with it)"]
    return [Finding(
        "memory-over-budget", "error",
        f"estimated training peak {_gb(total)} exceeds the budget memory_gb={budget}: {shown} = "
        f"{_gb(total)}{bs_note}",
        "; ".join(dict.fromkeys(tips)), "memory_gb")]
