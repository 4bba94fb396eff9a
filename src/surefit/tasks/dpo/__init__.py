"""Preference tuning of a causal LM on chosen / rejected pairs (``surefit train --task dpo``).

``train_dpo.py`` trains: pairs -> encoding -> model -> loop -> ``final/``, through the runner every task shares. The
final folder is SFT's (a LoRA adapter or a full model, and the tokenizer), so a finished run loads as SFT's does.
"""

from surefit.tasks.dpo.train_dpo import evaluate_pairs, load_pairs, prepare, run
from surefit.tasks.dpo.use_dpo import evaluate, inspect
from surefit.tasks.sft.train_sft import FINAL_FILES, final_files, save
from surefit.tasks.sft.use_sft import export, load, predict

FIELDS: tuple[str, ...] = ()

__all__ = ["FIELDS", "FINAL_FILES", "evaluate", "evaluate_pairs", "export", "final_files", "inspect", "load", "load_pairs",
           "predict", "prepare", "run", "save"]
