"""Run `surefit train` and crash it on purpose at one point; used by test_resume.py in a subprocess.

    python crash_run.py MODE -- surefit-train-args...

MODE: mid-epoch (SIGKILL at the start of the 5th optimizer step), after-checkpoint (SIGKILL right after the 2nd
checkpoint is written), during-write (SIGKILL while the checkpoint of step 6 is written, before it is renamed into
place), sigint / sigterm (that signal at the start of the 5th step: the run must finish the step, save and exit),
pause (at the start of the 5th step, write OUTPUT/paused and wait until OUTPUT/go exists, then go on: a run that is
alive and holding its folder, for the lock tests).
"""

import os
import signal
import sys

import surefit.training.checkpoint as ck
import surefit.training.loop as loop
from surefit.cli import main

mode = sys.argv[1]
if os.environ.get("CRASH_OLD_SAMPLER"):
    # A run started by a surefit before sampler versions: the first sampler, and checkpoints that do not name it.
    import dataclasses

    loop.SAMPLER_VERSION = 1
    loop.asdict = lambda obj: {k: v for k, v in dataclasses.asdict(obj).items() if k != "sampler"}
# mid-epoch: the optimizer step (counted in this process) at whose start to die; 5 unless CRASH_AT_STEP says otherwise
at_step = int(os.environ.get("CRASH_AT_STEP", "5"))
argv = sys.argv[sys.argv.index("--") + 1 :]
calls = {"n": 0}


def kill(sig=signal.SIGKILL):
    os.kill(os.getpid(), sig)


if mode in ("mid-epoch", "sigint", "sigterm"):
    original_step = loop.accumulate_step

    def step(*a, **k):
        calls["n"] += 1
        if calls["n"] == at_step:
            kill({"mid-epoch": signal.SIGKILL, "sigint": signal.SIGINT, "sigterm": signal.SIGTERM}[mode])
        return original_step(*a, **k)

    loop.accumulate_step = step
elif mode == "pause":
    import time
    from pathlib import Path

    out = Path(argv[argv.index("--output_dir") + 1])
    original_step = loop.accumulate_step

    def step(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            (out / "paused").write_text(str(os.getpid()))
            while not (out / "go").exists():
                time.sleep(0.1)
        return original_step(*a, **k)

    loop.accumulate_step = step
elif mode == "after-checkpoint":
    original_prune = ck.prune

    def prune(*a, **k):
        original_prune(*a, **k)
        calls["n"] += 1
        if calls["n"] == 2:
            kill()

    ck.prune = prune
elif mode == "during-write":
    original_save = ck.save_checkpoint

    def save(folder, **k):
        if str(folder).endswith("step-0000006"):
            k["before_commit"] = lambda tmp: kill()
        return original_save(folder, **k)

    ck.save_checkpoint = save

sys.exit(main(["train", *argv]))
