"""The training paths, one module (or package) each, all with the same surface: :class:`~surefit.tasks.runner.Task`
(docs/architecture.md). A task is registered by one entry in :data:`TASKS` (and its config in ``config/task_configs.py``).
"""

from __future__ import annotations

from typing import Any

from surefit.config import TrainConfig
from surefit.errors import ConfigError, Problem
from surefit.tasks import classify, custom, dpo, sft
from surefit.tasks.runner import Inspects, Task

# The modules are the task objects: a type checker holds each to the Task protocol here, and tests/test_tasks.py does
# at run time.
TASKS: dict[str, Task[Any]] = {"sft": sft, "classify": classify, "custom": custom, "dpo": dpo}
# The tasks ``surefit inspect`` shows supervision for (a type checker holds each to the Inspects protocol).
INSPECTS: dict[str, Inspects[Any]] = {"sft": sft, "dpo": dpo}


def get_task(name: str) -> Task[Any]:
    """The task called ``name`` (``--task``)."""
    task = TASKS.get(name)
    if task is None:
        raise ConfigError(Problem(f"unknown task {name!r}", "--task", f"use one of: {', '.join(sorted(TASKS))}"))
    return task


def inspector(name: str) -> Inspects[Any]:
    """The task called ``name`` as ``surefit inspect`` uses it; a task that cannot show its supervision is refused."""
    get_task(name)  # an unknown name is refused as --task is everywhere
    task = INSPECTS.get(name)
    if task is None:
        raise ConfigError(Problem(f"task {name!r} has no supervised spans to inspect", "--task",
                                  f"inspect an {' or '.join(sorted(INSPECTS))} config; for tensor data use "
                                  "`surefit inspect --data FOLDER`"))
    return task


def task_of(cfg: TrainConfig) -> Task[Any]:
    """The task a config is for."""
    return get_task(cfg.task)
