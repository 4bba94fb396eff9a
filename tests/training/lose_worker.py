"""``surefit train`` in which one process dies by SIGKILL after the first checkpoint; run by test_lost_worker.py.

    python -m surefit.cli.launch --standalone --nproc_per_node 2 lose_worker.py RANK surefit-train-args...

Once the first checkpoint is written and every process has passed the barrier after it, the process of rank RANK sends itself
SIGKILL: a real lost worker (out of memory, a node going away), at a point the test chooses. The others go on into
the next step's collectives and find their peer gone.
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
sys.exit(main(["train", *argv]))
