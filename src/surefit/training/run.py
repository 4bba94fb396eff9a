"""The run folder (``--output_dir``): what is in it, replacing it, resuming from it, the final save. Shared by tasks."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from surefit.config import save_config
from surefit.errors import Problem
from surefit.training.checkpoint import latest_checkpoint, verify
from surefit.training.distributed import barrier, is_main_process, world_size

# What a run writes; a previous run's copies are only replaced with --overwrite.
RUN_FILES = ("metrics.jsonl", "predictions", "checkpoints", "final", "data_report.json", "excluded_rows.jsonl",
             "columns.json", "rejected_rows.jsonl", "curves.png", "report.html", "tensorboard",
             "memory_plan.json")


# Settings that only affect bookkeeping, so a resumed run may change them and still be the same run.
RESUME_MAY_CHANGE = {"resume", "overwrite", "output_dir", "log_every", "save_every", "keep_checkpoints", "eval_batch_size",
                     "report_to",
                     # the memory plan changes how a step is cut, never the update (training/plan.py)
                     "gpu_memory_gb", "grad_accum", "gradient_checkpointing"}


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


def resume_point(cfg: Any, problems: list[Problem], say: Callable[[str], None] = print) -> Path | None:
    """The verified checkpoint ``--resume`` names (``latest``: the newest usable one in the run folder)."""
    if not cfg.resume:
        return None
    saved = Path(cfg.output_dir) / "config.yaml"
    if saved.is_file():
        from surefit.config import config_to_dict, load_yaml

        before = load_yaml(saved)
        now = config_to_dict(cfg)
        changed = [k for k, v in before.items() if k not in RESUME_MAY_CHANGE and k in now and now[k] != v]
        for k in changed:
            problems.append(Problem(f"the run was started with {k}={before[k]!r}; resuming with {now[k]!r} would not "
                                    "continue the same run", f"--{k}", f"drop --{k} (or start a new run)"))
    if cfg.resume == "latest":
        folder = latest_checkpoint(Path(cfg.output_dir) / "checkpoints", say)
        if folder is None:
            problems.append(Problem(f"nothing to resume: no usable checkpoint in {Path(cfg.output_dir) / 'checkpoints'}",
                                    "--resume", "check --output_dir, or start a new run without --resume"))
        return folder
    folder = Path(cfg.resume)
    reason = verify(folder) if folder.is_dir() else "no such folder"
    if reason:
        problems.append(Problem(f"cannot resume from {folder}: {reason}", "--resume",
                                "use --resume alone to pick the newest usable checkpoint"))
        return None
    return folder


def start_output_dir(cfg: Any, previous: list[str], say: Callable[[str], None] = print,
                     data_report: dict[str, Any] | None = None) -> Path:
    """Make the run folder; with ``--overwrite``, remove the previous run first; save the resolved config.

    ``data_report``: this run's, when its data was read already. Rows rejected under ``--on_bad_rows skip`` were then
    written to ``rejected_rows.jsonl`` before this (so that a data error can point at the file): that file is this
    run's, not the previous one's, and stays. Only the main process does it; the others wait until it is done.
    """
    out = Path(cfg.output_dir)
    if cfg.resume:
        return out  # the run's own config.yaml stays as it was written when the run started
    if not is_main_process():
        barrier()
        return out
    if data_report and data_report.get("rejected_rows"):
        previous = [name for name in previous if name != "rejected_rows.jsonl"]
    for name in previous:
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    if previous:
        say(f"--overwrite: removed the previous run's {', '.join(previous)} from {out}")
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    barrier()
    return out


def resume_command(cfg: Any) -> str:
    processes = f" --num_processes {world_size()}" if world_size() > 1 else ""
    return f"surefit train --config {Path(cfg.output_dir) / 'config.yaml'} --resume{processes}"


def save_final(out: Path, save_model: Callable[[Path], None]) -> Path:
    """Write ``final/`` atomically (temporary folder, then rename); the main process writes, the others wait."""
    final, tmp = out / "final", out / "final.tmp"
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    barrier()
    return final


def open_metrics_log(cfg: Any, out: Path, accelerator: Any) -> Any:
    """``OUTPUT/metrics.jsonl``, copied to the ``--report_to`` trackers, with ``curves.png`` redrawn after each epoch.

    ``accelerator`` must come from ``make_accelerator(..., report_to=cfg.trackers, project_dir=out)``.
    """
    from surefit.training.loop import MetricsLog
    from surefit.training.trackers import Trackers

    main = getattr(accelerator, "is_main_process", True)
    trackers = Trackers(accelerator, cfg, out) if getattr(accelerator, "log_with", None) else None
    after_epoch = None
    if main:
        from surefit.report import write_curves

        after_epoch = lambda: write_curves(out)  # noqa: E731
    return MetricsLog(out / "metrics.jsonl", trackers=trackers, after_epoch=after_epoch)


def write_run_report(out: Path, accelerator: Any = None, say: Callable[[str], None] = print) -> None:
    """At the end of a run: ``curves.png`` and ``report.html`` (main process only; ``surefit report`` rebuilds them)."""
    if accelerator is not None and not getattr(accelerator, "is_main_process", True):
        return
    from surefit.report import write_report

    try:
        write_report(out, say=say)
    except Exception as e:  # noqa: BLE001 - the model is saved; a page that cannot be drawn must not fail the run
        say(f"warning: could not write {out / 'report.html'}: {type(e).__name__}: {e} "
            f"(retry with: surefit report --run {out})")


def write_rejected(cfg: Any, rejects: list, say: Callable[[str], None] = print) -> None:
    """With ``--on_bad_rows skip``: every dropped row, with its location and reason, in ``rejected_rows.jsonl``."""
    import json

    if not rejects or not is_main_process():
        return
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "rejected_rows.jsonl").open("w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in rejects)
    say(f"--on_bad_rows skip: {len(rejects)} rows rejected, each with its reason in {out / 'rejected_rows.jsonl'} "
        f"(first: {rejects[0].where}: {rejects[0].reason})")


def quiet_libraries() -> None:
    """Library progress bars (weight loading, shard writing) and deprecation chatter drown the run's own report."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*is deprecated.*", category=FutureWarning)
