"""Checkpoints written atomically: into a temporary folder, fsynced, then renamed into place.

A reader therefore sees either a complete checkpoint or none; a crash mid-write leaves only a ``.tmp`` folder that
the next save removes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with p.open("rb") as fh:
                os.fsync(fh.fileno())


def save_checkpoint(
    folder: str | Path,
    save_model: Callable[[Path], None],
    *,
    optimizer: Any = None,
    scheduler: Any = None,
    state: dict[str, Any] | None = None,
) -> Path:
    """Write ``folder`` atomically with the model (via ``save_model``), optimizer, scheduler and a state JSON."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state or {}, indent=2), encoding="utf-8")
    _fsync_tree(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder
