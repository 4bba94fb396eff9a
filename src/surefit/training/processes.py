"""Which process this is, and what every process must agree on: who writes, who waits (one process: nothing waits).

A run of N processes is the same run as one process: the global steps are the same (``data/sampling.py``), each
step's examples are dealt to the processes (:func:`~surefit.data.sampling.deal`), and the loss is normalised by the
whole step's count (``training/loop.py``). Only the main process prints and writes files (config, data reports,
metrics, predictions, checkpoints, the final model); the other processes wait where the main process does something
they depend on:

- :func:`barrier` after every process has looked at the run folder, before the main process changes it, and after
  the main process has written a checkpoint or the final model;
- :func:`share_from_main` hands the main process's result (an evaluation, the doctor's verdict) to every process,
  so all of them go on, or stop, together.

The launchers (``torchrun``, ``accelerate launch``, ``surefit train --num_processes N``) set ``RANK`` and
``WORLD_SIZE``; they are read here before any Accelerator exists, so a task knows from its first line which process
is the main one. The process group is started (by accelerate's ``PartialState``) on first use.

On several machines (``--nnodes``) there are two kinds of "main": the *global* main process (rank 0, on node 0) is
the only one that prints and writes the run folder, which is shared on a shared filesystem, so a second writer would
race it; the *local* main process of each node (``LOCAL_RANK`` 0) is the one to fill what each machine keeps for
itself (a cache under ``$HOME`` or local scratch), since another node's global main cannot write there.
:func:`is_main_process` is the global one; :func:`is_local_main_process` the per-node one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from surefit.config.launch_flags import LaunchFlags

# How long a process waits for the others at a barrier or broadcast. The main process evaluates (and, for --task
# sft, generates) alone while the others wait, so this bounds the evaluation's length; torch's defaults (10 minutes
# for NCCL) would end a long evaluation with a timeout.
WAIT = timedelta(hours=2)


def world_size() -> int:
    """Processes in the run (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def process_index() -> int:
    """This process's global rank (0 is the main process)."""
    return int(os.environ.get("RANK", "0") or 0)


def is_main_process() -> bool:
    """Whether this is the global main process (rank 0): the one that prints and writes the run folder."""
    return process_index() == 0


def local_world_size() -> int:
    """Processes on this machine (torchrun's ``LOCAL_WORLD_SIZE``; every process on one machine otherwise)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world_size()


def local_process_index() -> int:
    """This process's rank on its machine (``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def is_local_main_process() -> bool:
    """Whether this is the first process of its machine: the one to write what each machine keeps for itself."""
    return local_process_index() == 0


def node_count() -> int:
    """Machines in the run (torchrun starts the same number of processes on each)."""
    return max(1, world_size() // max(1, local_world_size()))


def node_index() -> int:
    """This machine's index (torchrun's ``GROUP_RANK``; node 0 holds the global main process)."""
    raw = os.environ.get("GROUP_RANK")
    return int(raw) if raw else process_index() // max(1, local_world_size())


def node_of(rank: int) -> int:
    """The node a global rank runs on: torchrun numbers each node's processes contiguously, node 0's first."""
    return rank // max(1, local_world_size())


def launched_as() -> LaunchFlags:
    """The launch settings of this run, as this process sees them (to say how to start it again)."""
    from surefit.config.launch_flags import DEFAULT_PORT

    # Set by surefit's launcher for its processes when SLURM's variables gave the node settings.
    slurm = os.environ.get("SUREFIT_SLURM") == "1" and node_count() > 1
    return LaunchFlags(num_processes=local_world_size(), nnodes=node_count(), node_rank=node_index(),
                       master_addr=os.environ.get("MASTER_ADDR") if node_count() > 1 else None,
                       master_port=int(os.environ.get("MASTER_PORT") or DEFAULT_PORT), slurm=slurm)


def on_main(say: Callable[[str], None]) -> Callable[[str], None]:
    """``say`` on the main process, a no-op on the others (a run of N processes prints its report once)."""
    return say if is_main_process() else quiet


def quiet(*_: Any, **__: Any) -> None:
    return None


def cpu_processes() -> bool:
    """Several processes and no GPU: accelerate must be told to form a group of CPU processes (gloo), or each
    process would train alone as a world of one."""
    if world_size() <= 1:
        return False
    import torch

    xpu = getattr(torch, "xpu", None)
    return not torch.cuda.is_available() and not (xpu is not None and xpu.is_available())


def state() -> Any:
    from accelerate import PartialState

    return PartialState(cpu=cpu_processes(), timeout=WAIT)


def barrier() -> None:
    """Wait until every process gets here (nothing to do in a run of one process)."""
    if world_size() > 1:
        state().wait_for_everyone()


def share_from_main(value: Any) -> Any:
    """The main process's ``value`` (anything JSON can hold), on every process; also a barrier.

    Sent as JSON bytes, never pickled: the other processes pass ``None`` and get the main process's value.
    """
    if world_size() <= 1:
        return value
    import torch
    import torch.distributed as dist

    device = state().device
    if is_main_process():
        data = json.dumps(value).encode("utf-8")
        size = torch.tensor([len(data)], dtype=torch.long, device=device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    if is_main_process():
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    return value if is_main_process() else json.loads(buf.cpu().numpy().tobytes().decode("utf-8"))


def sum_over_processes(values: list[float], device: Any) -> list[float]:
    """Element-wise sum of ``values`` over every process (float64, so a sum of losses loses nothing to fp32)."""
    if world_size() <= 1:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


def finish() -> None:
    """Close the process group at the end of a successful run (torch warns about one left open at exit)."""
    if world_size() <= 1:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def max_over_processes(value: int, device: Any) -> int:
    """The largest ``value`` over every process."""
    if world_size() <= 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
