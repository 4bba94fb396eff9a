"""The run folder (``--output_dir``), and the one place that knows its layout: what a run writes where, replacing or
resuming a previous run, and the final save. ``run_folder/open_run.py`` opens a finished run for ``eval``,
``predict`` and ``export``, with the names defined here.

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
    profile.json         with --profile: where the whole run's wall time went (startup/walltime.py)
    predictions/         epoch_N.jsonl: every validation row's prediction after epoch N
    checkpoints/         step-NNNNNNN/ and epoch-N/ (training/checkpoint.py)
    final/               the trained model in its ecosystem format (written by the task's ``save``)
    tensorboard/         with --report_to tensorboard
    curves.svg, report.html
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
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# A module, not its names: training/checkpoint.py imports run_folder/integrity.py, and may be imported first.
import surefit.training.checkpoint as checkpoint
from surefit.config import TrainConfig, config_to_dict, save_config
from surefit.config.yaml_files import load_yaml
from surefit.data.summary import DataSummary
from surefit.errors import Problem
from surefit.run_folder import integrity, untrusted
from surefit.run_folder.links import is_previous, remove_previous
from surefit.run_folder.run_lock import LOCK, RunLock, RunLocked, lock_run  # noqa: F401 - the run folder's lock
from surefit.training.loop import Checkpointing
from surefit.training.plan import Plan
from surefit.training.processes import barrier, is_main_process, launched_as
from surefit.training.trackers import MetricsLog

Say = Callable[[str], None]


class Findings(Protocol):
    """The doctor's report, as the run folder sees it (the doctor sits above this layer)."""

    def to_json(self) -> str: ...

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
DATA_REPORT = "data_report.json"
REJECTED = "rejected_rows.jsonl"
EXCLUDED = "excluded_rows.jsonl"
SHORTENED = "shortened_rows.jsonl"
COLUMNS = "columns.json"
DOCTOR = "doctor.json"
MEMORY_PLAN = "memory_plan.json"
STARTUP = "startup.json"
PROFILE = "profile.json"
DATA_FILES = "data_files.json"
PREDICTIONS = "predictions"
CHECKPOINTS = "checkpoints"
FINAL = "final"

# What a run writes; a previous run's copies are only replaced with --overwrite.
RUN_FILES = (METRICS, PREDICTIONS, CHECKPOINTS, FINAL, DATA_REPORT, EXCLUDED, COLUMNS, REJECTED, "curves.svg",
             "curves.png", "report.html", "tensorboard", MEMORY_PLAN, DATA_FILES, STARTUP, PROFILE, SHORTENED)

# Settings that only affect bookkeeping, so a resumed run may change them and still be the same run.
RESUME_MAY_CHANGE = {"resume", "overwrite", "allow_changed_data", "output_dir", "log_every", "save_every", "keep_checkpoints", "eval_batch_size",
                     "report_to", "profile", "cache_dir",
                     # the memory plan changes how a step is cut, never the update (training/plan.py)
                     "gpu_memory_gb", "grad_accum", "gradient_checkpointing",
                     # what to do about a non-finite loss only matters once one happens
                     "on_nonfinite"}


# ------------------------------------------------------------------------------------------------------------ training


