"""``surefit train`` in which one process dies by SIGKILL after the first checkpoint; run by test_lost_worker.py.

    python -m surefit.cli.launch --standalone --nproc_per_node 2 lose_worker.py RANK surefit-train-args...

Once the first checkpoint is written and every process has passed the barrier after it, the process of rank RANK sends itself
SIGKILL: a real lost worker (out of memory, a node going away), at a point the test chooses. The others go on into
the next step's collectives and find their peer gone. With ``SLOW_REPORT_S`` set, the launcher's SIGTERM reaches the
survivors while they write their report (as it did under load).
"""

import os
import signal
import sys

import surefit.training.loop as loop
from surefit.cli import main

victim, argv = int(sys.argv[1]), sys.argv[2:]
original_save = loop._Fit._save


def save(self, *a, **k):
    folder = original_save(self, *a, **k)  # written, verified and waited for by every process
    if int(os.environ.get("RANK", "0")) == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return folder


loop._Fit._save = save

delay = float(os.environ.get("SLOW_REPORT_S", "0"))
if delay:  # the survivors take this long to verify the checkpoint they name: the launcher's SIGTERM comes first
    import time

    import surefit.training.lost_worker as lost_worker

    original_recovery = lost_worker._recovery

    def slow_recovery(*a, **k):
        time.sleep(delay)
        return original_recovery(*a, **k)

    lost_worker._recovery = slow_recovery
sys.exit(main(["train", *argv]))
