"""Instruction tuning of a causal LM (``surefit train --task sft``, the default task).

``train_sft.py`` trains: data -> encoding -> model -> loop -> ``final/``, top to bottom. ``use_sft.py`` uses a finished
run: ``load``, ``evaluate``, ``predict``, ``export``, and ``inspect`` (what a run would supervise). Together they
expose the surface every task has (docs/architecture.md).
"""

from surefit.tasks.sft.train_sft import (
    FIELDS,
    FINAL_FILES,
    Encoder,
    choose_metric,
    conversation_key,
    final_files,
    load_data,
    prepare,
    run,
    save,
    score,
)
from surefit.tasks.sft.use_sft import evaluate, export, inspect, load, marked_text, predict

__all__ = ["FIELDS", "FINAL_FILES", "Encoder", "choose_metric", "conversation_key", "evaluate", "export", "final_files",
           "inspect", "load", "load_data", "marked_text", "predict", "prepare", "run", "save", "score"]
