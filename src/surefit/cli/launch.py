"""``surefit train --num_processes N``: surefit starts the N processes itself, through torchrun.

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

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from surefit.errors import ConfigError, Problem

FLAGS = ("--num_processes", "--num-processes")


def split_num_processes(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """``(N, the other arguments)`` from ``surefit train`` arguments; ``N`` is ``None`` when the flag is absent.

    Raises:
        ConfigError: the value is missing, not a whole number, or below 1.
    """
    rest: list[str] = []
    raw: str | None = None
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, value = tok.partition("=")
        if name in FLAGS:
            if eq:
                raw = value
            elif i + 1 < len(argv):
                raw = argv[i + 1]
                i += 1
            else:
                raw = ""
        else:
            rest.append(tok)
        i += 1
    if raw is None:
        return None, rest
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(Problem(f"expected a whole number of processes >= 1, got {raw!r}", "--num_processes",
                                  "e.g. --num_processes 2 (one per GPU; on a CPU, at most the number of cores)"))
    return n, rest


def command(n: int, argv: Sequence[str]) -> list[str]:
    """The child's command line for ``n`` processes running ``surefit <argv>``."""
    return [sys.executable, "-m", "surefit.cli.launch", "--standalone", "--nproc_per_node", str(n), "-m", "surefit",
            *argv]


def launch(n: int, argv: Sequence[str]) -> int:
    """Run ``surefit <argv>`` as ``n`` processes and return their exit code (0 when every one succeeded)."""
    env = dict(os.environ)
    # torchrun sets 1 thread per process when this is unset (and says so); share the cores out instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
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
        child.append(subprocess.Popen(command(n, argv), env=env, start_new_session=True))
        for signum in pending:
            forward(signum, None)
        code = child[0].wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun, exiting with the training processes' exit code (the main process's when it failed)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = list(sys.argv[1:] if argv is None else argv)
    parsed = parse_args(args)
    try:
        run(parsed)
    except ChildFailedError as e:
        from surefit.training.lost_worker import lost_by_launcher

        processes = int(parsed.nproc_per_node) if str(parsed.nproc_per_node).isdigit() else len(e.failures)
        lost = lost_by_launcher({r: f.exitcode for r, f in e.failures.items()}, processes, _output_dir(args))
        if lost is not None:
            print(lost.render(), file=sys.stderr)  # the exit code stays the processes' own, as below
        failure = e.failures.get(0) or e.get_first_failure()[1]
        code = failure.exitcode
        return 128 - code if code < 0 else code
    except SignalException:
        # The processes were sent the signal and stopped (or were killed after the grace period): "interrupted".
        return 130
    return 0


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
