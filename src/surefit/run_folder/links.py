"""The run folder's own files, never through a symbolic link: a link planted where the run writes its lock, metrics
or records must not get the file it points to written, emptied or deleted.

- :func:`open_own` opens a file of the run folder with ``O_NOFOLLOW`` (a link there is refused, naming its target).
- A symlinked ``checkpoints/`` folder is storage (e.g. on a bigger disk): it is written into, and ``--overwrite``
  removes only the previous run's checkpoint folders inside it, never the link's target itself
  (:func:`remove_previous`). Any other link among the run's names is removed as a link, never followed.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from surefit.errors import Problem, SurefitError

# Where a symlink is storage the run writes through, not a file to replace: checkpoints/ on another disk.
STORAGE = ("checkpoints",)
_CHECKPOINT = re.compile(r"^(step-\d+|epoch-\d+)(\.tmp)?$")


def link_problem(path: Path, what: str) -> Problem:
    """A file of the run folder that is a symbolic link: named with its target, and the fix."""
    return Problem(f"{path} ({what}) is a symbolic link to {os.path.realpath(path)}; surefit never writes a run "
                   "folder's own files through a link (it would change the file it points to)", str(path),
                   f"remove the link (rm {path}) and run again")


def open_own(path: str | os.PathLike, flags: int, what: str, mode: int = 0o644) -> int:
    """``os.open`` of a run folder's own file without following a symbolic link (``O_NOFOLLOW``).

    Raises:
        SurefitError: ``path`` is a symbolic link (its target is named, and left alone).
    """
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise SurefitError(link_problem(Path(path), what)) from None
        raise


def is_previous(path: Path) -> bool:
    """Whether ``path`` holds a previous run's file: a file or link, or a folder with something in it. A
    ``checkpoints/`` that holds no checkpoint (e.g. symlinked to a bigger disk) is storage made ready, not a run."""
    if path.name in STORAGE and path.is_dir():
        return any(_CHECKPOINT.match(p.name) for p in path.iterdir())
    if path.is_symlink():
        return not path.is_dir() or any(path.iterdir())
    if path.is_dir():
        return any(path.iterdir())
    return path.exists()


def remove_previous(out: Path, names: list[str], say: Callable[[str], None] = print) -> None:
    """``--overwrite``: remove the previous run's ``names`` from ``out`` without deleting through a link."""
    for name in names:
        target = out / name
        if target.is_symlink():
            if name in STORAGE and target.is_dir():
                gone = []
                for p in sorted(target.iterdir()):
                    if _CHECKPOINT.match(p.name) and p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p)
                        gone.append(p.name)
                if gone:
                    say(f"--overwrite: removed the previous run's checkpoints {', '.join(gone)} from {target} (a "
                        f"link to {os.path.realpath(target)}, kept as the run's checkpoint storage)")
                continue
            target.unlink()  # the link itself; what it points to stays
        elif target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
