"""The run folder's lock: one run at a time in an ``--output_dir``, for the life of the run.

``fcntl.flock`` on ``OUTPUT/.surefit.lock``; the file names the holder (pid, host, command, start time). The kernel
drops a flock when its process dies, however it dies, so a lock file that still names a holder but can be taken
belongs to a killed run: it is taken over, and the takeover is reported.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from surefit.config import TrainConfig
from surefit.errors import Problem, SurefitError
from surefit.training.processes import is_main_process, world_size

Say = Callable[[str], None]
LOCK = ".surefit.lock"


class RunLocked(SurefitError):
    title = "run folder in use"


class RunLock:
    """An exclusive lock on a run folder for the life of a run (``fcntl.flock`` on ``OUTPUT/.surefit.lock``).

    The file holds the holder's pid, host, command and start time, so a refused run can name it. The kernel drops
    a flock when its process dies, however it dies, so a lock whose file still names a holder but can be taken is
    stale (its run was killed): it is taken over and the takeover is reported. On a clean exit the file is emptied.

    Only the main process of a multi-process run locks; the others are the same run.
    """

    def __init__(self, folder: str | os.PathLike, say: Say = print) -> None:
        self.folder, self.say = Path(folder), say
        self.path = self.folder / LOCK
        self._fd: int | None = None
        self.created_folder = False
        self.took_over: dict[str, Any] | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise :class:`RunLocked` naming the process that holds it."""
        import fcntl

        from surefit.run_folder.links import open_own

        if self.folder.exists() and not self.folder.is_dir():
            return self  # --output_dir is a file: reported with the other configuration problems
        try:
            if not self.folder.exists():
                self.folder.mkdir(parents=True, exist_ok=True)
                self.created_folder = True
            # never through a link: a lock file planted as a symlink would get the file it points to emptied
            fd = open_own(self.path, os.O_RDWR | os.O_CREAT, "the run's lock file")
        except OSError as e:
            raise SurefitError(Problem(f"cannot create {self.path}: {e.strerror or e}", "--output_dir",
                                       "pass an --output_dir you can write to")) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                # A file system without locks (some network mounts): run, but say that nothing guards the folder.
                os.close(fd)
                self.say(f"warning: cannot lock {self.path} ({e.strerror or e}): nothing stops a second run from "
                         "writing into this folder at the same time")
                return self
            os.close(fd)
            holder = _read_lock(self.path)
            raise RunLocked(Problem(
                f"{self.folder} is in use by another surefit run: {_describe_holder(holder)}; two runs in one folder "
                "would interleave metrics.jsonl and mix their checkpoints and final/", "--output_dir",
                "wait for that run to finish (or stop it), or pass another --output_dir; to continue it later use "
                "--resume once it has stopped")) from None
        stale = _read_lock(self.path)
        if stale:
            self.took_over = stale
            self.say(f"took over the lock of {self.folder} from a run that is no longer running "
                     f"({_describe_holder(stale)}); it was interrupted or killed")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(shlex.quote(a) for a in sys.argv)}
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
        except OSError:
            pass  # a full disk: the lock holds all the same (a refused run then cannot name this one)
        return self

    def release(self) -> None:
        """Empty the lock file (a clean exit leaves no stale holder) and drop the lock."""
        if self._fd is None:
            return
        import fcntl

        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass  # a full disk cannot stop the unlock; the next run reports a harmless takeover
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        if self.created_folder and self.folder.is_dir() and [p.name for p in self.folder.iterdir()] == [LOCK]:
            shutil.rmtree(self.folder, ignore_errors=True)  # a run refused before writing anything leaves no folder

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


@contextmanager
def lock_run(cfg: TrainConfig, say: Say = print) -> Iterator[RunLock | None]:
    """Hold the lock on ``--output_dir`` for the block. With several processes the main one takes it and every
    process learns whether it did, so that a refused run stops on all of them rather than leaving some waiting."""
    lock = RunLock(cfg.output_dir, say) if is_main_process() else None
    refused: list[dict[str, str]] | None = None
    if lock is not None:
        try:
            lock.acquire()
        except SurefitError as e:  # in use, or a lock file that is a link: every process stops
            refused = [vars(p) for p in e.problems]
            if world_size() <= 1:
                raise
    if world_size() > 1:
        from surefit.training.processes import share_from_main

        refused = share_from_main(refused)
        if refused:
            raise RunLocked([Problem(**p) for p in refused])
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def _read_lock(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8").strip()
        value = json.loads(text) if text else {}
    except (OSError, ValueError):
        return {"unreadable": True}
    return value if isinstance(value, dict) else {"unreadable": True}


def _describe_holder(holder: dict[str, Any]) -> str:
    if not holder or holder.get("unreadable"):
        return f"a process whose lock file holds no readable details ({LOCK})"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command')}")
