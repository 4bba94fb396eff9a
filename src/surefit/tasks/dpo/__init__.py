"""Preference tuning of a causal LM on chosen / rejected pairs (``surefit train --task dpo``).

``recipe.py`` trains: pairs -> encoding -> model -> loop -> ``final/``, through the runner every task shares. The
final folder is SFT's (a LoRA adapter or a full model, and the tokenizer), so a finished run loads as SFT's does.
"""

from surefit.tasks.dpo.finished import evaluate, inspect
from surefit.tasks.dpo.recipe import evaluate_pairs, load_pairs, prepare, run
from surefit.tasks.sft.finished import export, load, predict
from surefit.tasks.sft.recipe import FINAL_FILES, final_files, save

FIELDS: tuple[str, ...] = ()

__all__ = ["FIELDS", "FINAL_FILES", "evaluate", "evaluate_pairs", "export", "final_files", "inspect", "load", "load_pairs",
           "predict", "prepare", "run", "save"]
