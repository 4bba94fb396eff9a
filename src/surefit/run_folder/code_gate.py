"""A run folder is data, every key of it: the one table of the config settings that can name code, and the one gate
that refuses all of them unless the command line allows it (``--allow_code``, ``--trust_remote_code``).

Every text setting of every task's config is classified here, as code (:data:`NAMES_CODE`) or as data
(:data:`DATA_SETTINGS`); ``tests/test_code_gate.py`` walks the config dataclasses and fails on a setting that is in
neither, so a setting added later cannot skip the gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from surefit.config import TrainConfig
from surefit.errors import Problem


def _factory(value: Any) -> bool:
    """A ``module:function`` / ``file.py:function`` (not a path on disk that happens to hold a colon)."""
    return isinstance(value, str) and ":" in value and not Path(value).exists()


@dataclass(frozen=True)
class CodeSetting:
    """A setting whose value can make surefit import or run code.

    Attributes:
        runs_code: whether this value (of this config) names code.
        what: what it would run, in words.
        flag: the command-line flag that allows it.
    """

    runs_code: Callable[[Any, Any], bool]
    what: str
    flag: str = "--allow_code"


NAMES_CODE: dict[str, CodeSetting] = {
    "trust_remote_code": CodeSetting(lambda cfg, v: v is True, "lets the model folder run its own Python code when "
                                     "loading", "--trust_remote_code (or --allow_code)"),
    "head": CodeSetting(lambda cfg, v: bool(v), "imports the head factory's Python module"),
    # sft and classify read a model folder (or hub id, GGUF file); a custom run's model is a factory module:build
    "model": CodeSetting(lambda cfg, v: cfg.task == "custom" and bool(v), "imports the model factory's Python module"),
    "data": CodeSetting(lambda cfg, v: _factory(v), "imports the dataset factory's Python module"),
    "val_data": CodeSetting(lambda cfg, v: _factory(v), "imports the dataset factory's Python module"),
    "metric": CodeSetting(lambda cfg, v: _factory(v), "imports the metric's Python module (module:function)"),
}

# Text settings that are data: names, paths read as data, numbers or choices written as text, templates rendered in
# a sandbox, JSON handed to a factory that is itself gated.
DATA_SETTINGS = frozenset({
    # text
    "task", "preset", "lora_targets", "gpu_memory_gb", "output_dir", "report_to", "resume", "early_stopping",
    "keep_best", "input_field", "target_field", "template", "chat_format", "format", "role_map", "train_on",
    "truncation", "text_field", "text_pair_field", "label_field", "problem_type", "head_args", "model_args", "loss",
    "labels_key", "precision", "quantize", "lr_scheduler", "on_nonfinite", "on_bad_rows", "truncation_side",
    "lora_variant", "sharding", "system_prompt", "thinking", "system_turn", "cache_dir",
    # switches
    "overwrite", "allow_changed_data", "force", "no_cache", "eval_generate", "eval_merge_lora", "eval_share_prefixes", "eval_pack_lora",
    "eval_loss_in_prefill", "share_prefixes",
    "fused_cross_entropy", "gradient_checkpointing", "chat_template", "precompute_ref", "profile",
})


def code_problems(cfg: TrainConfig, where: Callable[[str], str], allow_code: bool, trust_remote_code: bool) -> list[Problem]:
    """Every setting of ``cfg`` that would import or run code, unless this command line allows it.

    Args:
        cfg: a task's config (e.g. read from a run folder's config.yaml).
        where: how a key is named in messages (the file and the key).
        allow_code, trust_remote_code: what this command line allows.
    """
    problems = []
    for key, setting in NAMES_CODE.items():
        value = getattr(cfg, key, None)
        if value is None or not setting.runs_code(cfg, value):
            continue
        if allow_code or (key == "trust_remote_code" and trust_remote_code):
            continue
        problems.append(Problem(
            f"the run's config sets {key}: {value!r}, which {setting.what}; a run folder is data, and the code it "
            "names only runs when the command line allows it", where(key),
            f"if you trust this run folder and that code, add {setting.flag} to this command"))
    return problems
