"""``surefit train`` that stops still after its first checkpoint; run by test_fsdp.py under torchrun.

    python -m surefit.cli.launch --standalone --nproc_per_node N fsdp_pause.py surefit-train-args...

The main process, once the first checkpoint is written and verified (at its retention pass), writes
OUTPUT/paused and waits; the other processes wait for it at the next barrier. The test then kills the whole process
tree with SIGKILL: a run that dies for real right after a checkpoint, at a point the test chooses.
"""

import sys
import time
from pathlib import Path

import surefit.training.checkpoint as ck
from surefit.cli import main

argv = sys.argv[1:]
out = Path(argv[argv.index("--output_dir") + 1])
original_prune = ck.prune


def prune(*a, **k):
    original_prune(*a, **k)
    (out / "paused").write_text("paused", encoding="utf-8")
    while True:
        time.sleep(0.2)


ck.prune = prune
sys.exit(main(["train", *argv]))
