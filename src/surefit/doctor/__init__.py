"""The doctor: finds training-setup bugs before step 1, for surefit runs and for any PyTorch / Hugging Face setup.

>>> from surefit.doctor import check, check_trainer, explain
>>> report = check(model, tokenizer=tok, train_dataset=ds, data_collator=collator, args={"batch_size": 8})  # doctest: +SKIP
>>> report.has_errors, print(report)                                                                        # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from surefit.doctor.core import CODES, Finding, Report, Setup, run_checks

__all__ = ["check", "check_trainer", "explain", "Finding", "Report", "CODES"]

_CHECK_MODULES = ("surefit.doctor.checks_data", "surefit.doctor.checks_model", "surefit.doctor.checks_run")


def _load_checks() -> None:
    for name in _CHECK_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise


def check(model: Any, tokenizer: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
          data_collator: Any = None, args: Any = None, peft_config: Any = None, task: str | None = None) -> Report:
    """Run every check on a training setup and return the report (nothing is changed or trained).

    Args:
        model: a transformers model (possibly peft-wrapped) or any ``nn.Module``.
        tokenizer: its tokenizer, if any.
        train_dataset, eval_dataset: a ``datasets.Dataset``, a torch ``Dataset`` or a list of dicts.
        data_collator: a callable; ``None`` means torch's default collate.
        args: a ``transformers.TrainingArguments`` or a mapping with any of ``batch_size``, ``fp16``, ``bf16``,
            ``num_workers``, ``multiprocessing_context``, ``remove_unused_columns``, ``max_length``,
            ``generation``, ``memory_gb``, ``tokenize``.
        peft_config: a peft config (e.g. ``LoraConfig``) about to be applied.
        task: ``"sft"``, ``"classify"``, ``"custom"``, or ``None`` (inferred from the model).
    """
    _load_checks()
    return run_checks(Setup(model, tokenizer, train_dataset, eval_dataset, data_collator, args, peft_config, task))


def check_trainer(trainer: Any) -> Report:
    """The same checks, reading the model, datasets, collator and arguments from a ``transformers.Trainer``."""
    return check(trainer.model, getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None),
                 trainer.train_dataset, trainer.eval_dataset, trainer.data_collator, trainer.args)


# A raw error's text -> the codes whose findings can explain it, most specific first.
_PATTERNS: list[tuple[str, tuple[str, ...]]] = [
    (r"expected sequence of length \d+ at dim \d+ \(got \d+\)", ("labels-not-padded", "ragged-batch")),
    (r"each element in list of batch should be of equal size", ("ragged-batch", "labels-not-padded")),
    (r"Target size \(.*\) must be the same as input size", ("label-dtype", "label-one-hot")),
    (r"Expected input batch_size \(\d+\) to match target batch_size", ("label-one-hot",)),
    (r"stack expects each tensor to be equal size", ("ragged-batch", "labels-not-padded")),
    (r"Unable to create tensor.*padding", ("labels-not-padded", "ragged-batch", "label-not-numeric")),
    (r"mat1 and mat2 shapes cannot be multiplied", ("input-dim-mismatch",)),
    (r"got an unexpected keyword argument '(\w+)'", ("unexpected-columns",)),
    (r"only integer tensors of a single element can be converted to an index", ("label-not-numeric",
                                                                                 "label-one-hot")),
    (r"too many dimensions 'str'|new\(\): invalid data type 'str'", ("label-not-numeric",)),
    (r"Target -?\d+ is out of bounds|out of bounds", ("label-out-of-range",)),
    (r"index out of range in self", ("token-id-out-of-range", "token-type-out-of-range", "sequence-too-long")),
    (r"expected scalar type Long but found Float|expected .*Long.*Float|result type Float can't be cast",
     ("label-dtype",)),
    (r"0D or 1D target tensor expected, multi-target not supported", ("label-one-hot",)),
    (r"Cannot handle batch sizes > 1 if no padding token is defined", ("classifier-no-pad-id",)),
    (r"Asking to pad but the tokenizer does not have a padding token", ("no-pad-token",)),
    (r"out of memory", ("memory-over-budget",)),
    (r"(Can't|cannot) pickle|pickl", ("unpicklable-worker-data",)),
    (r"Attempting to unscale FP16 gradients", ("fp16-master-weights",)),
    (r"Target modules .* not found", ("lora-targets-missing",)),
    (r"does not require grad|element 0 of tensors does not require grad", ("no-labels",)),
    (r"must have the same dtype", ("input-dim-mismatch",)),
]


def explain(exc: BaseException, model: Any = None, tokenizer: Any = None, train_dataset: Any = None,
            eval_dataset: Any = None, data_collator: Any = None, args: Any = None, peft_config: Any = None,
            task: str | None = None) -> Finding:
    """The finding that explains a raw exception from a failed run.

    The checks run on the same setup; the first finding whose code matches the exception's text is returned
    (that finding names the real cause, e.g. the collator that leaves ``labels`` unpadded). Without a setup, or
    when no check confirms it, a finding built from the text alone says what such an error usually means.
    """
    text = f"{type(exc).__name__}: {exc}"
    candidates: tuple[str, ...] = ()
    for pattern, codes in _PATTERNS:
        if re.search(pattern, text, flags=re.IGNORECASE | re.DOTALL):
            candidates = codes
            break
    if model is not None:
        report = check(model, tokenizer, train_dataset, eval_dataset, data_collator, args, peft_config, task)
        for code in candidates:
            for f in report.findings:
                if f.code == code:
                    return f
        errors = [f for f in report.findings if f.severity == "error"]
        if not candidates and errors:
            return errors[0]
    if candidates:
        return Finding(candidates[0], "error", f"{text.splitlines()[0]} — this error usually means: "
                       f"{CODES[candidates[0]]}", "pass the model, datasets and collator to explain() to confirm "
                       "the cause; surefit.doctor.check() lists every problem of the setup")
    return Finding("forward-failed", "error", f"{text.splitlines()[0]} (no known cause matched)",
                   "run surefit.doctor.check() on the setup for its findings")
