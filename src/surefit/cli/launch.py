"""``surefit train --num_processes N [--nnodes M --node_rank K --master_addr A --master_port P]``: surefit starts
this machine's processes itself, through torchrun (``config/launch_flags.py`` reads the flags and SLURM's variables).

The command becomes ``python -m surefit.cli.launch --standalone --nproc_per_node N -m surefit train <the same flags>``
in a child process: ``surefit.cli.launch`` is torchrun (``torch.distributed.run``) plus one thing torchrun does not do,
which is to exit with the training processes' own exit code (torchrun exits 1 for any failure, so a configuration
error, 2, and an interrupted run, 130, would look alike). The parent forwards SIGINT and SIGTERM to the child, which
passes them on to every training process once: they finish the step, save a checkpoint and exit with 130.

Limits: torchrun gives the processes 30 seconds (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) to finish after a signal
before it kills them; a step plus a checkpoint that take longer end with the previous checkpoint, which ``--resume``
uses. A parent killed with SIGKILL cannot pass anything on: its child then runs on (stop it with SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from surefit.config.launch_flags import LAUNCH_FLAGS, LaunchFlags, split_launch_flags
from surefit.threads import KERNEL_CACHE_VARIABLES, available_cores, chosen_here

# Help for `surefit train --help`; the flags themselves are read by split_launch, before the run's settings.
_HELP = {
    "num_processes": ("N", "train as N processes on this machine (DDP through torchrun, one per GPU, or on CPU "
                      "cores); torchrun's --nproc_per_node is the same. --batch_size stays the global batch. Under "
                      "torchrun or accelerate launch, leave it out"),
    "nnodes": ("M", "machines in the run (torchrun's --nnodes); run the same command on each, with its own "
               "--node_rank. Under srun, read from SLURM"),
    "node_rank": ("K", "this machine's index, 0 to M-1; node 0 holds the main process, which writes the run folder"),
    "master_addr": ("HOST", "node 0's host name or IP address, as every machine reaches it"),
    "master_port": ("PORT", "node 0's port for the rendezvous (default 29500)"),
    "join_timeout": ("SECONDS", "how long the nodes wait for each other to join (default 600)"),
}
LAUNCH_SETTINGS = frozenset(_HELP)


def add_launch_flags(parser: Any) -> None:
    """Register the launch flags on ``surefit train``'s parser, for ``--help``."""
    for setting, (metavar, text) in _HELP.items():
        names = [flag for flag, s in LAUNCH_FLAGS.items() if s == setting]
        parser.add_argument(*names, dest=setting, default=argparse.SUPPRESS, metavar=metavar, help=text)


def split_launch(argv: Sequence[str]) -> tuple[LaunchFlags | None, list[str]]:
    """``(the launch settings, the other arguments)`` from ``surefit train`` arguments and this process's environment.

    Raises:
        ConfigError: every problem with the launch flags or the SLURM environment, together.
    """
    return split_launch_flags(argv, os.environ)


def command(flags: LaunchFlags, argv: Sequence[str]) -> list[str]:
    """The child's command line: torchrun for ``flags``, running ``surefit <argv>``.

    One machine: ``--standalone`` (a rendezvous on a free local port). Several: torchrun's static TCP rendezvous at
    ``--master_addr:--master_port``, which keeps ``--node_rank`` as given (torchrun's c10d rendezvous numbers the
    nodes in the order they join and ignores ``--node_rank``), so node 0 always holds rank 0, the process that writes
    the run folder. ``--max_restarts 0``: a lost node stops the run (resumed from its checkpoint) rather than
    restarting every process from the start of the script.
    """
    head = [sys.executable, "-m", "surefit.cli.launch"]
    if not flags.multi_node:
        return [*head, "--standalone", "--nproc_per_node", str(flags.num_processes), "-m", "surefit", *argv]
    return [*head, "--nnodes", str(flags.nnodes), "--node_rank", str(flags.node_rank), "--master_addr",
            str(flags.master_addr), "--master_port", str(flags.master_port), "--rdzv_backend", "static",
            "--rdzv_conf", f"timeout={flags.join_timeout}", "--max_restarts", "0",
            "--nproc_per_node", str(flags.num_processes), "-m", "surefit", *argv]


