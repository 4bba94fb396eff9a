"""A finished run folder, opened for ``eval``, ``predict`` and ``export``: checked and read as data (the code its
config names runs only when the command line allows it), and exports written beside it atomically. The layout's names
are in ``run_folder/__init__.py``."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from surefit.config import TrainConfig, build_config
from surefit.config.task_configs import TASK_CONFIGS
from surefit.config.yaml_files import load_yaml
from surefit.data.summary import FACTS_OF_TASK, DataSummary
from surefit.errors import ConfigError, DataError, Problem, SurefitError, raise_if
from surefit.run_folder import (
    CHECKPOINTS,
    CONFIG,
    DATA_FILES,
    DATA_REPORT,
    FINAL,
    MEMORY_PLAN,
    METRICS,
    untrusted,
)

Say = Callable[[str], None]
# A task's own config class: what a task's finished-run code reads its run's config as.
T = TypeVar("T", bound=TrainConfig)

@dataclass
class Run:
    """A finished run folder.

    Attributes:
        folder: the run folder; final: ``folder/final``; cfg: the config it was trained with.
        summary: ``data_report.json``, read and checked (empty if absent), with the task's facts
            (:data:`~surefit.data.summary.FACTS_OF_TASK`); last_epoch: the last epoch record of ``metrics.jsonl``.
        plan: ``memory_plan.json``'s evaluation batch, precision and frozen-weight dtype (empty if absent).
    """

    folder: Path
    cfg: TrainConfig
    final: Path
    summary: DataSummary = field(default_factory=DataSummary)
    last_epoch: dict[str, Any] | None = None
    plan: untrusted.SavedPlan = field(default_factory=untrusted.SavedPlan)
    say: Say = print

    @property
    def eval_batch_size(self) -> int:
        return self.plan.eval_batch_size or self.cfg.resolved_eval_batch_size

    @property
    def frozen_dtype(self) -> Literal["bf16", "fp16"] | None:
        """``bf16``/``fp16`` when training stored the frozen (non-LoRA) weights in 16 bits under mixed precision."""
        return self.plan.frozen_dtype

    @property
    def precision(self) -> str:
        """The precision training ran in (``memory_plan.json``; the config's setting for runs without a plan), so
        that ``precision: auto`` resolves for evaluation as it did for training."""
        return self.plan.precision or self.cfg.precision

    @property
    def task(self) -> str:
        return self.cfg.task

    def config_as(self, cls: type[T]) -> T:
        """The run's config as the task's own class (``config.yaml``'s task picked it when the run was opened)."""
        if not isinstance(self.cfg, cls):
            raise ConfigError(Problem(f"{self.config_path} is a {self.task} run, not one this command reads as "
                                      f"{cls.__name__}", self.where("task"),
                                      f"use the {self.task} task's command on this run folder"))
        return self.cfg

    @property
    def config_path(self) -> Path:
        return self.folder / CONFIG

    def where(self, key: str) -> str:
        """How a setting of the run is named in messages: the file and the key."""
        return f"{self.config_path} '{key}'"

    def require(self, *groups: tuple[str, ...]) -> None:
        """``final/`` must hold every file of one of ``groups`` (the task's save format)."""
        if any(all((self.final / name).exists() for name in group) for group in groups):
            return
        wanted = " or ".join(" + ".join(group) for group in groups)
        held = sorted(p.name for p in self.final.iterdir())[:8]
        raise SurefitError(Problem(f"{self.final} does not hold a trained {self.task} model: expected {wanted} (it "
                                   f"holds: {', '.join(held) or 'nothing'})", "--run",
                                   "the run folder is incomplete or was changed by hand; train the run again"))

    def config_problem(self, e: SurefitError, keys: tuple[str, ...]) -> SurefitError:
        """Problems a task names by flag (``--model``, ``--head``) are about the run's config.yaml here; say so."""
        hint = (f" Relative paths in {self.config_path} are resolved from the current folder ({Path.cwd()}): run "
                "surefit from the folder the training ran in, or edit the path in config.yaml.")
        problems = []
        for p in e.problems:
            key = next((k for k in keys if p.where == f"--{k}"), None)
            if key is None:
                problems.append(p)
            else:
                problems.append(Problem(p.what, self.where(key), (p.fix.rstrip(".") + "." if p.fix else "") + hint))
        return type(e)(problems)

    def check_training_data(self) -> None:
        """The run's own data must be reachable to re-derive its validation split."""
        problems = []
        for key in ("data", "val_data"):
            value = getattr(self.cfg, key)
            factory = self.task == "custom" and ":" in str(value)  # a dataset factory module:make, not a path
            if value and not factory and not Path(value).exists():
                problems.append(Problem(
                    f"the run's {'training' if key == 'data' else 'validation'} data {value!r} is not found from "
                    f"{Path.cwd()}; the validation split is re-derived from it", self.where(key),
                    "run surefit from the folder the training ran in, or pass --data FILE to evaluate on other data"))
        raise_if(problems, DataError)
        for key, (path, why) in self.changed_data().items():
            if key not in ("data", "val_data"):
                continue  # other inputs (the base model) are named when the run is opened
            self.say(f"warning: the run's {'training' if key == 'data' else 'validation'} data {path} {why} since "
                     f"training ({self.folder / DATA_FILES}): the validation split re-derived from it may not be the "
                     "one training scored, and the numbers may not match metrics.jsonl")

    def changed_data(self) -> dict[str, tuple[str, str]]:
        """The run's data files whose contents differ from what training read (``data_files.json``)."""
        return untrusted.changed_data(self.folder / DATA_FILES, self.cfg)

    def validation_described(self) -> str:
        changed = self.changed_data()
        note = " (CHANGED since training)" if ("val_data" if self.cfg.val_data else "data") in changed else ""
        if self.cfg.val_data:
            return f"validation data {self.cfg.val_data} (read as in training){note}"
        return f"validation split of {self.cfg.data} (re-derived as in training){note}"


_RUN_FIX = "pass the folder given as --output_dir to `surefit train` (it holds config.yaml, metrics.jsonl and final/)"


def open_run(run: str | os.PathLike, allow_code: bool = False, trust_remote_code: bool = False,
             say: Say = print) -> Run:
    """Check and read a finished run folder; every problem names the folder (or file) and what to pass instead.

    A run folder is data: the code its config.yaml names (a ``head``, a ``model`` factory, a ``data`` factory,
    ``trust_remote_code``) is only run when this command line allows it (``allow_code``, ``trust_remote_code``);
    ``final/`` is verified against its manifest; the JSON files read are checked for what they must hold.
    """
    folder = Path(run)
    if not folder.exists():
        raise SurefitError(Problem(f"no such folder: {folder} (looked in {Path.cwd()})", "--run", _RUN_FIX))
    if not folder.is_dir():
        raise SurefitError(Problem(f"{folder} is a file, not a run folder", "--run", _RUN_FIX))
    config_path = folder / CONFIG
    if not config_path.is_file():
        if (folder.parent / CONFIG).is_file() and folder.name in (FINAL, CHECKPOINTS):
            fix = f"pass the run folder itself: --run {folder.parent}"
        else:
            fix = _RUN_FIX
        held = sorted(p.name for p in folder.iterdir())[:8]
        raise SurefitError(Problem(f"{folder} has no config.yaml, so it is not a surefit run folder (it holds: "
                                   f"{', '.join(held) or 'nothing'})", "--run", fix))
    values = load_yaml(config_path)
    task = str(values.pop("task", "sft"))
    cls = TASK_CONFIGS.get(task)
    if cls is None:
        raise ConfigError(Problem(f"unknown task {task!r} in {config_path}", f"{config_path} 'task'",
                                  f"use one of: {', '.join(sorted(TASK_CONFIGS))}"))
    cfg = build_config(cls, values, None, yaml_name=str(config_path))
    raise_if(untrusted.code_problems(cfg, config_path, allow_code, trust_remote_code), ConfigError)
    final = folder / FINAL
    if not final.is_dir():
        if (folder / CHECKPOINTS).is_dir() and any((folder / CHECKPOINTS).iterdir()):
            fix = (f"finish the training first: surefit train --config {config_path} --output_dir {folder} --resume "
                   "(it continues from the newest checkpoint and writes final/)")
        else:
            fix = "train the run to the end: final/ is written after the last epoch"
        raise SurefitError(Problem(f"{folder} has no final/ folder: the run did not finish (interrupted, failed, or "
                                   "still training)", "--run", fix))
    untrusted.verify_final(final, say)
    for key, (path, why) in untrusted.changed_data(folder / DATA_FILES, cfg).items():
        if key not in ("data", "val_data"):  # the data is named where it is read (Run.check_training_data)
            say(f"warning: the run's {key} {path} {why} since training ({folder / DATA_FILES}): results may differ "
                "from the ones training gave (for a base model: the adapter is applied to other weights)")
    summary = DataSummary.from_json(untrusted.read_json(folder / DATA_REPORT, "what happened to the data"),
                                    str(folder / DATA_REPORT), FACTS_OF_TASK.get(task))
    plan = untrusted.SavedPlan.from_json(untrusted.read_json(folder / MEMORY_PLAN, "the memory plan"),
                                         str(folder / MEMORY_PLAN))
    return Run(folder, cfg, final, summary, untrusted.last_epoch(folder / METRICS), plan, say)


def export_folder(run: Run, dest: Path, overwrite: bool, write: Callable[[Path], object]) -> Path:
    """Write an export of ``run`` to ``dest`` atomically: ``write(tmp)`` fills a temporary folder beside ``dest``,
    which then replaces it. ``dest`` may not be a file, the run itself, a folder holding it or anything inside it,
    and a non-empty ``dest`` is refused unless ``overwrite``."""
    check_destination(run, dest, overwrite)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def check_destination(run: Run, dest: Path, overwrite: bool) -> None:
    """Refuse an export destination that is a file, the run itself, inside it or holding it, or not empty."""
    if dest.exists() and not dest.is_dir():
        raise SurefitError(Problem(f"{dest} is a file", "--to", "pass a folder path (new or empty)"))
    resolved, folder = dest.resolve(), run.folder.resolve()
    if folder.is_relative_to(resolved) or resolved.is_relative_to(folder):
        inside = "is" if resolved == folder else "holds" if folder.is_relative_to(resolved) else "is inside"
        raise SurefitError(Problem(f"{dest} {inside} the run folder {run.folder}; exporting there would replace the run's "
                                   "files (its checkpoints, final/ or records)", "--to",
                                   "pass a folder outside the run"))
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        held = sorted(p.name for p in dest.iterdir())
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise SurefitError(Problem(f"{dest} is not empty (it holds {shown}); exporting would replace it", "--to",
                                   "pass a new or empty folder, or --overwrite to replace its contents"))
