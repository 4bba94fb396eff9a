"""A training process lost under DDP or FSDP (killed by the kernel's OOM killer, by hand, by a scheduler): the run
stops with a message that names the process, the last good checkpoint and the command that resumes from it, instead
of the collective's "Connection closed by peer" traceback in the processes left behind.

Two places see the loss: the launcher (``surefit train --num_processes N``), which learns which rank ended and how,
and each surviving process, whose next collective fails. Both say it in these words. On several machines
(``--nnodes``) a whole node can go (its processes and its launcher): the survivors then take a roll call through
torchrun's rendezvous store and name the node that did not answer, with its host and processes; a node that never
joins within ``--join_timeout`` is named by the launcher of node 0.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

from surefit.config.launch_flags import LaunchFlags
from surefit.errors import Problem, SurefitError
from surefit.training.processes import (
    is_local_main_process,
    launched_as,
    node_count,
    node_index,
    node_of,
    process_index,
    world_size,
)

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


def _recovery(output_dir: str | None, flags: LaunchFlags) -> tuple[str, str]:
    """(the last good checkpoint, in words; the fix with the command that resumes from it)."""
    from surefit.training.checkpoint import latest_checkpoint

    folder = None
    if output_dir:
        folder = latest_checkpoint(Path(output_dir) / "checkpoints", say=lambda _: None)
    out = output_dir or "OUTPUT_DIR"
    srun, note = "srun " if flags.slurm else "", flags.relaunch_note()
    if folder is None:
        return ("no checkpoint had been saved yet, so there is nothing to resume",
                f"train again: {srun}surefit train ... --output_dir {out} --overwrite{flags.relaunch_flags()}{note}")
    return (f"the last good checkpoint is {folder} (verified)",
            f"resume with: {srun}surefit train --resume --output_dir {out}{flags.relaunch_flags()}{note}")


def _how(exitcode: int) -> str:
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    why = " (the kernel's out-of-memory killer does this, or a kill -9)" if name == "SIGKILL" else ""
    return f"was killed by {name}{why}"


def describe_node(node: int, flags: LaunchFlags, host: str | None) -> str:
    """``node 1 (host gpu02, processes 4-7)``: a node as the user finds it."""
    ranks = flags.ranks_of(node)
    which = f"process {ranks[0]}" if len(ranks) == 1 else f"processes {ranks[0]}-{ranks[-1]}"
    return f"node {node} ({'host ' + host + ', ' if host else ''}{which})"


# Keys of the run's rendezvous store (torchrun's, at MASTER_ADDR:MASTER_PORT) that surefit's processes write.
_HOST_KEY, _ALIVE_KEY = "surefit/host/{}", "surefit/alive/{}"
# How long survivors wait for each other to answer the roll call. The main process answers first and reports; the
# others wait longer, so that the launcher, which stops a node's processes once one has ended, stops them after the
# main process has said which node was lost.
ROLL_CALL_S = 4.0


def _store(timeout_s: float) -> Any:
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def register_node() -> None:
    """Each node's first process writes its host name to the run's store, so a lost node can be named by host.

    Only a hint for messages: nothing fails if the store cannot be reached.
    """
    # Under torchrun the store (its agent's) exists before the processes start; under other launchers it is rank
    # 0's, created later by the process group: nothing to wait for here.
    if node_count() <= 1 or not is_local_main_process() or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    try:
        socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=5).close()
        _store(30).set(_HOST_KEY.format(node_index()), socket.gethostname())
    except Exception:  # noqa: BLE001 - a message hint only
        return


def roll_call(wait_s: float) -> tuple[set[int] | None, dict[int, str]]:
    """The ranks still alive (each survivor answers, then waits ``wait_s`` for the others) and the nodes' hosts.

    ``None`` when the store cannot be reached: the node holding it (node 0, with the rendezvous) is gone.
    """
    world = world_size()
    try:
        # A plain connection first: torch's store client logs every failed attempt with native stack frames.
        socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=5).close()
        store = _store(5)
        store.set(_ALIVE_KEY.format(process_index()), "1")
        deadline = time.monotonic() + wait_s
        while True:
            alive = {r for r in range(world) if store.check([_ALIVE_KEY.format(r)])}
            if len(alive) == world or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        hosts = {n: store.get(_HOST_KEY.format(n)).decode("utf-8", "replace") for n in range(node_count())
                 if store.check([_HOST_KEY.format(n)])}
    except Exception:  # noqa: BLE001 - the store's host is unreachable: that node is gone
        return None, {}
    return alive, hosts


def lost_here(e: BaseException, rank: int, processes: int, output_dir: str | None) -> WorkerLost:
    """The error a surviving process reports when its collective found a peer gone.

    On several nodes the survivors take a roll call through the rendezvous store, so the message names the node
    that is gone (its host and processes), not just "a peer".
    """
    flags = launched_as()
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    last, fix = _recovery(output_dir, flags)
    if flags.multi_node:
        alive, hosts = roll_call(ROLL_CALL_S if rank == 0 else ROLL_CALL_S + 3)
        if alive is None:
            gone = [0]
            hosts = {0: flags.master_addr or ""}
        else:
            gone = sorted({node_of(r) for r in range(processes) if r not in alive})
            hosts.setdefault(0, flags.master_addr or "")
        if gone:
            names = ", ".join(describe_node(n, flags, hosts.get(n)) for n in gone)
            here = describe_node(node_index(), flags, socket.gethostname())
            why = ("its rendezvous store at " f"{flags.master_addr}:{flags.master_port} cannot be reached"
                   if alive is None else "it did not answer the roll call of the surviving processes")
            return WorkerLost(Problem(
                f"lost {names}: {why} after a collective failed "
                f"({first[:200]}); process {rank} of {processes} on {here} stopped the run; {last}",
                where=f"node {gone[0]}" if len(gone) == 1 else "nodes " + ", ".join(map(str, gone)), fix=fix))
    other = f"process {1 - rank}" if processes == 2 else "another process"
    return WorkerLost(Problem(
        f"process {rank} of {processes} lost contact with {other} of this run, which has ended ({first[:200]}); "
        f"the run stopped; {last}", fix=fix))


def lost_by_launcher(failures: dict[int, int], flags: LaunchFlags, output_dir: str | None) -> WorkerLost | None:
    """The error the launcher reports from the processes' exit codes (``{rank: exit code}``, negative for a signal).

    The lost process is one killed by a signal other than the SIGTERM the launcher sends the others once one has
    ended; ``None`` when no process was (a stop asked for by the user, or an error each process reported itself).
    """
    killed = sorted(r for r, code in failures.items() if code < 0 and -code != signal.SIGTERM)
    if not killed:
        return None
    rank = killed[0]
    last, fix = _recovery(output_dir, flags)
    where = f"process {rank}"
    if flags.multi_node:
        where = f"process {rank} on node {flags.node_rank} (host {socket.gethostname()})"
    return WorkerLost(Problem(
        f"training process {rank} of {flags.world_size()} {_how(failures[rank])}; the others were stopped; {last}",
        where=where, fix=fix))


class NodesDidNotMeet(SurefitError):
    """The machines of a several-node run did not all reach the rendezvous."""

    exit_code = 1
    title = "the nodes of the run did not meet"


def never_joined(e: BaseException, flags: LaunchFlags) -> NodesDidNotMeet | None:
    """The error a node's launcher reports when the nodes did not all meet within ``--join_timeout``.

    ``None`` when ``e`` is not a rendezvous failure (it is then raised as it is).
    """
    text = str(e)
    endpoint = f"{flags.master_addr}:{flags.master_port}"
    waited = re.search(r"(\d+)/(\d+) clients joined", text)
    if waited and flags.node_rank == 0:
        joined = int(waited.group(1))
        missing = flags.nnodes - joined
        names = "node 1" if flags.nnodes == 2 else f"{missing} of nodes 1 to {flags.nnodes - 1}"
        return NodesDidNotMeet(Problem(
            f"{names} never joined: node 0 waited {flags.join_timeout} s at {endpoint} and {joined} of "
            f"{flags.nnodes} nodes arrived (this one included); nothing was trained", "--join_timeout",
            f"start `surefit train` with the same flags and --node_rank 1 .. {flags.nnodes - 1} on the other machines "
            f"within --join_timeout (now {flags.join_timeout} s), check that they reach {endpoint} (same "
            "--master_addr and --master_port, no firewall on the port)"))
    if flags.node_rank > 0 and re.search(r"timed out .* connect|Connection refused|connect.*timed out", text, re.I):
        return NodesDidNotMeet(Problem(
            f"node {flags.node_rank} could not reach node 0 at {endpoint} within {flags.join_timeout} s; nothing was "
            "trained", "--master_addr",
            f"start node 0 (--node_rank 0) on {flags.master_addr} with --master_port {flags.master_port}, and check "
            "that this machine reaches that address and port"))
    if re.search(r"EADDRINUSE|address already in use", text, re.I):
        return NodesDidNotMeet(Problem(f"port {flags.master_port} is already in use on node 0 ({flags.master_addr})",
                                  "--master_port", "pick a free port, the same on every node, e.g. --master_port "
                                  f"{flags.master_port + 1}"))
    return None
