"""A non-finite loss stops the run at that step (nothing non-finite is applied or saved, the last good checkpoint
stays) and names the step, the rows and the likely cause; --on_nonfinite skip_step skips such steps, counted.
Non-finite settings are configuration errors, reported before anything is set up."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from conftest import qa_rows
from surefit.cli import main

LOG_MODEL = '''
import torch
from torch import nn

class M(nn.Module):
    """Regresses y from log(x): a row with x <= 0 gives a NaN loss on its own."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
    def forward(self, x, y):
        return ((self.lin(torch.log(x)).squeeze(-1) - y) ** 2).mean()

def build():
    return M()
'''


def _tensors(folder: Path, n: int, bad_row: int | None) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 2.0, size=(n, 4)).astype(np.float32)
    if bad_row is not None:
        x[bad_row, 0] = -1.0  # finite (the data checks pass), but log(-1) is NaN
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", rng.normal(size=n).astype(np.float32))
    return folder


@pytest.fixture()
def log_setup(tmp_path):
    model = tmp_path / "logmodel.py"
    model.write_text(LOG_MODEL)
    train = _tensors(tmp_path / "train", 32, bad_row=13)
    val = _tensors(tmp_path / "val", 8, bad_row=None)
    return ["--task", "custom", "--model", f"{model}:build", "--data", str(train), "--val_data", str(val),
            "--epochs", "2", "--batch_size", "4", "--lr", "1e-2", "--save_every", "1"]


def test_a_nan_loss_stops_at_that_step_naming_the_row_and_keeps_the_last_good_checkpoint(log_setup, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *log_setup, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "non-finite loss" in err
    assert "the loss is nan" in err and f"rows with a non-finite loss: {tmp_path / 'train'} row 13." in err
    assert "log of a non-positive value in a custom forward" in err
    assert not (out / "final").exists()
    step = int(err.split("  1. step ")[1].split(" ")[0])  # "1. step N (epoch 1, step N of 8): ..."
    checkpoints = sorted((out / "checkpoints").iterdir())
    # Every step before the bad one was saved (--save_every 1), the bad one was not, and the message names the last.
    assert [p.name for p in checkpoints] == [f"step-{s:07d}" for s in range(1, step)]
    if checkpoints:
        assert f"the last good checkpoint {checkpoints[-1]} is kept" in err
        weights = load_file(checkpoints[-1] / "trainable.safetensors")
        assert all(bool(t.isfinite().all()) for t in weights.values())


def test_skip_step_skips_and_counts_each_nonfinite_step(log_setup, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *log_setup, "--output_dir", str(out), "--on_nonfinite", "skip_step"]) == 0
    said = capsys.readouterr().out
    assert said.count("--on_nonfinite skip_step: skipped step") == 2  # the bad row is met once per epoch
    epochs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in epochs if r["type"] == "epoch" and r["epoch"] > 0]
    assert [r["nonfinite_skipped"] for r in epochs] == [1, 2]
    assert all(np.isfinite(r["train_loss"]) for r in epochs)
    weights = load_file(out / "final" / "model.safetensors")
    assert all(bool(t.isfinite().all()) for t in weights.values())


@pytest.mark.parametrize("lr,expected,saved", [
    # finite but huge weights after step 1: step 2's loss is NaN; step 1's checkpoint is the last good one
    ("1e30", "step 2 (epoch 1, step 2 of 8): the loss is nan", ["step-0000001"]),
    # step 1's update itself overflows: found before its checkpoint is written, so nothing is saved
    ("1e39", "step 1 (epoch 1): the update of step 1 made the weights non-finite", []),
])
def test_a_learning_rate_that_blows_up_the_weights_stops_without_saving_them(tiny_lm_dir, tmp_path, capsys, lr,
                                                                             expected, saved):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "4",
                 "--lora_r", "4", "--lr", lr, "--max_grad_norm", "0", "--val_fraction", "0.2",
                 "--max_seq_length", "128", "--save_every", "1", "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert f"the learning rate is far too high (--lr {float(lr):g})" in err
    assert not (out / "final").exists()
    assert sorted(p.name for p in (out / "checkpoints").glob("*")) == saved
    for name in saved:
        weights = load_file(out / "checkpoints" / name / "trainable.safetensors")
        assert all(bool(t.isfinite().all()) for t in weights.values())


@pytest.mark.parametrize("flag,value", [("--lr", "nan"), ("--lr", "inf"), ("--weight_decay", "nan"),
                                        ("--max_grad_norm", "nan")])
def test_nonfinite_settings_are_configuration_errors_before_anything_is_set_up(tmp_path, capsys, flag, value):
    out = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "missing.jsonl"), flag, value, "--epochs", "0",
                 "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("configuration error (2 problems):")  # collected with the others (--epochs 0)
    assert f"{flag}: must be a finite number (got {value})" in err
    assert not out.exists()
