"""Exact resume: a run killed anywhere and resumed ends with the same weights as a run never interrupted."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import qa_rows
from surefit.cli import main

CRASH = Path(__file__).with_name("crash_run.py")


@pytest.fixture(scope="module")
def setup(tiny_lm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    # 32 training rows / batch 4 = 8 steps per epoch, 16 in all; a checkpoint every 3 steps and at epoch ends.
    # LoRA dropout is on, so the RNG state must be restored too for the weights to match.
    args = ["--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2", "--batch_size", "4", "--lora_r", "8",
            "--lr", "1e-2", "--val_fraction", "0.2", "--max_seq_length", "128", "--save_every", "3",
            "--lora_dropout", "0.1"]
    reference = tmp / "reference"
    assert main(["train", *args, "--output_dir", str(reference)]) == 0
    return tmp, args, load_file(reference / "final" / "adapter_model.safetensors"), reference


def _crash(args, out, mode):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CRASH.parents[1]), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(CRASH), mode, "--", *args, "--output_dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)


def _assert_same(final_dir, reference):
    got = load_file(final_dir / "adapter_model.safetensors")
    assert got.keys() == reference.keys()
    worst = max(float((got[k] - reference[k]).abs().max()) for k in got)
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("mode,resumes_from", [
    ("mid-epoch", "step-0000003"),         # killed in step 5: the last checkpoint is step 3
    ("after-checkpoint", "step-0000006"),  # killed right after step 6 was saved
    ("during-write", "step-0000003"),      # step 6 half-written (never renamed): back to step 3
])
def test_sigkill_then_resume_gives_the_uninterrupted_weights(setup, mode, resumes_from, capsys):
    tmp, args, reference, ref_dir = setup
    out = tmp / mode
    proc = _crash(args, out, mode)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (out / "final").exists()
    capsys.readouterr()
    assert main(["train", "--resume", "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"resumed from {out / 'checkpoints' / resumes_from}" in said
    _assert_same(out / "final", reference)
    # The resumed run's metrics are the uninterrupted run's (no duplicated or lost lines), timing aside.
    strip = lambda p: [{k: v for k, v in json.loads(x).items() if k not in ("time", "tokens_per_s", "train_tokens_per_s",  # noqa: E731
                       "time_per_epoch", "eval_seconds")} for x in (p / "metrics.jsonl").read_text().splitlines()]
    assert strip(out) == strip(ref_dir)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_finishes_the_step_saves_and_says_how_to_resume(setup, capsys, sig):
    tmp, args, reference, _ = setup
    out = tmp / sig
    proc = _crash(args, out, sig.lower())
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert f"stopped by {sig} after epoch 1, step 5 of 8" in proc.stderr
    assert f"resume with: surefit train --config {out / 'config.yaml'} --resume" in proc.stderr
    state = json.loads((out / "checkpoints" / "step-0000005" / "trainer_state.json").read_text())
    assert state["position"]["epoch"] == 1 and state["position"]["step_in_epoch"] == 5 and state["micro_step"] == 0
    assert state["plan"]["micro_batch_size"] == 4 and state["plan"]["grad_accum"] == 1
    assert main(["train", "--config", str(out / "config.yaml"), "--resume"]) == 0
    _assert_same(out / "final", reference)


def test_a_checkpoint_with_a_flipped_byte_falls_back_to_the_previous_one(setup, capsys):
    tmp, args, reference, _ = setup
    out = tmp / "flipped"
    assert _crash(args, out, "after-checkpoint").returncode == -signal.SIGKILL
    target = out / "checkpoints" / "step-0000006" / "trainable.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", "--resume", "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "step-0000006 is unusable: trainable.safetensors does not match its checksum (corrupted)" in said
    assert f"resumed from {out / 'checkpoints' / 'step-0000003'}" in said
    _assert_same(out / "final", reference)


# The full-disk checkpoint test that raised OSError by hand is replaced by real write failures (a full tmpfs, a
# file-size limit) in test_disk_full.py.


def test_resume_refuses_settings_that_change_the_run(setup, capsys):
    tmp, args, _, ref_dir = setup
    assert main(["train", "--resume", "--output_dir", str(ref_dir), "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--lr" in err and "would not continue the same run" in err


def test_retention_after_a_resume_past_a_corrupt_checkpoint_keeps_a_resumable_one(setup, capsys):
    """The newest checkpoint (step 6) is corrupt; the run resumes from step 3 with --save_every 2 --keep_checkpoints 1
    and is killed again at the start of step 6. Retention must have kept step 4 (it verifies), not the corrupt step
    6, so the next --resume continues and ends with the uninterrupted weights."""
    tmp, args, reference, _ = setup
    out = tmp / "retention"
    assert _crash(args, out, "after-checkpoint").returncode == -signal.SIGKILL
    target = out / "checkpoints" / "step-0000006" / "trainable.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    env_args = ["--resume", "--save_every", "2", "--keep_checkpoints", "1"]
    env = {**os.environ, "CRASH_AT_STEP": "3",
           "PYTHONPATH": os.pathsep.join([str(CRASH.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(CRASH), "mid-epoch", "--", "--output_dir", str(out), *env_args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000004"]
    capsys.readouterr()
    assert main(["train", "--resume", "--output_dir", str(out)]) == 0
    assert f"resumed from {out / 'checkpoints' / 'step-0000004'}" in capsys.readouterr().out
    _assert_same(out / "final", reference)


def test_a_run_started_before_sampler_versions_resumes_with_its_own_order(setup, monkeypatch, capsys):
    """A run folder of an older surefit: its checkpoints hold no sampler version and its epochs were ordered by the
    first sampler. Resumed by this surefit, it keeps that order and ends with the weights the old sampler's
    uninterrupted run gets (the new sampler's order would give other weights: the setup's reference)."""
    import surefit.training.loop as loop

    tmp, args, new_order_weights, _ = setup
    monkeypatch.setattr(loop, "SAMPLER_VERSION", 1)
    assert main(["train", *args, "--output_dir", str(tmp / "old_reference")]) == 0
    old_reference = load_file(tmp / "old_reference" / "final" / "adapter_model.safetensors")
    assert max(float((old_reference[k] - new_order_weights[k]).abs().max()) for k in old_reference) > 1e-4
    monkeypatch.undo()
    assert loop.SAMPLER_VERSION == 2

    out = tmp / "old_run"
    env = {**os.environ, "CRASH_OLD_SAMPLER": "1",
           "PYTHONPATH": os.pathsep.join([str(CRASH.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(CRASH), "mid-epoch", "--", *args, "--output_dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    state = json.loads((out / "checkpoints" / "step-0000003" / "trainer_state.json").read_text())
    assert "sampler" not in state["position"]  # as an older surefit wrote it
    capsys.readouterr()
    assert main(["train", "--resume", "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "this run started with sampler version 1" in said
    _assert_same(out / "final", old_reference)
    state = json.loads((out / "checkpoints" / "step-0000012" / "trainer_state.json").read_text())
    assert state["position"]["sampler"] == 1  # and its later checkpoints say so