def process_env(flags: LaunchFlags) -> dict[str, str]:
    """The environment of this machine's training processes.

    torchrun sets 1 thread per process when ``OMP_NUM_THREADS`` is unset (and says so): the cores are shared out
    instead. The value ``surefit`` itself chose at start (every core, for one process) is replaced too; only the
    user's is kept. Each process then has a fixed count (sleeping waits, no governor: threads.py). oneDNN's kernel
    cache capacity, where surefit chose it here, is left for each process to choose, and to report as surefit's."""
    env = dict(os.environ)
    if not env.get("OMP_NUM_THREADS") or chosen_here("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = str(max(1, available_cores() // flags.num_processes))
    if chosen_here(KERNEL_CACHE_VARIABLES[0]):
        del env[KERNEL_CACHE_VARIABLES[0]]
    return env


def launch(flags: LaunchFlags, argv: Sequence[str]) -> int:
    """Run ``surefit <argv>`` as this machine's processes of ``flags`` and return their exit code (0: all succeeded)."""
    env = process_env(flags)
    if flags.slurm:
        env["SUREFIT_SLURM"] = "1"  # the processes then word the resume command as `srun surefit train ...`
    # A session of its own: Ctrl-C in a terminal reaches this process only, which passes it on exactly once (the
    # training processes would otherwise get it twice, from the terminal and from torchrun, and a second signal
    # means "stop at once").
    child: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if not child:
            pending.append(signum)  # arrived before the child existed: sent as soon as it does
            return
        try:
            child[0].send_signal(signum)
        except ProcessLookupError:
            pass

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        child.append(subprocess.Popen(command(flags, argv), env=env, start_new_session=True))
        for signum in pending:
            forward(signum, None)
        code = child[0].wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun, exiting with the training processes' exit code (the main process's when it failed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    quiet = "--rdzv_backend" in args and "static" in args and "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        # Several nodes: a node not there yet makes torch's C++ store log every failed connection with a stack of
        # native frames; the failure itself is reported below in the user's terms. Read once, when torch is imported.
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from surefit.training.lost_worker import lost_by_launcher, never_joined

    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]  # the training processes log as usual
    parsed = parse_args(args)
    flags = _flags_of(parsed)
    try:
        run(parsed)
    except ChildFailedError as e:
        lost = lost_by_launcher({r: f.exitcode for r, f in e.failures.items()}, flags, _output_dir(args))
        if lost is not None:
            print(lost.render(), file=sys.stderr)  # the exit code stays the processes' own, as below
        failure = e.failures.get(min(e.failures)) if e.failures else None
        code = failure.exitcode if failure is not None else 1
        return 128 - code if code < 0 else code
    except SignalException:
        # The processes were sent the signal and stopped (or were killed after the grace period): "interrupted".
        return 130
    except RuntimeError as e:  # torch's DistError kinds: the nodes did not meet
        problem = never_joined(e, flags) if flags.multi_node else None
        if problem is None:
            raise
        print(problem.render(), file=sys.stderr)
        return problem.exit_code
    return 0


def _flags_of(parsed: Any) -> LaunchFlags:
    """The launch settings torchrun was given (for messages that name nodes and the command to start again)."""
    from surefit.config.launch_flags import DEFAULT_JOIN_TIMEOUT

    def whole(value: Any, default: int) -> int:
        return int(value) if str(value).isdigit() else default

    timeout = re.search(r"(?:^|,)timeout=(\d+)", str(parsed.rdzv_conf or ""))
    nnodes = whole(parsed.nnodes, 1)
    return LaunchFlags(num_processes=whole(parsed.nproc_per_node, 1), nnodes=nnodes,
                       node_rank=whole(parsed.node_rank, 0), master_addr=parsed.master_addr if nnodes > 1 else None,
                       master_port=whole(parsed.master_port, 29500),
                       join_timeout=int(timeout.group(1)) if timeout else DEFAULT_JOIN_TIMEOUT,
                       slurm=os.environ.get("SUREFIT_SLURM") == "1")


def _output_dir(args: Sequence[str]) -> str | None:
    """The run's --output_dir: the flag, else its --config file's, else the task's default."""
    import dataclasses

    def flag(*names: str) -> str | None:
        for i, tok in enumerate(args):
            name, eq, value = tok.partition("=")
            if name in names:
                return value if eq else (args[i + 1] if i + 1 < len(args) else None)
        return None

    given = flag("--output_dir", "--output-dir")
    if given:
        return given
    values: dict = {}
    config = flag("--config")
    if config:
        try:
            from surefit.config.yaml_files import load_yaml

            values = load_yaml(config)
        except Exception:  # noqa: BLE001 - only a hint for the message; the processes reported a bad config
            values = {}
    if values.get("output_dir"):
        return str(values["output_dir"])
    from surefit.config.task_configs import TASK_CONFIGS

    cls = TASK_CONFIGS.get(str(flag("--task") or values.get("task") or "sft"))
    default = None if cls is None else next(f.default for f in dataclasses.fields(cls) if f.name == "output_dir")
    return default if isinstance(default, str) else None  # output_dir's default is a plain value, not a factory


if __name__ == "__main__":
    sys.exit(main())
