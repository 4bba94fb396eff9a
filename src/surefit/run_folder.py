"""The run folder (``--output_dir``), and the one place that knows its layout: what a run writes where, replacing or
resuming a previous run, the final save, and opening a finished run for ``eval``, ``predict`` and ``export``.

Layout (every name a run writes; a previous run's copies are only replaced with ``--overwrite``)::

    config.yaml          the resolved settings (``--config`` reads it back)
    metrics.jsonl        one JSON record per logged step and per evaluation (epoch 0 = before training)
    data_report.json     what happened to the data (counts, split, truncation, labels)
    rejected_rows.jsonl  rows dropped by --on_bad_rows skip, each with its reason
    excluded_rows.jsonl  rows that could not be encoded (sft: a target longer than --max_seq_length)
    columns.json         every column: kept (as what) or dropped (why)
    doctor.json          the doctor's findings before step 1
    memory_plan.json     micro-batch, accumulation, precision and the memory estimate
    startup.json         seconds from the command to step 1, per phase, and what the start-up cache reused
    predictions/         epoch_N.jsonl: every validation row's prediction after epoch N
    checkpoints/         step-NNNNNNN/ and epoch-N/ (training/checkpoint.py)
    final/               the trained model in its ecosystem format (written by the task's ``save``)
    tensorboard/         with --report_to tensorboard
    curves.png, report.html
    .surefit.lock        held (flock) by the run training in the folder: pid, host, command, start time

Safety (docs/safety.md): one run at a time per folder (:class:`RunLock`); files a reader must see whole are written
atomically (a temporary name, then a rename); ``final/`` carries a manifest that ``eval``, ``predict`` and
``export`` verify; a run folder is data, so the code it names (a head, a model factory, remote code) is only
imported when the command line allows it (:func:`code_settings`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surefit.config import TASK_CONFIGS, build_config, config_to_dict, save_config
from surefit.config_files import load_yaml
from surefit.errors import ConfigError, DataError, Problem, SurefitError, raise_if
from surefit.training import integrity, untrusted
from surefit.training.checkpoint import latest_checkpoint
from surefit.training.checkpoint import verify as verify_checkpoint
from surefit.training.distributed import barrier, is_main_process, world_size
from surefit.training.run_lock import LOCK, RunLock, RunLocked, lock_run  # noqa: F401 - the run folder's lock

Say = Callable[[str], None]

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
DATA_REPORT = "data_report.json"
REJECTED = "rejected_rows.jsonl"
EXCLUDED = "excluded_rows.jsonl"
COLUMNS = "columns.json"
DOCTOR = "doctor.json"
MEMORY_PLAN = "memory_plan.json"
STARTUP = "startup.json"
DATA_FILES = "data_files.json"
PREDICTIONS = "predictions"
CHECKPOINTS = "checkpoints"
FINAL = "final"

# What a run writes; a previous run's copies are only replaced with --overwrite.
RUN_FILES = (METRICS, PREDICTIONS, CHECKPOINTS, FINAL, DATA_REPORT, EXCLUDED, COLUMNS, REJECTED, "curves.png",
             "report.html", "tensorboard", MEMORY_PLAN, DATA_FILES, STARTUP)

# Settings that only affect bookkeeping, so a resumed run may change them and still be the same run.
RESUME_MAY_CHANGE = {"resume", "overwrite", "output_dir", "log_every", "save_every", "keep_checkpoints", "eval_batch_size",
                     "report_to",
                     # the memory plan changes how a step is cut, never the update (training/plan.py)
                     "gpu_memory_gb", "grad_accum", "gradient_checkpointing",
                     # what to do about a non-finite loss only matters once one happens
                     "on_nonfinite"}


# ------------------------------------------------------------------------------------------------------------ training


def check_output_dir(cfg: Any, problems: list[Problem]) -> list[str]:
    """The previous run's files in ``--output_dir``; a problem unless ``--overwrite`` or ``--resume`` was given.

    With several processes, every process looks before any of them goes on: after this, the main process writes
    into the folder, and a slower process would otherwise take the new run's files for a previous run's.
    """
    out = Path(cfg.output_dir)
    previous = [name for name in RUN_FILES if (out / name).exists()]
    if previous and not cfg.overwrite and not cfg.resume:
        problems.append(
            Problem(
                f"{out} already holds a run ({', '.join(previous)}); training again would replace it",
                "--output_dir",
                "pass a new --output_dir, --resume to continue it, or --overwrite to replace it",
            )
        )
    barrier()
    return previous


def resume_point(cfg: Any, problems: list[Problem], say: Say = print) -> Path | None:
    """The verified checkpoint ``--resume`` names (``latest``: the newest usable one in the run folder)."""
    if not cfg.resume:
        return None
    saved = Path(cfg.output_dir) / CONFIG
    if saved.is_file():
        before = load_yaml(saved)
        now = config_to_dict(cfg)
        changed = [k for k, v in before.items() if k not in RESUME_MAY_CHANGE and k in now and now[k] != v]
        for k in changed:
            problems.append(Problem(f"the run was started with {k}={before[k]!r}; resuming with {now[k]!r} would not "
                                    "continue the same run", f"--{k}", f"drop --{k} (or start a new run)"))
    if cfg.resume == "latest":
        folder = latest_checkpoint(Path(cfg.output_dir) / CHECKPOINTS, say)
        if folder is None:
            problems.append(Problem(f"nothing to resume: no usable checkpoint in {Path(cfg.output_dir) / CHECKPOINTS}",
                                    "--resume", "check --output_dir, or start a new run without --resume"))
        return folder
    folder = Path(cfg.resume)
    reason = verify_checkpoint(folder) if folder.is_dir() else "no such folder"
    if reason:
        problems.append(Problem(f"cannot resume from {folder}: {reason}", "--resume",
                                "use --resume alone to pick the newest usable checkpoint"))
        return None
    return folder


def start_output_dir(cfg: Any, previous: list[str], say: Say = print, keep_rejected: bool = False) -> Path:
    """Make the run folder; with ``--overwrite``, remove the previous run first; save the resolved config.

    ``keep_rejected``: this run already wrote ``rejected_rows.jsonl`` (rows dropped under ``--on_bad_rows skip`` are
    written while the data is read, so that a data error can point at the file): that file is this run's, not the
    previous one's, and stays. Only the main process does it; the others wait until it is done.
    """
    out = Path(cfg.output_dir)
    if cfg.resume:
        return out  # the run's own config.yaml stays as it was written when the run started
    if not is_main_process():
        barrier()
        return out
    if keep_rejected:
        previous = [name for name in previous if name != REJECTED]
    for name in previous:
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    if previous:
        say(f"--overwrite: removed the previous run's {', '.join(previous)} from {out}")
    out.mkdir(parents=True, exist_ok=True)
    # Atomic: a full disk here leaves no config.yaml rather than an empty or cut one.
    atomic_write(out / CONFIG, lambda tmp: save_config(cfg, tmp), "the run's settings")
    hashes = untrusted.data_hashes(cfg)
    if hashes:
        text = json.dumps(hashes, indent=2)
        atomic_write(out / DATA_FILES, lambda tmp: tmp.write_text(text, encoding="utf-8"), "the data files' hashes")
    barrier()
    return out


def atomic_write(path: Path, write: Callable[[Path], None], what: str = "") -> None:
    """``write(tmp)`` a file beside ``path``, fsync it, then rename it into place: a reader sees the whole file or the
    previous one, never a part. A failed write (disk full ...) removes the partial file and raises
    :class:`~surefit.training.checkpoint.WriteFailed` naming the cause."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except Exception as e:
        size = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        if not integrity.is_write_failure(e):
            raise
        named = f"{path}" + (f" ({what})" if what else "")
        raise integrity.WriteFailed(integrity.write_failure(e, named, path.parent, max(size, 1 << 12))) from e


