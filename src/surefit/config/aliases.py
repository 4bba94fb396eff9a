"""Other tools' names for surefit's settings: the Hugging Face Trainer's, TRL's, Axolotl's, LLaMA-Factory's.

Where the meaning is the same (``--learning_rate`` is ``--lr``) the name is accepted on the command line, in YAML and
as a Python keyword, and the surefit name is printed once. Where it differs (``--per_device_train_batch_size`` is a
micro-batch on one process; surefit's ``--batch_size`` is the effective batch) the problem says what differs and gives
the exact surefit flags. The CLI and the API resolve names here before :func:`surefit.config.build_config`.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import fields
from typing import Any

from surefit.config import build_config, convert
from surefit.errors import ConfigError, Problem


def build_with_aliases(cls: type, yaml_values: dict[str, Any] | None, overrides: dict[str, Any] | None,
                       yaml_name: str = "config file", keywords: bool = False) -> Any:
    """:func:`~surefit.config.build_config` on settings that may use other tools' names.

    The config's ``alias_notes`` (not a field) say which names were read as which settings. ``keywords=True`` words
    every problem and note as Python keyword arguments (``lr=2e-4``) instead of flags (``--lr 2e-4``).
    """
    known = {f.name for f in fields(cls)}
    problems: list[Problem] = []
    notes: list[str] = []
    given_in = "arguments" if keywords else "command line"
    yaml_values = resolve_layer(yaml_values or {}, known, yaml_name, problems, notes)
    overrides = resolve_layer(overrides or {}, known, given_in, problems, notes)
    try:
        cfg = build_config(cls, yaml_values, overrides, yaml_name=yaml_name, earlier=problems, overrides_name=given_in)
    except ConfigError as e:
        if not keywords:
            raise
        raise ConfigError([Problem(as_keywords(q.what), as_keywords(q.where).rstrip("="), as_keywords(q.fix))
                           for q in e.problems]) from None
    cfg.alias_notes = [as_keywords(n) for n in notes] if keywords else notes  # printed once by the run
    return cfg


# Settings of the Hugging Face Trainer, TRL, Axolotl and LLaMA-Factory that mean what a surefit setting means:
# accepted, and the surefit name printed once.
ALIASES: dict[str, str] = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "gradient_accumulation_steps": "grad_accum",
    "model_name_or_path": "model",
    "base_model": "model",
    "warmup_steps": "warmup",
    "lr_scheduler_type": "lr_scheduler",
    "eval_steps": "eval_every",
    "save_steps": "save_every",
    "logging_steps": "log_every",
    "max_length": "max_seq_length",
    "max_seq_len": "max_seq_length",
    "sequence_len": "max_seq_length",
    "cutoff_len": "max_seq_length",
    "save_total_limit": "keep_checkpoints",
    "per_device_eval_batch_size": "eval_batch_size",
    "resume_from_checkpoint": "resume",
    "metric_for_best_model": "keep_best",
    "lora_rank": "lora_r",
    "lora_target_modules": "lora_targets",
    "target_modules": "lora_targets",
    "lora_target": "lora_targets",
    "bf16": "precision",
    "fp16": "precision",
    "chat_template_path": "chat_format",  # TRL: a Jinja file (or a tokenizer folder's template)
    "chat_template_jinja": "chat_format",  # Axolotl: the Jinja text itself
}

# The Trainer's scheduler names -> surefit's.
_SCHEDULER_NAMES = {"constant_with_warmup": "constant", "warmup_stable_decay": "wsd", "cosine_with_min_lr": "cosine"}


def _alias_value(alias: str, raw: Any) -> tuple[Any, bool]:
    """The value an alias gives its surefit setting, and whether it sets anything (``--bf16 false`` does not)."""
    if alias in ("bf16", "fp16"):
        on = True if raw in ("", None) else convert(raw, bool)
        return alias, on
    if alias == "resume_from_checkpoint" and str(raw).lower() in ("true", ""):
        return "latest", True
    if alias == "lr_scheduler_type":
        return _SCHEDULER_NAMES.get(str(raw), raw), True
    if alias in ("lora_target_modules", "target_modules", "lora_target") and isinstance(raw, list):
        return ",".join(map(str, raw)), True
    return raw, True


def _different(key: str, raw: Any, values: dict[str, Any]) -> Problem | None:
    """A setting of another tool whose surefit counterpart means something else: what differs, and the surefit flags."""
    if key in ("per_device_train_batch_size", "train_batch_size", "micro_batch_size"):
        try:
            micro = int(raw)
        except (TypeError, ValueError):
            micro = 0
        accum = values.get("gradient_accumulation_steps", values.get("grad_accum", 1))
        try:
            accum = int(accum)
        except (TypeError, ValueError):
            accum = 1
        same = (f"for the same run on one process: --batch_size {micro * accum} --grad_accum {accum} "
                f"(on N processes: --batch_size {micro * accum} x N)") if micro > 0 else "e.g. --batch_size 16 --grad_accum 4"
        return Problem(
            f"--{key} {raw} is a micro-batch on one process; surefit's --batch_size is the effective batch (examples "
            "per optimizer step, over every micro-batch and process) and --grad_accum splits it into micro-batches",
            f"--{key}", same)
    if key in ("eval_strategy", "evaluation_strategy"):
        return Problem(f"--{key} {raw}: surefit evaluates at every epoch end", f"--{key}",
                       "add --eval_every N to also evaluate every N steps; --val_fraction 0 (and no --val_data) for "
                       "no evaluation")
    if key in ("save_strategy", "logging_strategy"):
        flag = "--save_every" if key == "save_strategy" else "--log_every"
        return Problem(f"--{key} {raw}: surefit saves a checkpoint at every epoch end and logs every --log_every "
                       "steps", f"--{key}", f"use {flag} N (optimizer steps)")
    if key == "load_best_model_at_end":
        return Problem(f"--{key} {raw}: surefit names the metric to select on", f"--{key}",
                       "use --keep_best METRIC (e.g. --keep_best eval_loss): final/ then holds the best evaluation's model")
    if key == "early_stopping_patience":
        return Problem(f"--{key} {raw}: surefit names the metric with the patience", f"--{key}",
                       f"use --early_stopping METRIC:PATIENCE, e.g. --early_stopping eval_loss:{raw}")
    if key in ("optim", "optimizer"):
        return Problem(f"--{key} {raw}: surefit trains with AdamW (torch's fused kernel where it runs)", f"--{key}",
                       "drop it; --weight_decay, --lr and --lr_scheduler set the update")
    if key == "auto_find_batch_size":
        return Problem(f"--{key} {raw}: surefit never changes the effective batch to fit memory", f"--{key}",
                       "use --gpu_memory_gb auto: the planner picks the micro-batch and accumulation, --batch_size stays")
    return None


_KEYWORD_VALUE = r"(?=[ =](?:[-\d'\"{]|[A-Z]|true\b|false\b|auto\b|none\b|\S*[./]))"


def as_keywords(text: str) -> str:
    """``--lr 2e-4`` -> ``lr=2e-4`` and other ``--name`` -> ``name``: a message in the terms of the Python API."""
    text = re.sub(r"--([a-z][a-z0-9_]*)" + _KEYWORD_VALUE + r"[ =]", r"\1=", text)
    return re.sub(r"--([a-z][a-z0-9_]*)", r"\1", text)




# Axolotl's chat_template values that mean "the model's own template" or "the text in chat_template_jinja".
_OWN_TEMPLATE = {"tokenizer_default", "default", "own"}


def _chat_template_value(values: dict[str, Any], source_name: str, problems: list[Problem],
                         notes: list[str]) -> None:
    """``--chat_template`` takes what people type: true/false, a built-in name or a Jinja file (as TRL's and
    Axolotl's ``chat_template`` do). A name or a file is ``--chat_format``'s value; it is moved there, with a note."""
    raw = values["chat_template"]
    if raw is None or isinstance(raw, bool) or str(raw).lower() in {"1", "0", "true", "false", "yes", "no", "on",
                                                                      "off", "none", "null"}:
        return
    text = str(raw)
    if text.lower() in _OWN_TEMPLATE:
        values["chat_template"] = True
        notes.append(f"--chat_template {text} (in the {source_name}) is read as --chat_template true: the model's own")
        return
    del values["chat_template"]
    if text.lower() == "jinja":  # Axolotl: the template is the text in chat_template_jinja
        if "chat_template_jinja" not in values and "chat_format" not in values:
            problems.append(Problem(f"--chat_template jinja (in the {source_name}) names no template",
                                    "--chat_template", "give the Jinja file: --chat_template FILE.jinja (or "
                                    "--chat_format FILE.jinja)"))
        return
    if "chat_format" in values and str(values["chat_format"]) != text:
        problems.append(Problem(f"--chat_template {text} and --chat_format {values['chat_format']} both given (in "
                                f"the {source_name})", "--chat_template", "keep one: --chat_format FILE.jinja or NAME"))
        return
    values["chat_format"] = text
    notes.append(f"--chat_template {text} (in the {source_name}) is read as --chat_format {text}: the chat template "
                 "to use (a built-in name or a Jinja file); --chat_template itself is true/false")


def resolve_layer(source: dict[str, Any], known: Collection[str], source_name: str, problems: list[Problem],
                  notes: list[str]) -> dict[str, Any]:
    """One layer's settings with other tools' names replaced by surefit's (a note for each), and the settings whose
    meaning differs reported as problems that say the surefit flags to use."""
    values = {str(k).replace("-", "_"): v for k, v in source.items()}
    if "chat_template" in values and "chat_format" in known:
        _chat_template_value(values, source_name, problems, notes)
    out: dict[str, Any] = {}
    for key, raw in values.items():
        if key in known:
            out[key] = raw
            continue
        if key in ALIASES:
            target = ALIASES[key]
            try:
                value, sets = _alias_value(key, raw)
            except ValueError as e:
                problems.append(Problem(f"{e} (in the {source_name})", f"--{key}"))
                continue
            if not sets:
                notes.append(f"--{key} {raw} (in the {source_name}) sets nothing: surefit's --{target} stays as set")
                continue
            if target in values and str(values[target]) != str(value):
                problems.append(Problem(f"--{key} {raw} and --{target} {values[target]} both given (in the "
                                        f"{source_name})", f"--{key}", f"keep one: --{target} is surefit's name"))
                continue
            notes.append(f"--{key} is surefit's --{target}: read as --{target} {value}")
            out[target] = value
            continue
        different = _different(key, raw, values)
        if different is not None:
            problems.append(Problem(f"{different.what} (in the {source_name})", different.where, different.fix))
            continue
        out[key] = raw
    return out


def unknown_flags(unknown: list[str]) -> dict[str, Any]:
    """Leftover argv -> {name: value} so that build_config reports them as unknown settings."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(unknown):
        tok = unknown[i]
        if tok.startswith("--"):
            name, _, value = tok[2:].partition("=")
            if not value and i + 1 < len(unknown) and not unknown[i + 1].startswith("--"):
                value = unknown[i + 1]
                i += 1
            out[name] = value
        else:
            out[f"(stray argument) {tok}"] = tok
        i += 1
    return out
