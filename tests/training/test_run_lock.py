"""One run at a time per run folder: a second run, or a --resume, while the first is alive is refused naming it; the
lock of a killed run is taken over and the takeover reported. The first run is a real second process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import qa_rows
from surefit.cli import main

CRASH = Path(__file__).with_name("crash_run.py")


@pytest.fixture(scope="module")
def args(tiny_lm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lock")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    return ["--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "4", "--lora_r", "4",
            "--val_fraction", "0.2", "--max_seq_length", "128", "--save_every", "3"]


def _start(args, out, mode):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CRASH.parents[1]), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(CRASH), mode, "--", *args, "--output_dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read()[-3000:])
        time.sleep(0.1)


def test_a_second_run_or_a_resume_is_refused_while_the_first_is_alive(args, tmp_path, capsys):
    out = tmp_path / "run"
    first = _start(args, out, "pause")
    try:
        _wait_for(out / "paused", first)  # the first run is in its 5th step, holding the folder
        pid = first.pid
        metrics_before = (out / "metrics.jsonl").read_bytes()
        capsys.readouterr()
        assert main(["train", *args, "--output_dir", str(out), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another surefit run: pid {pid} on host" in err
        assert "crash_run.py pause" in err  # the holder's command
        assert main(["train", "--resume", "--output_dir", str(out)]) == 2
        assert f"pid {pid}" in capsys.readouterr().err
        # Nothing of the first run was touched by the refused ones.
        assert (out / "metrics.jsonl").read_bytes() == metrics_before
        (out / "go").write_text("")
        stdout, stderr = first.communicate(timeout=600)
        assert first.returncode == 0, stderr[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert "took over" not in stdout
    # A clean exit empties the lock file: the next run in the folder has no holder to take over from.
    assert (out / ".surefit.lock").read_text() == ""


def test_the_lock_of_a_killed_run_is_taken_over_and_reported(args, tmp_path, capsys):
    out = tmp_path / "run"
    first = _start(args, out, "pause")
    _wait_for(out / "paused", first)
    pid = first.pid
    os.kill(pid, signal.SIGKILL)
    first.communicate(timeout=60)
    assert json.loads((out / ".surefit.lock").read_text())["pid"] == pid  # the dead run's record is still there
    capsys.readouterr()
    assert main(["train", "--resume", "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"took over the lock of {out} from a run that is no longer running (pid {pid} on host" in said
    assert f"resumed from {out / 'checkpoints' / 'step-0000003'}" in said
    assert (out / "final" / "adapter_model.safetensors").is_file()
    assert (out / ".surefit.lock").read_text() == ""  # released on a clean exit


def test_an_output_dir_that_cannot_be_created_is_named_not_a_traceback(tmp_path, capsys):
    import stat

    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        out = readonly / "run"
        if os.access(readonly, os.W_OK):  # root writes anywhere; /sys refuses even root a new folder
            if not Path("/sys").is_dir():
                pytest.skip("no folder here refuses root a new folder")
            out = Path("/sys/surefit-test-run")
        assert main(["train", "--data", str(tmp_path / "none.jsonl"), "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--output_dir: cannot create {out / '.surefit.lock'}: " in err
        assert "Traceback" not in err
    finally:
        readonly.chmod(stat.S_IRWXU)
