"""CPU thread settings that survive a shared machine.

OpenMP's default wait policy lets an idle worker thread spin for a while before it sleeps (GNU OpenMP spins up to
300,000 iterations, Intel's runtime 200 ms). On a machine where other jobs hold the cores, the spinning threads of
one training steal the time the others' compute needs, and every parallel region waits for a thread that is not
scheduled: steps become several times slower. A sleeping wait (``OMP_WAIT_POLICY=PASSIVE``, ``KMP_BLOCKTIME=0``)
costs a wake-up per region instead, a few microseconds (``benchmarks/thread_contention.py`` measures both).

These are read when torch loads its OpenMP runtime, so :func:`configure_threads` runs before torch is imported
(``surefit`` on the command line, ``surefit.train`` in Python); a value the user set is never changed.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or ``taskset``'s limit), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def configure_threads(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Choose the OpenMP wait policy and thread count where the user has not: returns what was set.

    ``OMP_WAIT_POLICY=PASSIVE`` and ``KMP_BLOCKTIME=0`` (threads sleep when idle instead of spinning), and
    ``OMP_NUM_THREADS`` = the available cores. When torch is already imported, its thread count is set too (the
    wait policy then stays what the runtime read).
    """
    import sys

    env = os.environ if environ is None else environ
    chosen: dict[str, str] = {}
    for name, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("KMP_BLOCKTIME", "0"),
                        ("OMP_NUM_THREADS", str(available_cores()))):
        if not env.get(name):
            env[name] = value
            chosen[name] = value
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in chosen and environ is None:
        torch.set_num_threads(int(chosen["OMP_NUM_THREADS"]))
    return chosen
