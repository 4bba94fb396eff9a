"""Learning-rate schedules (each shape's formula), --max_steps, and the schedule in the report."""

import json
import math

import pytest
import torch

from conftest import qa_rows
from surefit.cli import main
from surefit.training.schedule import Warmup, lr_factor, make_scheduler, plan_schedule


def _lrs(schedule, n):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=schedule.lr)
    sched = make_scheduler(opt, schedule)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind,expected", [
    # 20 steps, warmup 4, lr 1.0, min_lr 0.1: the value at steps 0, 2, 4, 12, 19.
    ("cosine", [0.0, 0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 16)),
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16))]),
    ("linear", [0.0, 0.5, 1.0, 0.1 + 0.9 * (1 - 8 / 16), 0.1 + 0.9 * (1 - 15 / 16)]),
    ("constant", [0.0, 0.5, 1.0, 1.0, 1.0]),
    # wsd: flat until the last 2 steps (10 % of 20), then linear to min_lr: step 19 is half way.
    ("wsd", [0.0, 0.5, 1.0, 1.0, 0.1 + 0.9 * 1 / 2]),
])
def test_each_scheduler_follows_its_formula(kind, expected):
    schedule = plan_schedule(n_examples=40, batch_size=4, epochs=2, lr=1.0, kind=kind, warmup=Warmup(4), min_lr=0.1)
    assert (schedule.total_steps, schedule.warmup_steps) == (20, 4)
    lrs = _lrs(schedule, 20)
    assert [lrs[i] for i in (0, 2, 4, 12, 19)] == pytest.approx(expected)


def test_cosine_without_min_lr_is_transformers_cosine_step_for_step():
    from transformers import get_cosine_schedule_with_warmup

    schedule = plan_schedule(n_examples=30, batch_size=4, epochs=3, lr=2e-4, warmup=Warmup(ratio=0.1))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-4)
    ref = get_cosine_schedule_with_warmup(opt, int(0.1 * 24), 24)
    theirs = []
    for _ in range(24):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert _lrs(schedule, 24) == pytest.approx(theirs, abs=1e-12)


def test_warmup_is_steps_from_one_and_a_ratio_below_one():
    assert plan_schedule(n_examples=80, batch_size=4, epochs=1, lr=1.0, warmup=Warmup(5)).warmup_steps == 5
    assert plan_schedule(n_examples=80, batch_size=4, epochs=1, lr=1.0, warmup=Warmup(0.25)).warmup_steps == 5
    assert plan_schedule(n_examples=80, batch_size=4, epochs=1, lr=1.0, warmup=Warmup(ratio=0.5)).warmup_steps == 10


def test_max_steps_overrides_epochs_and_says_how_many_epochs():
    s = plan_schedule(n_examples=32, batch_size=4, epochs=3, lr=1.0, max_steps=11)
    assert (s.total_steps, s.epochs, s.steps_per_epoch) == (11, 2, 8)
    assert "--max_steps 11 = 1.38 epochs of 8 steps" in s.describe()
    more = plan_schedule(n_examples=32, batch_size=4, epochs=1, lr=1.0, max_steps=20)
    assert (more.total_steps, more.epochs) == (20, 3)
    assert lr_factor(19, "linear", 0, 20) == pytest.approx(1 / 20)


def test_max_steps_mid_epoch_runs_that_many_steps_with_the_schedule_built_for_them(tiny_lm_dir, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    out = tmp_path / "run"
    # 32 training rows / batch 4 = 8 steps an epoch; 11 steps end epoch 2 at its 3rd step.
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "3", "--batch_size", "4",
                 "--lora_r", "4", "--lr", "1e-2", "--val_fraction", "0.2", "--max_seq_length", "128", "--log_every",
                 "1", "--max_steps", "11", "--lr_scheduler", "linear", "--warmup", "2", "--min_lr", "1e-3",
                 "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "--max_steps 11 = 1.38 epochs of 8 steps (overrides --epochs)" in said
    assert "schedule: linear, warmup 2 of 11 optimizer steps, lr 0.01 to 0.001" in said
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 12))
    assert [(r["epoch"], r.get("step")) for r in records if r["type"] == "epoch"] == [(0, None), (1, 8), (2, 11)]
    # The rate set after the last step is min_lr: the linear decay reached its end exactly at step 11.
    assert steps[-1]["lr"] == pytest.approx(1e-3)
    assert steps[1]["lr"] == pytest.approx(1e-2)  # warmup over: after step 2
    assert json.loads((out / "schedule.json").read_text())["total_steps"] == 11
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_schedule_settings_are_checked_with_their_flags():
    from surefit.cli import parse_train_config
    from surefit.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        parse_train_config("--data d --warmup 2.5 --min_lr 1 --lr 1e-3 --max_steps 0 --lr_scheduler step".split())
    text = e.value.render()
    assert "--warmup: must be a whole number of steps (>= 1) or a ratio in [0, 1) (got 2.5)" in text
    assert "--min_lr: must be >= 0 and below --lr 0.001 (got 1.0)" in text
    assert "--max_steps: must be >= 1 (got 0)" in text
    assert "--lr_scheduler: expected one of cosine, linear, constant, wsd; got 'step'" in text
