"""A training process lost under DDP or FSDP (killed by the kernel's OOM killer, by hand, by a scheduler): the run
stops with a message that names the process, the last good checkpoint and the command that resumes from it, instead
of the collective's "Connection closed by peer" traceback in the processes left behind.

Two places see the loss: the launcher (``surefit train --num_processes N``), which learns which rank ended and how,
and each surviving process, whose next collective fails. Both say it in these words.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from surefit.errors import Problem, SurefitError

# What a collective raises when its peer has gone: gloo (TCP), NCCL, and the sockets under them.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crash|Broken pipe|"
                        r"NCCL communicator was aborted|remote process exited|peer .* closed|Connection refused",
                        re.IGNORECASE)


class WorkerLost(SurefitError):
    """A process of a several-process run ended while the others trained."""

    exit_code = 1
    title = "a training process was lost"


def peer_gone(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a collective failing because a peer process ended."""
    seen: set[int] = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, (RuntimeError, OSError)) and _PEER_GONE.search(str(at)):
            return True
        at = at.__cause__ or at.__context__
    return False


def _recovery(output_dir: str | None, processes: int) -> tuple[str, str]:
    """(the last good checkpoint, in words; the fix with the command that resumes from it)."""
    from surefit.training.checkpoint import latest_checkpoint

    folder = None
    if output_dir:
        folder = latest_checkpoint(Path(output_dir) / "checkpoints", say=lambda _: None)
    out = output_dir or "OUTPUT_DIR"
    if folder is None:
        return ("no checkpoint had been saved yet, so there is nothing to resume",
                f"train again: surefit train ... --output_dir {out} --overwrite --num_processes {processes}")
    return (f"the last good checkpoint is {folder} (verified)",
            f"resume with: surefit train --resume --output_dir {out} --num_processes {processes}")


def _how(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    why = " (the kernel's out-of-memory killer does this, or a kill -9)" if name == "SIGKILL" else ""
    return f"was killed by {name}{why}"


def lost_here(e: BaseException, rank: int, processes: int, output_dir: str | None) -> WorkerLost:
    """The error a surviving process reports when its collective found a peer gone."""
    other = f"process {1 - rank}" if processes == 2 else "another process"
    last, fix = _recovery(output_dir, processes)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return WorkerLost(Problem(
        f"process {rank} of {processes} lost contact with {other} of this run, which has ended ({first[:200]}); "
        f"the run stopped; {last}", fix=fix))


def lost_by_launcher(failures: dict[int, int], processes: int, output_dir: str | None) -> WorkerLost | None:
    """The error the launcher reports from the processes' exit codes (``{rank: exit code}``, negative for a signal).

    The lost process is one killed by a signal other than the SIGTERM the launcher sends the others once one has
    ended; ``None`` when no process was (a stop asked for by the user, or an error each process reported itself).
    """
    killed = sorted(r for r, code in failures.items() if code < 0 and -code != signal.SIGTERM)
    if not killed:
        return None
    rank = killed[0]
    last, fix = _recovery(output_dir, processes)
    return WorkerLost(Problem(
        f"training process {rank} of {processes} {_how(failures[rank])}; the others were stopped; {last}",
        where=f"process {rank}", fix=fix))
