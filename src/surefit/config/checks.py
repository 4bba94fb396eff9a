"""Checks of config values that take more than a range: the training-control settings (metric goals), trackers,
the output folder. ``config/__init__.py``'s dataclasses call them from their ``problems()``.
"""

from __future__ import annotations

import difflib
import math
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from surefit.errors import Problem

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class ControlSettings(Protocol):
    """The training-control settings :func:`training_control_problems` reads: every task's config has them
    (``config/__init__.py``'s ``TrainConfig``, which imports this module, so it is described here, not imported)."""

    task: str
    val_data: str | None
    val_fraction: float
    lr: float
    min_lr: float
    warmup: float | None
    max_steps: int | None
    eval_every: int
    log_samples: int
    early_stopping: str | None
    keep_best: str | None

EXAMPLES = {"lr": "2e-4", "weight_decay": "0.01", "max_grad_norm": "1.0 (0 turns clipping off)", "warmup_ratio": "0.05",
             "lora_dropout": "0.05", "val_fraction": "0.1", "warmup": "100 (steps) or 0.05 (of the steps)",
            "min_lr": "0", "max_memory_gb": "8"}


NONFINITE = "must be a finite number"


def nonfinite_problems(cfg: DataclassInstance) -> list[Problem]:
    """Every float setting of ``cfg`` that is NaN or infinite, whatever its name: one check over the dataclass's
    fields, so a float setting added later is covered. NaN passes every range check (``nan < 0`` is False), and
    the optimizer or scheduler would raise on it only after the run started."""
    import dataclasses

    p: list[Problem] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            default = f.default if isinstance(f.default, (int, float)) and not isinstance(f.default, bool) else None
            example = EXAMPLES.get(f.name, default if default is not None and math.isfinite(default) else "0.1")
            p.append(Problem(f"{NONFINITE} (got {value})", f"--{f.name}", f"e.g. --{f.name} {example}"))
    return p


# Words in a metric's name saying lower is better; for scores (f1, accuracy, exact match ...) higher is.
_LOWER_BETTER = {"loss", "mse", "mae", "rmse", "perplexity", "error"}
_HIGHER_BETTER = {"f1", "accuracy", "acc", "em", "exact", "precision", "recall", "rouge", "rougel", "auc", "pearson",
                  "spearman", "r2", "mcc", "bleu"}


class MetricGoal(typing.NamedTuple):
    """A metric to select or stop on: its name, which way is better ('min' or 'max'), the patience (early stopping)."""

    metric: str
    mode: str
    patience: int = 0


def parse_metric_goal(value: str, flag: str, with_patience: bool) -> tuple[MetricGoal | None, list[Problem]]:
    """``METRIC[:PATIENCE][:min|max]`` -> a goal (the direction from the name unless given), or the problems."""
    parts = [t.strip() for t in str(value).split(":")]
    mode = parts.pop() if parts[-1] in ("min", "max") else None
    example = "e.g. eval_loss:3 or eval_f1:2" if with_patience else "e.g. eval_loss or eval_f1"
    if not parts or not parts[0] or len(parts) != 1 + with_patience:
        return None, [Problem(f"expected {'METRIC:PATIENCE' if with_patience else 'METRIC'} (got {value!r})", flag,
                              example)]
    metric = parts[0] if parts[0].startswith("eval_") else f"eval_{parts[0]}"
    patience = int(parts[1]) if with_patience and parts[1].isdigit() else 0
    if with_patience and patience < 1:
        return None, [Problem(f"PATIENCE must be a whole number >= 1 (got {parts[1]!r} in {value!r})", flag, example)]
    words = set(metric.lower().removeprefix("eval_").replace("-", "_").split("_"))
    mode = mode or ("min" if words & _LOWER_BETTER else "max" if words & _HIGHER_BETTER else None)
    if mode is None:
        return None, [Problem(f"cannot tell whether higher or lower {metric} is better", flag,
                              f"add the direction: {value}:max or {value}:min")]
    return MetricGoal(metric, mode, patience), []


