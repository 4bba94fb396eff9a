"""The run folder (``--output_dir``), and the one place that knows its layout: what a run writes where, replacing or
resuming a previous run, and the final save. ``run_folder/finished.py`` opens a finished run for ``eval``,
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
from pathlib import Path
from typing import Any

from surefit.config import config_to_dict, save_config
from surefit.config_files import load_yaml
from surefit.errors import Problem
from surefit.run_folder.links import is_previous, remove_previous
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
RESUME_MAY_CHANGE = {"resume", "overwrite", "allow_changed_data", "output_dir", "log_every", "save_every", "keep_checkpoints", "eval_batch_size",
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
    previous = [name for name in RUN_FILES if is_previous(out / name)]
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
    untrusted.check_inputs_on_resume(cfg, Path(cfg.output_dir) / DATA_FILES, problems, say)
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
    remove_previous(out, previous, say)  # never deletes through a symbolic link
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


def resume_command(cfg: Any) -> str:
    processes = f" --num_processes {world_size()}" if world_size() > 1 else ""
    return f"surefit train --config {Path(cfg.output_dir) / CONFIG} --resume{processes}"


def save_final(out: Path, save_model: Callable[[Path], None]) -> Path:
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
        text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
        # a new file renamed into place: a link planted at path is replaced, never written through
        atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


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
