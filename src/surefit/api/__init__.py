"""Python API: the same jobs as the CLI, with the same configs.

>>> import surefit
>>> result = surefit.train(task="sft", data="train.jsonl", epochs=2)   # doctest: +SKIP
>>> result.history[-1]["eval_f1"]                                       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# Using a finished run lives in surefit/api/use_run.py; its names stay importable from here.
from surefit.api.use_run import UseOptions, evaluate, export, predict, report
from surefit.config import SFTConfig, TrainConfig
from surefit.config.aliases import build_with_aliases
from surefit.config.task_configs import TASK_CONFIGS
from surefit.errors import ConfigError, Problem
from surefit.startup import command
from surefit.startup.cache import using_cache_dir
from surefit.tasks import inspector, task_of
from surefit.tasks.runner import RunResult


def _config(config: TrainConfig | dict[str, Any] | None, settings: dict[str, Any]) -> TrainConfig:
    """A validated task config from a config object, a mapping, or settings by name (which override)."""
    if config is None or isinstance(config, dict):
        values = {**(config or {}), **settings}
        task = values.get("task", "sft")
        cls = TASK_CONFIGS.get(task)
        if cls is None:
            raise ConfigError(Problem(f"unknown task {task!r}", "task", f"use one of: {', '.join(sorted(TASK_CONFIGS))}"))
        return build_with_aliases(cls, None, values, yaml_name="arguments", keywords=True)
    if settings:
        current = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return build_with_aliases(type(config), None, {**current, **settings}, yaml_name="arguments", keywords=True)
    return config


def train(config: TrainConfig | dict[str, Any] | None = None, /, **settings: Any) -> RunResult:
    """Train a model.

    Args:
        config: a task config (e.g. :class:`surefit.config.SFTConfig`), a mapping of settings, or ``None``.
        **settings: settings by name (``data=``, ``epochs=``, ``lora_r=`` ...); they override ``config``.

    Raises:
        ConfigError, DataError, ModelError: with every problem found, each naming where and how to fix it.
        DoctorRefused: the doctor found errors in the setup (``force=True`` trains anyway).
    """
    with command():  # the start-up counts from this call, not from the start of the user's program
        cfg = _config(config, settings)
        with using_cache_dir(cfg.cache_dir):
            return task_of(cfg).run(cfg)


def doctor(config: TrainConfig | dict[str, Any] | None = None, /, **settings: Any) -> Any:
    """Build a run's setup exactly as ``train`` would (data, encoding, model, collator: the task's ``prepare``) and
    return the doctor's report, without training and without writing anything."""
    from surefit.tasks.runner import doctor as run_doctor

    cfg = _config(config, settings)
    with using_cache_dir(cfg.cache_dir):
        return run_doctor(cfg, task_of(cfg).prepare)


def inspect_sft(config: SFTConfig, out: str | None = None, show: int = 2,
                say: Callable[[str], None] = print) -> dict[str, Any]:
    """What an sft (or dpo) run would supervise: see :func:`surefit.tasks.sft.inspect`.

    Raises:
        ConfigError: ``config`` is for a task without supervised spans (classify, custom).
    """
    with using_cache_dir(config.cache_dir):
        return inspector(config.task).inspect(config, out, show, say=say)


def inspect_data(data: str, model: str | None = None, model_args: str | None = None,
                 max_memory_gb: float | None = None, say=print) -> str:
    """Describe every array of a tensor dataset; with a model factory, each input's first layer and any mismatch.

    Returns:
        The report text (also passed to ``say``).
    """
    from surefit.tasks.custom import inspect_inputs

    text = inspect_inputs(data, model, model_args, max_memory_gb)
    say(text)
    return text


__all__ = ["RunResult", "UseOptions", "doctor", "evaluate", "export", "inspect_data", "inspect_sft", "predict", "report", "train"]
