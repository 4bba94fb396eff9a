"""The doctor: finds training-setup bugs before step 1, for surefit runs and for any PyTorch / Hugging Face setup.

>>> from surefit.doctor import check, check_trainer, explain
>>> report = check(model, tokenizer=tok, train_dataset=ds, data_collator=collator, args={"batch_size": 8})  # doctest: +SKIP
>>> report.has_errors, print(report)                                                                        # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, TypedDict, Unpack

# Importing the check modules registers their checks (core.register).
from surefit.doctor import (  # noqa: F401
    checks_chat,
    checks_data,
    checks_dpo,
    checks_labels,
    checks_model,
    checks_run,
)
from surefit.doctor.core import CODES, Finding, Report, Setup, normalise_args, run_checks
from surefit.doctor.patterns import codes_in

__all__ = ["check", "check_trainer", "explain", "Finding", "Report", "CODES"]


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
    return run_checks(Setup(model, tokenizer, train_dataset, eval_dataset, data_collator, args, peft_config, task))


def check_trainer(trainer: Any) -> Report:
    """The same checks on a ``transformers.Trainer`` (or a TRL trainer), with each batch built as the trainer will.

    The model, datasets, collator and arguments are read from the trainer. With ``remove_unused_columns=True`` the
    items lose the columns the trainer drops before collating: the trainer's own signature columns (it computes
    them with ``_set_signature_columns_if_needed()``; TRL's trainers set their own list there), else the model's
    forward parameters plus ``label``, ``label_ids`` and ``label_names``. TRL prepares (tokenises) its datasets
    when the trainer is built, so ``trainer.train_dataset`` already holds what its collator receives.
    """
    tok = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
    args = normalise_args(trainer.args)
    if getattr(trainer, "label_names", None) is not None:
        args["label_names"] = list(trainer.label_names)
    columns = None
    if args.get("remove_unused_columns"):
        setter = getattr(trainer, "_set_signature_columns_if_needed", None)
        try:
            if callable(setter):
                setter()
            columns = getattr(trainer, "_signature_columns", None)
        except Exception:  # noqa: BLE001 - the columns are then derived from the model, as the Trainer does
            columns = None
    return run_checks(Setup(trainer.model, tok, trainer.train_dataset, trainer.eval_dataset, trainer.data_collator,
                            args, None, None, signature_columns=columns))




_DRY_RUN_FAILURES = ("forward-failed", "collate-failed", "dataset-item-failed")


class SetupObjects(TypedDict, total=False):
    """:func:`check`'s parameters by name: what :func:`explain` takes as keywords (a type checker sees typos)."""

    model: Any
    tokenizer: Any
    train_dataset: Any
    eval_dataset: Any
    data_collator: Any
    args: Any
    peft_config: Any
    task: str | None


def explain(exc: BaseException, *setup: Any, **named: Unpack[SetupObjects]) -> Finding:
    """The finding that explains a raw exception from a failed run.

    ``setup``, ``named``: the setup exactly as :func:`check` takes it (``model``, ``tokenizer``, ``train_dataset``,
    ``eval_dataset``, ``data_collator``, ``args``, ``peft_config``, ``task``; by position or by name), or nothing.
    With a setup, the checks run on it and what the dry run confirmed wins:

    * a finding whose code the error's text points at (it names the object at fault);
    * else another error the checks found: the text and the setup disagree, and the message says so;
    * else "unknown cause", with the raw error attached and the causes such an error can have, never a guess.

    Without a setup the text alone is read: a finding that says what such an error usually means (marked as not
    confirmed), or "unknown cause" when no known pattern matches.
    """
    text = f"{type(exc).__name__}: {exc}"
    first = text.splitlines()[0]
    found = codes_in(text)
    candidates = found[0] if found else ()
    usual = "; or ".join(f"[{c}] {CODES[c]}" for c in candidates)
    if (setup[0] if setup else named.get("model")) is None:
        if candidates:
            return Finding(candidates[0], "error", f"{first} — this error usually means: {usual} (not confirmed: "
                           "no setup was given)", "pass the model, datasets and collator to explain() to confirm "
                           "the cause; surefit.doctor.check() lists every problem of the setup")
        return Finding("forward-failed", "error", f"unknown cause: no known pattern matches the raw error: {first}",
                       "run surefit.doctor.check() on the setup for its findings")
    report = check(*setup, **named)
    for code in candidates:
        for f in report.findings:
            if f.code == code and f.severity != "info":
                return f
    errors = [f for f in report.findings if f.severity == "error"]
    specific = [f for f in errors if f.code not in _DRY_RUN_FAILURES]
    if specific:
        f = specific[0]
        if not candidates:
            return f
        return Finding(f.code, f.severity, f"the error text (`{first}`) usually means {usual}, but the dry run of this "
                       f"setup does not show that; it shows this instead: {f.message}", f.fix, f.where)
    dry = next((f for f in errors if f.code in _DRY_RUN_FAILURES), None)
    seen = f"; the dry run also fails: {dry.message}" if dry else "; the dry run of this setup runs without error"
    code = dry.code if dry else "forward-failed"
    maybe = f" Errors like this one often come from: {usual}, which the checks did not find here." if usual else ""
    return Finding(code, "error", f"unknown cause: raw error `{text.strip()[:500]}`{seen}.{maybe}",
                   (dry.fix + "; " if dry else "") + "run the failing step by hand for the full traceback, and "
                   "compare the batch it got with the dry run's", dry.where if dry else "")