class RunFolder:
    """One run's folder, from the lock to the report: every file a run writes goes through here, and nothing else
    opens the run's paths. The runner (``tasks/common.train``) walks it in order: :meth:`locked`, :meth:`check`,
    :meth:`resume_point`, :meth:`start` (with what the task's ``prepare`` found), :meth:`write_doctor`,
    :meth:`write_plan`, the loop's :meth:`checkpointing` and :meth:`metrics_log`, :meth:`write_predictions`,
    :meth:`save_final`, :meth:`write_report`. Only the main process writes; the others wait where they must.
    """

    def __init__(self, cfg: TrainConfig, say: Say = print) -> None:
        self.cfg, self.say = cfg, say
        self.path = Path(cfg.output_dir)
        self.previous: list[str] = []  # the previous run's files, found by check()

    def locked(self) -> AbstractContextManager[RunLock | None]:
        """Hold the folder's lock (``.surefit.lock``) for the block: one run at a time per folder."""
        return lock_run(self.cfg, self.say)

    def check(self, problems: list[Problem]) -> None:
        """The previous run's files in ``--output_dir``; a problem unless ``--overwrite`` or ``--resume`` was given.

        With several processes, every process looks before any of them goes on: after this, the main process writes
        into the folder, and a slower process would otherwise take the new run's files for a previous run's.
        """
        cfg, out = self.cfg, self.path
        self.previous = [name for name in RUN_FILES if is_previous(out / name)]
        if self.previous and not cfg.overwrite and not cfg.resume:
            problems.append(
                Problem(
                    f"{out} already holds a run ({', '.join(self.previous)}); training again would replace it",
                    "--output_dir",
                    "pass a new --output_dir, --resume to continue it, or --overwrite to replace it",
                )
            )
        barrier()

    def resume_point(self, problems: list[Problem]) -> Path | None:
        """The verified checkpoint ``--resume`` names (``latest``: the newest usable one in the run folder)."""
        cfg = self.cfg
        if not cfg.resume:
            return None
        saved = self.path / CONFIG
        if saved.is_file():
            before = load_yaml(saved)
            now = config_to_dict(cfg)
            changed = [k for k, v in before.items() if k not in RESUME_MAY_CHANGE and k in now and now[k] != v]
            for k in changed:
                problems.append(Problem(f"the run was started with {k}={before[k]!r}; resuming with {now[k]!r} would "
                                        "not continue the same run", f"--{k}", f"drop --{k} (or start a new run)"))
        untrusted.check_inputs_on_resume(cfg, self.path / DATA_FILES, problems, self.say)
        if cfg.resume == "latest":
            folder = checkpoint.latest_checkpoint(self.path / CHECKPOINTS, self.say)
            if folder is None:
                problems.append(Problem(f"nothing to resume: no usable checkpoint in {self.path / CHECKPOINTS}",
                                        "--resume", "check --output_dir, or start a new run without --resume"))
            return folder
        folder = Path(cfg.resume)
        reason = checkpoint.verify(folder) if folder.is_dir() else "no such folder"
        if reason:
            problems.append(Problem(f"cannot resume from {folder}: {reason}", "--resume",
                                    "use --resume alone to pick the newest usable checkpoint"))
            return None
        return folder

    def start(self, found: Found) -> None:
        """Make the folder (with ``--overwrite``, remove the previous run first) and save the resolved config and the
        data files' hashes (a resumed run keeps its own), then what ``prepare`` found: the data report, the rejected
        rows and the task's other files."""
        if not self.cfg.resume:
            self._replace_previous()
        self.write_json(DATA_REPORT, found.data_report.to_json())
        self.write_rejected(found.data_report.rejected or [])
        for name, value in found.files.items():
            self.write_json(name, value)
        for name, records in found.jsonl.items():
            if records:
                write_jsonl(self.path / name, records)

    def _replace_previous(self) -> None:
        out, cfg = self.path, self.cfg
        if not is_main_process():
            barrier()
            return
        remove_previous(out, self.previous, self.say)  # never deletes through a symbolic link
        if self.previous:
            self.say(f"--overwrite: removed the previous run's {', '.join(self.previous)} from {out}")
        out.mkdir(parents=True, exist_ok=True)
        # Atomic: a full disk here leaves no config.yaml rather than an empty or cut one.
        atomic_write(out / CONFIG, lambda tmp: save_config(cfg, tmp), "the run's settings")
        hashes = untrusted.data_hashes(cfg)
        if hashes:
            text = json.dumps(hashes, indent=2)
            atomic_write(out / DATA_FILES, lambda tmp: tmp.write_text(text, encoding="utf-8"), "the data files' hashes")
        barrier()

    def write_rejected(self, rejects: Sequence[Any]) -> None:
        """With ``--on_bad_rows skip``: every dropped row, with its location and reason, in ``rejected_rows.jsonl``.

        Also called when the data had problems (so that "all rows rejected" points at a list that exists), unless
        the folder holds a previous run that this one may not replace.
        """
        if not rejects or not is_main_process():
            return
        if self.previous and not (self.cfg.overwrite or self.cfg.resume):
            return
        self.path.mkdir(parents=True, exist_ok=True)
        write_jsonl(self.path / REJECTED, [r.to_json() for r in rejects])
        self.say(f"--on_bad_rows skip: {len(rejects)} rows rejected, each with its reason in {self.path / REJECTED} "
                 f"(first: {rejects[0].where}: {rejects[0].reason})")

    def write_json(self, name: str, value: Any) -> None:
        """``OUTPUT/name`` as indented JSON, written atomically (main process only)."""
        write_json(self.path, name, value)

    def write_doctor(self, report: Findings | None) -> None:
        """The doctor's findings before step 1 (``doctor.json``; ``None`` on the other processes)."""
        if report is not None and is_main_process():
            text = report.to_json()
            atomic_write(self.path / DOCTOR, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def write_plan(self, plan: Plan) -> None:
        """The memory plan (``memory_plan.json``): micro-batch, accumulation, precision and the estimate."""
        self.write_json(MEMORY_PLAN, plan.to_dict())

    def write_startup(self, record: dict[str, Any]) -> None:
        """Seconds from the command to step 1, per phase (``startup.json``)."""
        self.write_json(STARTUP, record)

    def write_profile(self, record: dict[str, Any]) -> None:
        """``--profile``: where the whole run's wall time went (``profile.json``; ``startup/walltime.py``). It comes
        after the report, whose time it counts, so the page is written again to show it (the curves are kept)."""
        self.write_json(PROFILE, record)
        write_run_report(self.path, None, say=lambda _: None)

    def write_predictions(self, epoch: int, records: list[dict[str, Any]], step: int | None = None) -> None:
        """Every validation row's prediction: ``predictions/epoch_N.jsonl`` (``step_N.jsonl`` between epoch ends)."""
        path = predictions_path(self.path, epoch)
        write_jsonl(path if step is None else path.with_name(f"step_{step}.jsonl"), records)

    def write_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """``--log_samples``: one file per evaluation, so a resumed run rewrites rather than repeats."""
        write_jsonl(self.path / PREDICTIONS / SAMPLES / f"step_{step}.jsonl", samples)

    def checkpointing(self, export: Callable[[Any, Path], None], resume_from: Path | None) -> Checkpointing:
        """Where and when the loop saves (``checkpoints/``), and what it resumes from."""
        cfg = self.cfg
        return Checkpointing(folder=self.path / CHECKPOINTS, save_every=cfg.save_every, keep=cfg.keep_checkpoints,
                             export=export, resume_from=resume_from, resume_command=self.resume_command())

    def checkpoint_model(self, name: str) -> Path:
        """The model a checkpoint exported (``checkpoints/NAME/model``)."""
        return self.path / CHECKPOINTS / name / "model"

    def resume_command(self) -> str:
        """The command that continues this run."""
        flags = launched_as()
        command = f"surefit train --config {self.path / CONFIG} --resume{flags.relaunch_flags()}"
        return ("srun " if flags.slurm else "") + command + flags.relaunch_note()

    def metrics_log(self, accelerator: Any) -> MetricsLog:
        """``metrics.jsonl``, copied to the ``--report_to`` trackers, with ``curves.svg`` redrawn after an epoch
        (:class:`CurvesRedraw`)."""
        return open_metrics_log(self.cfg, self.path, accelerator)

    def save_final(self, save_model: Callable[[Path], object]) -> Path:
        """Write ``final/`` atomically (temporary folder, then rename) with its manifest."""
        return save_final(self.path, save_model)

    def write_report(self, accelerator: Any = None) -> None:
        """``curves.svg`` and ``report.html``, at the end of a run."""
        write_run_report(self.path, accelerator, self.say)


SAMPLES = "samples"  # under predictions/: one file per evaluation of the --log_samples rows


@dataclass
class Found:
    """What a task's ``prepare`` found that the run folder keeps. :meth:`RunFolder.start` writes it; ``prepare``
    writes nothing (the doctor calls it too).

    Attributes:
        data_report: what happened to the data (``data_report.json``), with the rows dropped under ``--on_bad_rows
            skip`` (``rejected_rows.jsonl``).
        files: other JSON files by name (``columns.json``); jsonl: JSON-lines files by name (``excluded_rows.jsonl``),
            written when not empty.
    """

    data_report: DataSummary
    files: dict[str, Any] = field(default_factory=dict)
    jsonl: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def atomic_write(path: Path, write: Callable[[Path], object], what: str = "") -> None:
    """``write(tmp)`` a file beside ``path``, fsync it, then rename it into place: a reader sees the whole file or the
    previous one, never a part. A failed write (disk full ...) removes the partial file and raises
    :class:`~surefit.training.checkpoint.WriteFailed` naming the cause."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # a leftover (or planted) name: never written through
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


def save_final(out: Path, save_model: Callable[[Path], object]) -> Path:
    """Write ``final/`` atomically (temporary folder, then rename); the main process writes, the others wait."""
    final, tmp = out / FINAL, out / f"{FINAL}.tmp"
    if is_main_process():
        for p in (tmp, final):
            if p.is_symlink():
                p.unlink()  # a planted link: removed as a link, never written through
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_model(tmp)
            if not (tmp / integrity.MANIFEST).is_file():  # a verified checkpoint's copy brings its own manifest
                integrity.write_manifest(tmp)  # eval, predict and export verify it: corrupt weights are refused
        except Exception as e:
            written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if tmp.is_dir() else 0
            shutil.rmtree(tmp, ignore_errors=True)  # never a partial final/
            if not integrity.is_write_failure(e):
                raise
            last = checkpoint.latest_checkpoint(out / CHECKPOINTS, say=lambda *_: None)
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
        text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
        # a new file renamed into place: a link planted at path is replaced, never written through
        atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def predictions_path(out: Path, epoch: int) -> Path:
    return out / PREDICTIONS / f"epoch_{epoch}.jsonl"


def open_metrics_log(cfg: TrainConfig, out: Path, accelerator: Any) -> MetricsLog:
    """``OUTPUT/metrics.jsonl``, copied to the ``--report_to`` trackers, with ``curves.svg`` redrawn after an epoch
    (at most every :data:`CURVES_EVERY_S` seconds: :class:`CurvesRedraw`).

    ``accelerator`` must come from ``make_accelerator(..., report_to=cfg.trackers, project_dir=out)``.
    """
    from surefit.training.trackers import Trackers

    main = getattr(accelerator, "is_main_process", True)
    trackers = Trackers(accelerator, cfg, out) if getattr(accelerator, "log_with", None) else None
    after_epoch = CurvesRedraw(out) if main else None
    return MetricsLog(out / METRICS, trackers=trackers, after_epoch=after_epoch, writes=bool(main))


CURVES_EVERY_S = 5.0


class CurvesRedraw:
    """Redraws ``curves.svg`` after an epoch record, at most once every ``every_s`` seconds.

    A drawing takes milliseconds (``run_folder/svg_chart.py``), so a run whose epochs take seconds or more is drawn
    after every epoch; the limit is for runs of many tiny epochs. The end of the run draws what is not drawn yet
    (:func:`write_run_report`).
    """

    def __init__(self, out: Path, every_s: float = CURVES_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.out, self.every_s, self.clock = out, every_s, clock
        self.last = clock()  # the start counts as a drawing: nothing to show before the first epochs

    def __call__(self) -> None:
        if self.clock() - self.last < self.every_s:
            return
        from surefit.run_folder.report import write_curves

        write_curves(self.out)
        self.last = self.clock()


def write_run_report(out: Path, accelerator: Any = None, say: Say = print) -> None:
    """At the end of a run: ``curves.svg`` (unless the last epoch has just drawn it) and ``report.html`` (main
    process only; ``surefit report`` rebuilds them)."""
    if accelerator is not None and not getattr(accelerator, "is_main_process", True):
        return
    from surefit.run_folder.report import write_report

    try:
        write_report(out, say=say, redraw=False)
    except Exception as e:  # noqa: BLE001 - the model is saved; a page that cannot be drawn must not fail the run
        say(f"warning: could not write {out / 'report.html'}: {type(e).__name__}: {e} "
            f"(retry with: surefit report --run {out})")