def resume_command(cfg: Any) -> str:
    processes = f" --num_processes {world_size()}" if world_size() > 1 else ""
    return f"surefit train --config {Path(cfg.output_dir) / CONFIG} --resume{processes}"


def save_final(out: Path, save_model: Callable[[Path], None]) -> Path:
    """Write ``final/`` atomically (temporary folder, then rename); the main process writes, the others wait."""
    final, tmp = out / FINAL, out / f"{FINAL}.tmp"
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_model(tmp)
            integrity.write_manifest(tmp)  # eval, predict and export verify it: corrupt weights are refused
        except Exception as e:
            written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if tmp.is_dir() else 0
            shutil.rmtree(tmp, ignore_errors=True)  # never a partial final/
            if not integrity.is_write_failure(e):
                raise
            last = latest_checkpoint(out / CHECKPOINTS, say=lambda *_: None)
            kept = (f"; the trained model is in the checkpoint {last} (write final/ again with: surefit train "
                    f"--config {out / CONFIG} --resume)" if last else "")
            needed = _final_bytes(last, written)
            raise integrity.WriteFailed(integrity.write_failure(e, f"the final model {final}", out, needed, kept)) from e
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    barrier()
    return final


def _final_bytes(checkpoint: Path | None, written: int) -> int | None:
    """final/ is about the size of a checkpoint's exported model (model/)."""
    if checkpoint is not None and (checkpoint / "model").is_dir():
        return sum(p.stat().st_size for p in (checkpoint / "model").rglob("*") if p.is_file())
    return written or None


