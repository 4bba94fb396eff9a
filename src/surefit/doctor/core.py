"""The doctor's framework: findings, the report, the registry of codes, and the normalised setup checks read.

A check is a plain function ``(setup: Setup) -> list[Finding]`` registered with :func:`register`. Checks are
independent: each reads the :class:`Setup` (model, tokenizer, datasets, collator, settings) and never changes it.
The expensive material (a handful of items including the longest, their collated batch, one forward pass) is
computed once, lazily, by :class:`Setup` and shared; an exception there is kept and turned into a finding, never
shown raw.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One problem (or note) about a training setup.

    Attributes:
        code: stable identifier from :data:`CODES`, e.g. ``"labels-not-padded"``.
        severity: ``"error"`` (training would crash or silently learn the wrong thing), ``"warning"``, ``"info"``.
        message: what is wrong, with the offending value.
        fix: what to do, in the user's terms.
        where: the place: column, row, layer name, batch key.
    """

    code: str
    severity: Severity
    message: str
    fix: str = ""
    where: str = ""

    def __str__(self) -> str:
        """``[code] where: message`` and ``  fix: ...``: how the docs show a finding (``print(explain(e, ...))``)."""
        where = f" {self.where}:" if self.where else ""
        return f"[{self.code}]{where} {self.message}" + (f"\n  fix: {self.fix}" if self.fix else "")


_MARK = {"error": "✗", "warning": "!", "info": "i"}

# The doctor's split (``Report.seconds``, ``--profile``): its one forward, which every check that needs the model's
# output reads, is named apart from the check that happened to ask for it first.
DRY_RUN = "dry run (the forward the checks share)"


