"""Progress of long phases: a bar or spinner that redraws in place on a terminal (a real pty), one plain line per
phase in a file, and a real run's log file with no bar characters and no glued lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from surefit.eval import progress as progress_module
from surefit.eval.progress import Progress, phase


def _read_all(fd: int) -> str:
    import select

    out = b""
    while select.select([fd], [], [], 0.3)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out.decode("utf-8", "replace")


def test_on_a_terminal_a_bar_with_the_time_left_and_a_spinner_with_the_time_spent(monkeypatch):
    monkeypatch.setattr(progress_module, "SHOW_AFTER_S", 0.0)
    monkeypatch.delenv("SUREFIT_PROGRESS", raising=False)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    master, slave = os.openpty()
    stream = os.fdopen(slave, "w")
    try:
        with Progress("generating", total=4, unit="answer", stream=stream) as bar:
            for _ in range(2):
                time.sleep(0.3)
                bar.update(1)
            time.sleep(0.5)
        drawn = _read_all(master)
        with phase("doctor").__class__("doctor", stream=stream):
            time.sleep(0.7)
        spun = _read_all(master)
    finally:
        stream.close()
        os.close(master)
    assert "\r" in drawn and re.search(r"generating:  50% \[#+\.+\] 2/4 answer \[00:0\d<00:0\d\]", drawn), drawn
    assert drawn.endswith("\r\x1b[K")  # cleared when the phase ends: the next line starts clean
    assert re.search(r"doctor: [|/\\-] 00:00 elapsed", spun), spun


def test_in_a_file_one_line_per_phase_without_bar_characters(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_module, "LINE_AFTER_S", 0.0)
    log = tmp_path / "log.txt"
    with log.open("w") as stream:
        with Progress("epoch 1/2", total=3, unit="step", stream=stream) as bar:
            for _ in range(3):
                bar.update(1, note="loss=0.5000")
            with Progress("generating", total=1, unit="answer", stream=stream) as inner:  # one batch
                inner.update(1)
        with Progress("memory plan", stream=stream):
            pass
    lines = log.read_text().splitlines()
    assert len(lines) == 3, lines
    assert re.fullmatch(r"generating: 1/1 answer in 00:00", lines[0]), lines
    assert re.fullmatch(r"epoch 1/2: 3/3 step in 00:00, loss=0\.5000", lines[1]), lines
    assert re.fullmatch(r"memory plan: in 00:00", lines[2]), lines
    assert "\r" not in log.read_text() and "#" not in log.read_text()


def test_short_phases_write_nothing_to_a_file(tmp_path):
    log = tmp_path / "log.txt"
    with log.open("w") as stream, Progress("tokenizer", stream=stream):
        pass
    assert log.read_text() == ""


@pytest.mark.slow
def test_a_run_logged_to_a_file_has_no_bar_and_its_epoch_counts_agree(tmp_path, tiny_lm_dir, qa_jsonl):
    """nohup-style: stdout and stderr into one file. --max_steps 4 runs 1 epoch: the bar's line and the evaluation's
    both say so; every evaluation line starts a line of its own."""
    log = tmp_path / "train.log"
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "SUREFIT_PROGRESS": "plain"}
    env.pop("TQDM_DISABLE", None)
    with log.open("w") as fh:
        code = subprocess.call([sys.executable, "-m", "surefit", "train", "--model", str(tiny_lm_dir), "--data",
                                str(qa_jsonl), "--epochs", "2", "--max_steps", "4", "--batch_size", "2",
                                "--max_seq_length", "128", "--output_dir", str(tmp_path / "run")],
                               stdout=fh, stderr=subprocess.STDOUT, env=env)
    text = log.read_text()
    assert code == 0, text
    assert "\r" not in text and "█" not in text, text
    evals = [line for line in text.splitlines() if "eval_loss=" in line]
    assert evals and all(re.match(r"epoch \d/1  eval_", line) for line in evals), evals
    epochs = [json.loads(x)["epoch"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(x).get("type") == "epoch"]
    assert epochs == [0, 1]
