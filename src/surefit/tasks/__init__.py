"""The three training paths, one module (or package) each, all exposing the same surface (docs/architecture.md)."""

from __future__ import annotations

import importlib
from types import ModuleType


def task_module(task: str) -> ModuleType:
    """The module of a task (``sft``, ``classify``, ``custom``)."""
    return importlib.import_module(f"surefit.tasks.{task}")