def write_json(out: Path, name: str, value: Any) -> None:
    """``OUTPUT/name`` as indented JSON, written atomically (main process only)."""
    if is_main_process():
        text = json.dumps(value, indent=2, default=str)
        atomic_write(out / name, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """One JSON object per line (main process only)."""
    if is_main_process():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)


def predictions_path(out: Path, epoch: int) -> Path:
    return out / PREDICTIONS / f"epoch_{epoch}.jsonl"


def write_rejected(cfg: Any, rejects: list, say: Say = print) -> None:
    """With ``--on_bad_rows skip``: every dropped row, with its location and reason, in ``rejected_rows.jsonl``."""
    if not rejects or not is_main_process():
        return
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / REJECTED, [r.to_json() for r in rejects])
    say(f"--on_bad_rows skip: {len(rejects)} rows rejected, each with its reason in {out / REJECTED} "
        f"(first: {rejects[0].where}: {rejects[0].reason})")


def open_metrics_log(cfg: Any, out: Path, accelerator: Any) -> Any:
    """``OUTPUT/metrics.jsonl``, copied to the ``--report_to`` trackers, with ``curves.png`` redrawn after each epoch.

    ``accelerator`` must come from ``make_accelerator(..., report_to=cfg.trackers, project_dir=out)``.
    """
    from surefit.training.trackers import MetricsLog, Trackers

    main = getattr(accelerator, "is_main_process", True)
    trackers = Trackers(accelerator, cfg, out) if getattr(accelerator, "log_with", None) else None
    after_epoch = None
    if main:
        from surefit.report import write_curves

        after_epoch = lambda: write_curves(out)  # noqa: E731
    return MetricsLog(out / METRICS, trackers=trackers, after_epoch=after_epoch)


def write_run_report(out: Path, accelerator: Any = None, say: Say = print) -> None:
    """At the end of a run: ``curves.png`` and ``report.html`` (main process only; ``surefit report`` rebuilds them)."""
    if accelerator is not None and not getattr(accelerator, "is_main_process", True):
        return
    from surefit.report import write_report

    try:
        write_report(out, say=say)
    except Exception as e:  # noqa: BLE001 - the model is saved; a page that cannot be drawn must not fail the run
        say(f"warning: could not write {out / 'report.html'}: {type(e).__name__}: {e} "
            f"(retry with: surefit report --run {out})")


# ------------------------------------------------------------------------------------------------------------ a finished run


@dataclass
class Run:
    """A finished run folder.

    Attributes:
        folder: the run folder; final: ``folder/final``; cfg: the config it was trained with.
        report: ``data_report.json`` (``{}`` if absent); last_epoch: the last epoch record of ``metrics.jsonl``.
        plan: ``memory_plan.json`` (``{}`` if absent): the evaluation batch and frozen-weight dtype training used.
    """

    folder: Path
    cfg: Any
    final: Path
    report: dict[str, Any] = field(default_factory=dict)
    last_epoch: dict[str, Any] | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    say: Say = print

    @property
    def eval_batch_size(self) -> int:
        return int(self.plan.get("eval_batch_size") or self.cfg.resolved_eval_batch_size)

    @property
    def frozen_dtype(self) -> str | None:
        """``bf16``/``fp16`` when training stored the frozen (non-LoRA) weights in 16 bits under mixed precision."""
        return self.plan.get("frozen_dtype")

    @property
    def precision(self) -> str:
        """The precision training ran in (``memory_plan.json``; the config's setting for runs without a plan), so
        that ``precision: auto`` resolves for evaluation as it did for training."""
        return self.plan.get("precision") or self.cfg.precision

    @property
    def task(self) -> str:
        return self.cfg.task

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
    report = untrusted.read_json(folder / DATA_REPORT, "what happened to the data", untrusted.DATA_REPORT_KEYS)
    plan = untrusted.read_json(folder / MEMORY_PLAN, "the memory plan", untrusted.PLAN_KEYS)
    return Run(folder, cfg, final, report, untrusted.last_epoch(folder / METRICS), plan, say)


def export_folder(run: Run, dest: Path, overwrite: bool, write: Callable[[Path], None]) -> Path:
    """Write an export of ``run`` to ``dest`` atomically: ``write(tmp)`` fills a temporary folder beside ``dest``,
    which then replaces it. ``dest`` may not be a file, the run itself, a folder holding it or anything inside it,
    and a non-empty ``dest`` is refused unless ``overwrite``."""
    _check_destination(run, dest, overwrite)
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


def _check_destination(run: Run, dest: Path, overwrite: bool) -> None:
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