@dataclass
class Report:
    """Every finding of one check run, errors first."""

    findings: list[Finding] = field(default_factory=list)
    checks_run: int = 0
    # each check's wall seconds, by the codes it reports (``--profile`` shows the longest); a report read back from
    # the start-up cache ran none and has none
    seconds: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def __str__(self) -> str:
        if not self.findings:
            return f"✓ no problems found ({self.checks_run} checks)"
        errors = sum(f.severity == "error" for f in self.findings)
        lines = [f"doctor: {errors} error{'s' if errors != 1 else ''}, {len(self.findings) - errors} other finding"
                 f"{'s' if len(self.findings) - errors != 1 else ''} ({self.checks_run} checks)"]
        for i, f in enumerate(self.findings, 1):
            where = f" {f.where}:" if f.where else ""
            lines.append(f"{_MARK[f.severity]} {i}. [{f.code}]{where} {f.message}")
            if f.fix:
                lines.append(f"     fix: {f.fix}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"has_errors": self.has_errors, "findings": [f.__dict__ for f in self.findings]}, indent=2)


# Every code the doctor can report, with what it catches (README and `surefit doctor --list` print this).
CODES: dict[str, str] = {
    "labels-not-padded": "the collator leaves ragged `labels` (LM collator with pre-built labels, padding collator "
                         "with token labels)",
    "eos-masked": "pad == eos and the collator masks pad ids in labels: the model never learns to stop",
    "eos-missing": "causal-LM training sequences do not end with EOS",
    "no-supervised-tokens": "examples or batches whose labels are all -100 (loss NaN), e.g. answer truncated away",
    "labels-preshifted": "labels already shifted left for a model that shifts internally",
    "ragged-batch": "default collate over variable-length items",
    "label-out-of-range": "class id outside [0, num_labels) (num_labels from the config, else the logits), including -1",
    "label-dtype": "label dtype does not fit the loss (float for cross-entropy, integer for BCE / regression), for "
                   "any model: read from the logits and confirmed by a probe",
    "label-not-numeric": "string labels reaching tensors",
    "label-one-hot": "one-hot labels given to a single-label cross-entropy (integer one-hot vectors, which no loss "
                     "takes)",
    "input-dim-mismatch": "an input's feature dimension differs from what the first consuming layer expects",
    "unexpected-columns": "batch keys the forward does not accept",
    "no-labels": "nothing reaches the model as labels, so it cannot return a loss",
    "token-id-out-of-range": "token ids >= embedding rows (tokens added without resizing)",
    "sequence-too-long": "sequences longer than the model's position limit",
    "no-max-length": "truncation requested but neither the tokenizer nor the settings give a maximum length",
    "token-type-out-of-range": "token_type_ids >= the model's type vocabulary",
    "no-pad-token": "padding needed and the tokenizer has no pad token",
    "classifier-no-pad-id": "a decoder-only classifier without config.pad_token_id and batches > 1",
    "double-bos": "sequences start with two BOS tokens",
    "generation-right-padding": "batched generation with a decoder-only model and right padding",
    "missing-attention-mask": "padded inputs without an attention mask",
    "lora-targets-missing": "LoRA target modules not present in the model",
    "unpicklable-worker-data": "workers > 0 and the dataset or collator cannot be pickled",
    "empty-dataset": "a split with no rows",
    "split-leakage": "validation rows (normalised) also in training",
    "fp16-master-weights": "trainable fp16 parameters under fp16 mixed precision",
    "memory-over-budget": "the estimated peak exceeds the device memory budget",
    "label-shape": "labels shaped for another head: per-token labels (e.g. an MLM collator's) for a sequence "
                   "classifier, or one label per sequence for a token classifier",
    "labels-pad-trained": "labels trained on padded positions (attention mask 0, or after the row's end), whatever "
                          "the pad id (pad == eos included); seq2seq labels padded with the pad id",
    "token-labels-misaligned": "per-token labels whose length differs from input_ids before padding (word-level "
                               "tags not aligned to sub-word tokens)",
    "new-head-frozen": "layers the loader initialised fresh (classifier, score, pooler) that stay frozen under PEFT "
                       "(not trainable, not in modules_to_save)",
    "turn-end-masked": "the chat template's end-of-turn token after a trained answer has label -100",
    "assistant-mask-degenerate": "a TRL assistant / completion mask of all ones or all zeros",
    "scaffold-masked": "template scaffolding before an answer (think block, channel header) masked while the "
                       "answer is trained",
    "chat-template-differs": "the tokenizer's chat template differs from the one the model ships",
    "dataset-item-failed": "the dry run could not read an item from the dataset",
    "collate-failed": "the dry run could not collate a batch",
    "forward-failed": "the dry run's forward pass or loss failed",
    "nonfinite-weights": "the model as loaded holds NaN or infinite weights (a damaged or badly converted file): "
                         "every loss would be NaN whatever the rows",
}


CheckFn = Callable[["Setup"], list[Finding]]
REGISTRY: list[tuple[str, CheckFn]] = []


def register(*codes: str) -> Callable[[CheckFn], CheckFn]:
    """Register a check that may report the given codes."""
    for c in codes:
        if c not in CODES:
            raise ValueError(f"unknown finding code {c!r}")

    def deco(fn: CheckFn) -> CheckFn:
        REGISTRY.append((",".join(codes), fn))
        return fn

    return deco


# ------------------------------------------------------------------------------------------------------------ setup


ARG_KEYS = ("batch_size", "fp16", "bf16", "num_workers", "multiprocessing_context", "remove_unused_columns",
            "label_names", "max_length", "generation", "memory_gb", "tokenize")


def normalise_args(args: Any) -> dict[str, Any]:
    """A TrainingArguments or a mapping -> a plain dict with the keys in :data:`ARG_KEYS` (missing ones absent)."""
    if args is None:
        return {}
    if isinstance(args, Mapping):
        unknown = set(args) - set(ARG_KEYS)
        if unknown:
            raise TypeError(f"unknown doctor args {sorted(unknown)}; known: {', '.join(ARG_KEYS)}")
        return dict(args)
    # transformers.TrainingArguments (or anything shaped like it)
    out: dict[str, Any] = {}
    mapping = {"per_device_train_batch_size": "batch_size", "fp16": "fp16", "bf16": "bf16",
               "dataloader_num_workers": "num_workers", "remove_unused_columns": "remove_unused_columns",
               "label_names": "label_names",
               "generation_max_length": "max_length", "predict_with_generate": "generation"}
    for src, dst in mapping.items():
        if hasattr(args, src) and getattr(args, src) is not None:
            out[dst] = getattr(args, src)
    return out


@dataclass(eq=False)
class Setup:
    """What the checks read: the user's objects under their Trainer names, plus lazily computed samples, batch and
    forward pass (compared by identity).

    Attributes:
        model, tokenizer, train_dataset, eval_dataset, data_collator, peft_config, task: as given.
        args: normalised settings (see :func:`normalise_args`).
        signature_columns: the columns a Trainer keeps (its own ``_signature_columns`` when a trainer was given);
            ``None``: derived from the model.
        call: how the run calls the model on a collated batch, ``(model, batch) -> output with logits``, when it is
            not a Trainer's ``model(**batch)``: surefit's own tasks hand in theirs (sft passes no labels to the model
            and computes the loss itself), so the dry run is the forward training runs. ``None``: ``model(**keys the
            forward accepts)``. Probes that replace keys always call the model directly.
        sample: items in the dry run, the first ``sample - 1`` and the longest (None: :attr:`SAMPLE`). surefit's own
            runs take 2 (the first row and the longest): its encoder has checked every row already, and the dry run's
            forward, one step's worth of work before step 1, costs in proportion to its rows.
    """

    SAMPLE: ClassVar[int] = 4  # items in the dry run by default: the first few plus the longest

    model: Any
    tokenizer: Any = None
    train_dataset: Any = None
    eval_dataset: Any = None
    data_collator: Callable | None = None
    args: Any = None
    peft_config: Any = None
    task: str | None = None
    signature_columns: Sequence[str] | None = None
    call: Callable[[Any, Mapping[str, Any]], Any] | None = None
    sample: int | None = None
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    # seconds of the work the checks share (the dry run's forward), counted apart from the check that asked first
    shared_seconds: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.args = normalise_args(self.args)
        if self.signature_columns is not None:
            self.signature_columns = list(self.signature_columns)

    # -- basic facts
    @property
    def collator(self) -> Callable:
        if self.data_collator is not None:
            return self.data_collator
        from torch.utils.data import default_collate

        return default_collate

    @property
    def config(self) -> Any:
        m = self.base_model
        return getattr(m, "config", None)

    @property
    def base_model(self) -> Any:
        m = self.model
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()
        return getattr(m, "module", m)

    @property
    def is_decoder_only(self) -> bool:
        """A decoder-only transformer (GPT/Llama family), whatever head it carries."""
        cfg = self.config
        if cfg is None or getattr(cfg, "is_encoder_decoder", False):
            return False
        return getattr(cfg, "model_type", "") not in ENCODER_TYPES

    @property
    def is_causal_lm(self) -> bool:
        name = type(self.base_model).__name__
        return name.endswith(("ForCausalLM", "LMHeadModel")) or self.task == "sft"

    def forward_params(self) -> tuple[set[str], bool]:
        """The forward's parameter names and whether it takes ``**kwargs``."""
        params = inspect.signature(self.base_model.forward).parameters.values()
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        return names, any(p.kind is p.VAR_KEYWORD for p in params)

    # -- data access
    @staticmethod
    def length(ds: Any) -> int | None:
        try:
            return len(ds)
        except TypeError:
            return None

    def kept_columns(self) -> set[str] | None:
        """The item keys the trainer passes on to the collator, or ``None`` when it passes every key.

        With ``remove_unused_columns=True`` transformers' Trainer keeps only its signature columns: the names of
        the (unwrapped) model's forward parameters plus ``label``, ``label_ids`` and ``label_names`` (by default
        the forward's parameters that contain "label"). A TRL trainer sets its own list; :func:`check_trainer`
        reads it from the trainer itself.
        """
        if self.args.get("remove_unused_columns") is not True:
            return None
        if self.signature_columns is not None:
            return set(self.signature_columns)
        try:
            params = list(inspect.signature(self.base_model.forward).parameters)
        except (TypeError, ValueError):
            return None
        label_names = self.args.get("label_names")
        if label_names is None:
            qa = "QuestionAnswering" in type(self.base_model).__name__
            label_names = [p for p in params if "label" in p or (qa and p in ("start_positions", "end_positions"))]
        return set(params) | {"label", "label_ids"} | set(label_names)

    def dropped_columns(self) -> list[str]:
        """Item keys the column removal took out of the dry run's items (in first-seen order)."""
        self.samples()
        return list(self._cache.get("dropped_columns", {}))

    def item(self, ds: Any, i: int) -> Any:
        """Item ``i`` of a dataset as the trainer's collator will receive it (unused columns removed)."""
        value = ds[i]
        keep = self.kept_columns()
        if keep is None or not isinstance(value, Mapping):
            return value
        dropped = self._cache.setdefault("dropped_columns", {})
        for k in value:
            if k not in keep:
                dropped.setdefault(k, None)
        return {k: v for k, v in value.items() if k in keep}

    def sample_indices(self, ds: Any) -> list[int]:
        """The first few items and the longest one (by ``input_ids`` length), where the dataset can say."""
        n, size = self.length(ds) or 0, self.sample or self.SAMPLE
        idx = list(range(min(size - 1, n)))
        longest = self.longest_index(ds)
        if longest is not None and longest not in idx:
            idx.append(longest)
        elif self.sample is not None and len(idx) < n:
            idx.append(len(idx))  # the longest is among the first rows: one more, so the batch has `sample` rows
        return idx

    def longest_index(self, ds: Any) -> int | None:
        key = "longest_index"
        if key in self._cache:
            return self._cache[key]
        best = None
        try:
            column = ds["input_ids"] if hasattr(ds, "column_names") else None
        except Exception:  # noqa: BLE001
            column = None
        if column is not None:
            lengths = [len(x) for x in column]
            best = max(range(len(lengths)), key=lengths.__getitem__) if lengths else None
        elif isinstance(ds, list) and ds and isinstance(ds[0], Mapping) and "input_ids" in ds[0]:
            best = max(range(len(ds)), key=lambda i: len(ds[i].get("input_ids", [])))
        self._cache[key] = best
        return best

    def samples(self) -> tuple[list[tuple[int, Any]], Exception | None]:
        """``[(index, item)]`` from the training set for the dry run, and the error if reading one failed."""
        if "samples" not in self._cache:
            items: list[tuple[int, Any]] = []
            error = None
            if self.train_dataset is not None:
                for i in self.sample_indices(self.train_dataset):
                    try:
                        items.append((i, self.item(self.train_dataset, i)))
                    except Exception as e:  # noqa: BLE001 - reported as dataset-item-failed
                        error = e
                        self._cache["failed_index"] = i
                        break
            self._cache["samples"] = (items, error)
        return self._cache["samples"]

    def batch_items(self) -> list[Any]:
        """The items :meth:`batch` hands to the collator, in batch-row order (empty when reading one failed)."""
        items, error = self.samples()
        if not items or error is not None:
            return []
        size = max(2, min(len(items), int(self.args.get("batch_size") or len(items))))
        return [it for _, it in items[:size]]

    def batch(self) -> tuple[Any, Exception | None]:
        """The collated dry-run batch (at most ``args['batch_size']`` items), or the collate error."""
        if "batch" not in self._cache:
            items = self.batch_items()
            batch, err = None, None
            if items:
                try:
                    batch = _to_device(self.collator(items), _model_device(self.model))
                except Exception as e:  # noqa: BLE001 - reported as collate-failed or explained
                    err = e
            self._cache["batch"] = (batch, err)
        return self._cache["batch"]

    def forward(self) -> tuple[Any, Exception | None]:
        """One forward pass on the dry-run batch (keys the forward accepts, or as :attr:`call` runs it), under
        no_grad."""
        if "forward" not in self._cache:
            import torch

            batch, err = self.batch()
            out, ferr = None, None
            if batch is not None and isinstance(batch, Mapping):
                names, var_kw = self.forward_params()
                inputs = {k: v for k, v in batch.items() if var_kw or k in names}
                was = getattr(self.model, "training", False)
                # transformers writes a guessed config.problem_type on the first forward with labels; the doctor
                # must not change the model it checks.
                problem_type = getattr(self.config, "problem_type", None)
                began = time.perf_counter()
                try:
                    self.model.eval()
                    with torch.no_grad():
                        out = self.model(**inputs) if self.call is None else self.call(self.model, batch)
                except Exception as e:  # noqa: BLE001 - explained or reported as forward-failed
                    ferr = e
                finally:
                    self.shared_seconds[DRY_RUN] = time.perf_counter() - began
                    self.model.train(was)
                    if self.config is not None and hasattr(self.config, "problem_type"):
                        self.config.problem_type = problem_type
            self._cache["forward"] = (out, ferr)
        return self._cache["forward"]

    def label_keys(self) -> list[str]:
        """The batch keys that carry targets (``labels``, ``label``, ``label_ids`` and the forward's ``*label*``)."""
        batch, _ = self.batch()
        if not isinstance(batch, Mapping):
            return []
        try:
            names, _ = self.forward_params()
        except (TypeError, ValueError):
            names = set()
        return [k for k in batch if k in ("labels", "label", "label_ids") or ("label" in k and k in names)]

    def logits(self) -> Any:
        """The head's output on the dry-run batch (what the loss compares with the labels), or ``None``.

        A forward without the label keys comes first (a model then returns its logits without computing a loss);
        when that fails, the output of the last leaf module that ran (the head, before a loss that failed) stands in.
        """
        if "logits" not in self._cache:
            self._cache["logits"] = self._find_logits()
        return self._cache["logits"]

    def _find_logits(self) -> Any:
        import torch
        from torch import nn

        batch, _ = self.batch()
        if not isinstance(self.model, nn.Module):
            return None
        if isinstance(batch, (tuple, list)) and len(batch) >= 2 and all(isinstance(b, torch.Tensor) for b in batch):
            return self._tuple_logits(batch)
        if not isinstance(batch, Mapping):
            return None
        try:
            names, var_kw = self.forward_params()
        except (TypeError, ValueError):
            return None
        size = next((int(v.shape[0]) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), None)
        # The dry run's forward (with labels) is one the other checks need anyway: when it passes, its logits are
        # the head's output and no second forward is run (a forward is most of the doctor's time on a real model).
        cached = self.forward() if isinstance(self.model, nn.Module) else self._cache.get("forward")
        if cached is not None and cached[1] is None:
            found = _logits_of(cached[0], size)
            if found is not None:
                return found
        labels = set(self.label_keys())
        full = {k: v for k, v in batch.items() if var_kw or k in names}
        last: list[Any] = []

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point() and output.dim() >= 1 \
                    and (size is None or output.shape[0] == size):
                last[:] = [output]

        # a head is a linear layer: the output of another leaf (an embedding, a norm) is no prediction
        handles = [m.register_forward_hook(hook) for m in self.model.modules()
                   if not list(m.children()) and isinstance(m, nn.Linear)]
        was = getattr(self.model, "training", False)
        problem_type = getattr(self.config, "problem_type", None)
        try:
            self.model.eval()
            for inputs in ({k: v for k, v in full.items() if k not in labels}, full):
                last.clear()
                try:
                    with torch.no_grad():
                        out = self.model(**inputs)
                except Exception:  # noqa: BLE001 - the head's output may still have been seen
                    if last:
                        return last[0]
                    continue
                found = _logits_of(out, size)
                if found is not None:
                    return found
                if last:
                    return last[0]
        finally:
            for h in handles:
                h.remove()
            self.model.train(was)
            if self.config is not None and hasattr(self.config, "problem_type"):
                self.config.problem_type = problem_type
        return None

    def _tuple_logits(self, batch: Sequence[Any]) -> Any:
        """``(inputs..., target)`` batches of a plain PyTorch loop: the model gets the inputs, the loss the last."""
        import torch

        was = getattr(self.model, "training", False)
        try:
            self.model.eval()
            with torch.no_grad():
                out = self.model(*batch[:-1])
        except Exception:  # noqa: BLE001 - no logits to compare with
            return None
        finally:
            self.model.train(was)
        return _logits_of(out, int(batch[0].shape[0]) if batch[0].dim() else None)

    def probe(self, replace: Mapping[str, Any]) -> Exception | None:
        """Run the forward on the dry-run batch with some keys replaced; the error, or ``None`` if it passed.

        The doctor confirms a cause this way: if the forward fails as given and passes with the labels as the
        cause says they should be, the cause is the one.
        """
        import torch

        batch, _ = self.batch()
        if not isinstance(batch, Mapping):
            return None
        names, var_kw = self.forward_params()
        inputs = {k: v for k, v in {**batch, **replace}.items() if var_kw or k in names}
        was = getattr(self.model, "training", False)
        problem_type = getattr(self.config, "problem_type", None)
        try:
            self.model.eval()
            with torch.no_grad():
                self.model(**inputs)
        except Exception as e:  # noqa: BLE001 - the probe's verdict
            return e
        finally:
            self.model.train(was)
            if self.config is not None and hasattr(self.config, "problem_type"):
                self.config.problem_type = problem_type
        return None


def input_embeddings(model: Any) -> Any:
    """The model's input embedding module, or ``None`` where it has none (or does not say)."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        return None


def _model_device(model: Any) -> Any:
    """Where a model takes its inputs: its input embeddings' device (a model spread by ``device_map`` starts there),
    else its first parameter's; ``None`` for anything that is not an ``nn.Module`` with parameters."""
    from torch import nn

    if not isinstance(model, nn.Module):
        return None
    weight = getattr(input_embeddings(model), "weight", None)
    if weight is not None:
        return weight.device
    return next((p.device for p in model.parameters()), None)


def _to_device(batch: Any, device: Any) -> Any:
    """The collated batch on the model's device, as a Trainer or the run's loop hands it over (a model on a GPU, a
    quantised one placed there at load, gets GPU tensors); anything that is not a tensor is left as it is."""
    import torch

    values = batch.values() if isinstance(batch, Mapping) else batch if type(batch) in (tuple, list) else [batch]
    if device is None or all(v.device == device for v in values if isinstance(v, torch.Tensor)):
        return batch  # already there (a CPU run): the collator's own object, untouched

    def move(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v

    if isinstance(batch, Mapping):
        return {k: move(v) for k, v in batch.items()}
    return type(batch)(move(v) for v in batch) if type(batch) in (tuple, list) else move(batch)


def _logits_of(out: Any, batch_size: int | None) -> Any:
    """The logits in a forward's output: ``.logits``, ``["logits"]``, the tensor itself, or the first floating
    tensor in a tuple/list/dict whose first dimension is the batch (a loss, a scalar, comes first and is skipped)."""
    import torch

    value = getattr(out, "logits", None)
    if value is None and isinstance(out, Mapping):
        value = out.get("logits")
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(out, torch.Tensor):
        return out if out.dim() >= 1 else None
    parts = list(out.values()) if isinstance(out, Mapping) else list(out) if isinstance(out, (tuple, list)) else []
    for v in parts:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 1 and (
                batch_size is None or v.shape[0] == batch_size):
            return v
    return None


ENCODER_TYPES = {"bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta",
                 "mpnet", "camembert", "ernie", "t5", "bart", "mbart"}


def describe(value: Any) -> str:
    """Shape and dtype of a tensor, or type and length of anything else, for messages."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, (list, tuple)):
        inner = f" of {type(value[0]).__name__}" if value else ""
        return f"{type(value).__name__}[{len(value)}]{inner}"
    return type(value).__name__


def run_checks(setup: Setup, only: Sequence[str] | None = None) -> Report:
    """Run every registered check (or those reporting codes in ``only``) and collect the findings."""
    findings: list[Finding] = []
    seconds: dict[str, float] = {}
    n = 0
    for codes, fn in REGISTRY:
        if only and not set(codes.split(",")) & set(only):
            continue
        n += 1
        began, shared = time.perf_counter(), sum(setup.shared_seconds.values())
        try:
            findings += fn(setup)
        except Exception as e:  # noqa: BLE001 - a check that crashes must not hide the others' findings
            findings.append(Finding("forward-failed" if "forward" in codes else codes.split(",")[0], "warning",
                                    f"the check for {codes} could not run: {type(e).__name__}: {e}"))
        own = time.perf_counter() - began - (sum(setup.shared_seconds.values()) - shared)
        seconds[codes] = seconds.get(codes, 0.0) + max(0.0, own)
    order = {"error": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda f: order[f.severity])
    seconds.update(setup.shared_seconds)
    return Report(findings, n, dict(sorted(seconds.items(), key=lambda kv: -kv[1])))
