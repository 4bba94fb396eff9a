"""Experiment trackers (``--report_to tensorboard,wandb``) through accelerate, fed from the records of metrics.jsonl.

``metrics.jsonl`` stays the run's own record; the trackers get a copy of each record's numbers, so what TensorBoard
or W&B shows is exactly what the file holds:

- step records at their global step as ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
  ``train/oom_splits``;
- epoch records (epoch 0 = before training) at the global step reached by then, evaluation figures as ``eval/...``
  (``eval_loss`` -> ``eval/loss``, ``eval_f1`` -> ``eval/f1``, per-class F1 as ``eval/per_class_f1/NAME``) and the
  rest as ``epoch/...`` (``epoch/train_loss``, ``epoch/time_per_epoch``, ``epoch/epoch``, ...).

TensorBoard event files go to ``OUTPUT/tensorboard/surefit/`` (``tensorboard --logdir OUTPUT/tensorboard``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from surefit.config import TrainConfig

# accelerate's project name: the W&B project, and the TensorBoard run folder under OUTPUT/tensorboard.
PROJECT = "surefit"
TENSORBOARD_DIR = "tensorboard"

_NOT_VALUES = {"type", "step", "time"}


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if isinstance(v, float) else v


def tracker_values(record: dict[str, Any]) -> tuple[dict[str, float], int]:
    """The numbers of one metrics.jsonl record, named for the trackers, and the global step they belong at."""
    values: dict[str, float] = {}
    if record.get("type") == "step":
        for k, v in record.items():
            if k not in _NOT_VALUES and k != "epoch" and (n := _number(v)) is not None:
                values[f"train/{k}"] = n
        return values, int(record["step"])
    for k, v in record.items():
        if k in _NOT_VALUES:
            continue
        name = f"eval/{k[len('eval_'):]}" if k.startswith("eval_") else f"epoch/{k}"
        if isinstance(v, dict):  # per-class F1: one scalar per class
            for sub, x in v.items():
                if (n := _number(x)) is not None:
                    values[f"{name}/{sub}"] = n
        elif (n := _number(v)) is not None:
            values[name] = n
    return values, int(record.get("step") or 0)


def _hparams(config: TrainConfig | dict[str, Any] | None) -> dict[str, Any]:
    """The resolved config as the flat scalar mapping trackers store (TensorBoard hparams, W&B config)."""
    if config is None:
        return {}
    values = dict(config) if isinstance(config, dict) else dataclasses.asdict(config)
    return {k: v if v is None or isinstance(v, bool | int | float | str) else str(v) for k, v in values.items()}


class Trackers:
    """The accelerator's trackers, started lazily (so a resumed run can first say where to cut the old curves).

    Args:
        accelerator: an ``Accelerator`` made with ``log_with=[...]`` (see ``make_accelerator``).
        config: the run's config (a dataclass or mapping), stored as hyperparameters.
        run_dir: the run folder; W&B's local files go there, named after it.
    """

    def __init__(self, accelerator: Any, config: TrainConfig | dict[str, Any], run_dir: str | Path):
        self.accelerator = accelerator
        self.config = config
        self.run_dir = Path(run_dir)
        self.started = False

    @property
    def names(self) -> list[str]:
        return [str(t) for t in (getattr(self.accelerator, "log_with", None) or [])]

    def start(self, purge_step: int | None = None) -> None:
        """Open the trackers. ``purge_step``: on resume, TensorBoard drops this run's events from that step on
        (the interrupted process logged them after the checkpoint; they are logged again)."""
        if self.started:
            return
        self.started = True
        init_kwargs: dict[str, dict[str, Any]] = {"wandb": {"name": self.run_dir.name, "dir": str(self.run_dir)}}
        if purge_step is not None:
            init_kwargs["tensorboard"] = {"purge_step": purge_step}
        self.accelerator.init_trackers(PROJECT, config=_hparams(self.config), init_kwargs=init_kwargs)

    def log(self, record: dict[str, Any]) -> None:
        self.start()
        values, step = tracker_values(record)
        if values:
            self.accelerator.log(values, step=step)

    def log_text(self, texts: dict[str, str], step: int) -> None:
        """Text entries (TensorBoard's Text tab, W&B strings), e.g. sample generations at an evaluation."""
        self.start()
        if texts:
            self.accelerator.log(texts, step=step)

    def finish(self) -> None:
        """Close every tracker (flushes TensorBoard's files, ends the W&B run).

        ``accelerator.end_training()`` would do this too, but it also destroys the process group, which the run still
        needs after the log closes (the final save); so the trackers are finished one by one.
        """
        if not self.started:
            return
        for tracker in getattr(self.accelerator, "trackers", []):
            tracker.finish()
        self.started = False


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, flushed as written so a crashed run keeps what it logged.

    Args:
        trackers: also send each record's numbers to these experiment trackers (``--report_to``).
        after_epoch: called after each epoch record is written (e.g. to redraw ``curves.svg``); a failure there is
            reported, never fatal to training.
    """

    def __init__(self, path: str | Path, trackers: Trackers | None = None,
                 after_epoch: Callable[[], object] | None = None, writes: bool = True):
        self.path = Path(path)
        self._fh: TextIO
        if not writes:
            # A process other than the main one: it never writes records, and on another machine it must not even
            # create the file (the run folder belongs to the main process; on a shared filesystem it is shared).
            self._fh = io.StringIO()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            from surefit.run_folder.links import open_own

            # appended to, never through a link (a metrics.jsonl planted as a symlink would grow the file it points to)
            fd = open_own(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "the run's metrics log")
            self._fh = open(fd, "a", encoding="utf-8")  # noqa: SIM115 - held for the life of the run
        self._t0 = time.time()
        self.trackers = trackers
        self.after_epoch = after_epoch

    def bytes_written(self) -> int:
        self._fh.flush()
        return self._fh.tell()

    def truncate(self, size: int) -> None:
        """Cut the log back to ``size`` bytes (the length it had when a checkpoint was written)."""
        self._fh.flush()
        self._fh.truncate(size)
        self._fh.seek(size)
        if self.trackers is not None:
            # The trackers already hold the interrupted process's later points: TensorBoard drops them from here on.
            self.trackers.start(purge_step=_last_step(self.path, size) + 1)

    def write(self, record: dict[str, Any]) -> None:
        record = {**record, "time": round(time.time() - self._t0, 3)}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self.trackers is not None:
            self.trackers.log(record)
        if self.after_epoch is not None and record.get("type") == "epoch":
            try:
                self.after_epoch()
            except Exception as e:  # noqa: BLE001 - a plot must not stop training; say so and go on
                print(f"warning: could not refresh the run's curves: {type(e).__name__}: {e}", file=sys.stderr)

    def close(self) -> None:
        self._fh.close()
        if self.trackers is not None:
            self.trackers.finish()


def _last_step(path: Path, size: int) -> int:
    """The highest global step among the first ``size`` bytes of a metrics.jsonl (0 when none)."""
    with path.open("rb") as fh:
        head = fh.read(size)
    steps = [0]
    for line in head.decode("utf-8", errors="replace").splitlines():
        try:
            steps.append(int(json.loads(line).get("step") or 0))
        except (ValueError, AttributeError, TypeError):
            continue
    return max(steps)