def training_control_problems(cfg: ControlSettings) -> list[Problem]:
    """Problems of the training-control settings (max_steps, scheduler, warmup, evaluation, best model)."""
    p: list[Problem] = []
    at_least(p, cfg, "max_steps", 1)
    for name in ("eval_every", "log_samples"):
        at_least(p, cfg, name, 0)
    if cfg.log_samples and cfg.task == "custom":
        p.append(Problem("--log_samples needs predictions, and custom models make none (their evaluation is the loss)",
                         "--log_samples", "drop --log_samples"))
    if cfg.warmup is not None and math.isfinite(cfg.warmup) and (cfg.warmup < 0 or (cfg.warmup >= 1 and not float(cfg.warmup).is_integer())):
        p.append(Problem(f"must be a whole number of steps (>= 1) or a ratio in [0, 1) (got {cfg.warmup})",
                         "--warmup", "e.g. --warmup 100 (steps) or --warmup 0.05 (of the steps)"))
    if cfg.min_lr < 0 or (cfg.lr > 0 and cfg.min_lr >= cfg.lr):
        p.append(Problem(f"must be >= 0 and below --lr {cfg.lr} (got {cfg.min_lr})", "--min_lr", "e.g. --min_lr 0"))
    goals = {name: parse_metric_goal(getattr(cfg, name), f"--{name}", name == "early_stopping")
             for name in ("early_stopping", "keep_best") if getattr(cfg, name) is not None}
    p += [q for _, found in goals.values() for q in found]
    if cfg.val_data is None and cfg.val_fraction == 0:  # training without validation data is allowed, these are not
        p += [Problem(f"--{name} needs an evaluation, and there is no validation data (--val_fraction 0, no "
                      "--val_data)", f"--{name}", "pass --val_data FILE or a --val_fraction above 0")
              for name in ("eval_every", "early_stopping", "keep_best") if getattr(cfg, name)]
    stop, best = (goals.get(name, (None,))[0] for name in ("early_stopping", "keep_best"))
    if stop is not None and best is not None and stop.metric != best.metric:
        p.append(Problem(f"--early_stopping watches {stop.metric} and --keep_best {best.metric}", "--keep_best",
                         "use the same metric for both, or drop --keep_best (--early_stopping keeps its best)"))
    return p


def at_least(p: list[Problem], cfg: DataclassInstance | ControlSettings, name: str, low: int) -> None:
    value = getattr(cfg, name)
    if value is not None and value < low:
        p.append(Problem(f"must be >= {low} (got {value})", f"--{name}"))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --report_to names -> (the module the tracker imports, how to install it).
REPORT_TO: dict[str, tuple[str, str] | None] = {
    "none": None,
    "tensorboard": ("tensorboard", "pip install tensorboard (or: pip install 'surefit[tensorboard]')"),
    "wandb": ("wandb", "pip install wandb, then `wandb login` (or set WANDB_MODE=offline)"),
}


def output_dir_problems(value: str) -> list[Problem]:
    """``--output_dir`` (or a folder above it) that is an existing file: found with the other settings' problems,
    before any data or model is loaded, instead of failing when the run folder is made."""
    path = Path(value)
    for at in [path, *path.parents]:
        if at.exists():
            if at.is_dir():
                return []
            where = "" if at == path else f" ({at} is a file)"
            return [Problem(f"{value} is not a folder{where}", "--output_dir",
                            "pass a folder path (new, or one holding a previous run with --resume or --overwrite)")]
    return []


def cache_dir_problems(value: str | None) -> list[Problem]:
    """``--cache_dir`` that is (or is under) an existing file, or empty: found before anything is loaded. Where it
    may not point (the inputs, a run's ``final/`` and ``checkpoints/``) is checked with the run's outputs
    (run_folder/guard.py ``train_problems``)."""
    if value is None:
        return []
    if not str(value).strip():
        return [Problem("empty value", "--cache_dir", "pass a folder, or leave --cache_dir out for the default")]
    path = Path(value).expanduser()
    for at in [path, *path.parents]:
        if at.exists():
            if at.is_dir():
                return []
            where = "" if at == path else f" ({at} is a file)"
            return [Problem(f"--cache_dir {value} is not a folder{where}", "--cache_dir",
                            "pass a folder path (it is created if missing), or leave --cache_dir out for the default")]
    return []


def split_names(value: str) -> list[str]:
    return [t.strip().lower() for t in value.split(",") if t.strip()]


def report_to_problems(value: str) -> list[Problem]:
    """Unknown tracker names, 'none' mixed with a tracker, and trackers whose package is not installed."""
    import importlib.util

    p: list[Problem] = []
    names = split_names(value)
    if not names:
        return [Problem("empty value", "--report_to", "use none, tensorboard, wandb, or e.g. tensorboard,wandb")]
    for name in names:
        if name not in REPORT_TO:
            close = difflib.get_close_matches(name, list(REPORT_TO), n=1)
            p.append(Problem(f"unknown tracker {name!r}", "--report_to",
                             (f"did you mean '{close[0]}'? " if close else "") + f"use one of: {', '.join(REPORT_TO)}"))
        elif REPORT_TO[name] is not None:
            module, install = REPORT_TO[name]  # type: ignore[misc]
            if importlib.util.find_spec(module) is None:
                p.append(Problem(f"--report_to {name} needs the '{module}' package, which is not installed",
                                 "--report_to", f"{install}; or drop {name} from --report_to"))
    if "none" in names and len(names) > 1:
        p.append(Problem(f"'none' given together with trackers ({value!r})", "--report_to",
                         "use none alone, or list only trackers"))
    return p
