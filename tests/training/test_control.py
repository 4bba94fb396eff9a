"""Evaluation every N steps (exact resume), early stopping and the best checkpoint, training without validation."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import qa_rows
from surefit.cli import main, parse_train_config
from surefit.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CRASH = Path(__file__).with_name("crash_run.py")
MODEL = str(REPO / "examples/custom/projection_model.py") + ":build"


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("control")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    return tmp, data


def test_evaluations_every_n_steps_neither_change_training_nor_break_an_exact_resume(tiny_lm_dir, lm_data, capsys):
    tmp, data = lm_data
    # 32 training rows / batch 4 = 8 steps an epoch; LoRA dropout on, so any RNG an evaluation drew would show.
    args = ["--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2", "--batch_size", "4", "--lora_r", "8",
            "--lr", "1e-2", "--val_fraction", "0.2", "--max_seq_length", "128", "--save_every", "3",
            "--lora_dropout", "0.1"]
    plain = tmp / "plain"
    assert main(["train", *args, "--output_dir", str(plain)]) == 0
    control = ["--eval_every", "2", "--early_stopping", "eval_loss:50"]
    reference = tmp / "evaluated"
    assert main(["train", *args, *control, "--output_dir", str(reference)]) == 0
    evals = [r for r in _records(reference) if r["type"] == "eval"]
    # Steps 2, 4, 6 of epoch 1 and 10, 12, 14 of epoch 2 (8 and 16 are epoch ends, evaluated as epochs).
    assert [r["step"] for r in evals] == [2, 4, 6, 10, 12, 14]
    assert all({"eval_loss", "eval_f1", "eval_em"} <= r.keys() for r in evals)
    assert (reference / "predictions" / "step_4.jsonl").is_file()
    last = lambda run: load_file(run / "checkpoints" / "epoch-2" / "model" / "adapter_model.safetensors")  # noqa: E731
    assert _max_diff(last(reference), last(plain)) <= 1e-6  # evaluating drew nothing from the training RNG

    out = tmp / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CRASH.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(CRASH), "mid-epoch", "--", *args, *control, "--output_dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    # Killed in step 5, after the evaluation of step 4: its checkpoint is the newest.
    assert (out / "checkpoints" / "step-0000004").is_dir() and not (out / "final").exists()
    capsys.readouterr()
    assert main(["train", "--resume", "--output_dir", str(out)]) == 0
    assert f"resumed from {out / 'checkpoints' / 'step-0000004'}" in capsys.readouterr().out
    assert _max_diff(last(out), last(reference)) <= 1e-6
    assert _max_diff(load_file(out / "final" / "adapter_model.safetensors"),
                     load_file(reference / "final" / "adapter_model.safetensors")) <= 1e-6
    state = lambda run: json.loads((run / "checkpoints" / "epoch-2" / "trainer_state.json").read_text())  # noqa: E731
    assert state(out)["selection"] == state(reference)["selection"]  # the patience count went on
    keep = ("type", "step", "epoch", "eval_loss", "eval_f1", "best_value", "best_step", "best_checkpoint")
    strip = lambda run: [{k: r[k] for k in keep if k in r} for r in _records(run)]  # noqa: E731
    assert strip(out) == strip(reference)


def _custom_shards(tmp):
    for name, seed in (("a", 0), ("b", 1)):
        subprocess.run([sys.executable, str(REPO / "examples/custom/make_shards.py"), "--out", str(tmp / name),
                        "--vocab", "17", "--train", "160", "--val", "40", "--shard_rows", "64", "--seed", str(seed)],
                       check=True, capture_output=True)
    return tmp / "a" / "train", tmp / "b" / "val"


def _expected_stop(values, patience):
    best, bad = None, 0
    for i, v in enumerate(values):
        if best is None or v < best:
            best, bad = v, 0
        else:
            bad += 1
        if bad >= patience:
            return i
    return None


def test_early_stopping_stops_at_the_right_evaluation_and_final_is_the_best_checkpoint(tmp_path, capsys):
    import surefit

    # Validation data from another seed's rule: as the model learns the training rule, the validation loss worsens.
    train, val = _custom_shards(tmp_path)
    out = tmp_path / "run"
    result = surefit.train(task="custom", model=MODEL, model_args='{"vocab": 17, "hidden": 32}', data=str(train),
                           val_data=str(val), epochs=3, batch_size=16, lr=3e-3, eval_every=2,
                           early_stopping="eval_loss:2", keep_checkpoints=1, output_dir=str(out))
    said = capsys.readouterr().out
    evals = [r for r in _records(out) if r["type"] in ("eval", "epoch") and r["epoch"] and "eval_loss" in r]
    stop = _expected_stop([r["eval_loss"] for r in evals], 2)
    assert stop is not None and stop < len(evals) - 0  # it did stop early ...
    assert len(evals) == stop + 1                       # ... at exactly that evaluation
    assert evals[-1]["step"] < 30  # 10 steps an epoch x 3
    best = min(evals, key=lambda r: r["eval_loss"])
    assert evals[-1]["best_step"] == best["step"] and evals[-1]["best_value"] == best["eval_loss"]
    kept = out / "checkpoints" / evals[-1]["best_checkpoint"]
    assert kept.is_dir()  # kept although --keep_checkpoints 1 and newer checkpoints were written
    assert load_file(out / "final" / "model.safetensors").keys()
    assert _max_diff(load_file(out / "final" / "model.safetensors"), load_file(kept / "model" / "model.safetensors")) == 0
    assert f"early stopping at step {evals[-1]['step']}: eval_loss has not improved for 2 evaluations" in said
    assert f"final/ is the best evaluation: eval_loss {best['eval_loss']:.4f} at step {best['step']}" in said
    assert result.history[-1]["best_checkpoint"] == kept.name


def test_default_final_is_the_last_state_said_once(tiny_lm_dir, lm_data, capsys, tmp_path):
    _, data = lm_data
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "8",
                 "--lora_r", "4", "--val_fraction", "0", "--max_seq_length", "128", "--output_dir",
                 str(tmp_path / "r")]) == 0
    said = capsys.readouterr().out
    assert said.count("final/: the last state (training runs every epoch") == 1
    assert said.count("no validation data (--val_fraction 0 and no --val_data): training without evaluation") == 1
    records = _records(tmp_path / "r")
    assert [r["epoch"] for r in records if r["type"] == "epoch"] == [1]
    assert not any(k.startswith("eval_") and k != "eval_seconds" for r in records for k in r)
    assert records[-1]["train_loss"] > 0
    for name in ("final/adapter_model.safetensors", "checkpoints/epoch-1/manifest.json", "report.html", "curves.svg"):
        assert (tmp_path / "r" / name).is_file(), name


def test_controls_that_need_an_evaluation_are_refused_without_validation_data():
    with pytest.raises(ConfigError) as e:
        parse_train_config("--data d --val_fraction 0 --eval_every 5 --keep_best eval_f1".split())
    text = e.value.render()
    assert "--eval_every: --eval_every needs an evaluation" in text and "--keep_best" in text


def test_metric_goals_take_their_direction_from_the_metric():
    from surefit.config.checks import parse_metric_goal

    assert parse_metric_goal("eval_loss:3", "--early_stopping", True)[0].mode == "min"
    assert parse_metric_goal("f1:2", "--early_stopping", True)[0].metric == "eval_f1"
    assert parse_metric_goal("eval_macro_f1", "--keep_best", False)[0].mode == "max"
    assert parse_metric_goal("accuracy", "--keep_best", False)[0].mode == "max"
    assert parse_metric_goal("eval_em:1", "--early_stopping", True)[0].mode == "max"
    goal, problems = parse_metric_goal("eval_widgets:2", "--early_stopping", True)
    assert goal is None and "add the direction: eval_widgets:2:max or eval_widgets:2:min" in problems[0].fix
    assert parse_metric_goal("eval_widgets:2:max", "--early_stopping", True)[0].mode == "max"
    assert "PATIENCE must be a whole number" in parse_metric_goal("eval_f1:x", "--early_stopping", True)[1][0].what


def test_a_metric_the_task_does_not_report_is_refused_before_step_one(tmp_path, capsys):
    import surefit

    train, val = _custom_shards(tmp_path)
    with pytest.raises(ConfigError, match=r"reports no number named 'eval_f1'(?s:.*)use one of: eval_loss"):
        surefit.train(task="custom", model=MODEL, model_args='{"vocab": 17, "hidden": 32}', data=str(train),
                      val_data=str(val), epochs=1, batch_size=16, keep_best="eval_f1", output_dir=str(tmp_path / "r"))
    assert not (tmp_path / "r" / "metrics.jsonl").read_text().count('"type": "step"')


def test_classify_keeps_the_best_macro_f1_and_trains_without_validation(tiny_bert_dir, tmp_path, capsys):
    import surefit
    from conftest import sentiment_rows, write_tsv

    train = write_tsv(tmp_path / "train.tsv", sentiment_rows(48))
    val = write_tsv(tmp_path / "val.tsv", sentiment_rows(16, template="a {filler} that was {word}"))
    out = tmp_path / "best"
    result = surefit.train(task="classify", model=str(tiny_bert_dir), data=str(train), val_data=str(val), epochs=3,
                           batch_size=8, lr=3e-3, keep_best="macro_f1", keep_checkpoints=1, output_dir=str(out))
    said = capsys.readouterr().out
    assert "final/: the best evaluation by eval_macro_f1 (higher is better)" in said
    epochs = [r for r in result.history if r["epoch"]]
    best = max(epochs, key=lambda r: r["eval_macro_f1"])  # the first of equals: a tie is no improvement
    assert epochs[-1]["best_checkpoint"] == f"epoch-{best['epoch']}"
    assert epochs[-1]["best_value"] == best["eval_macro_f1"]
    kept = out / "checkpoints" / f"epoch-{best['epoch']}" / "model"
    final = {p.name for p in (out / "final").iterdir()} - {"manifest.json"}  # final/ also lists its files' hashes
    assert final == {p.name for p in kept.iterdir()}
    weights = next(n for n in final if n.endswith(".safetensors"))
    assert _max_diff(load_file(out / "final" / weights), load_file(kept / weights)) == 0

    plain = surefit.train(task="classify", model=str(tiny_bert_dir), data=str(train), val_fraction=0, epochs=1,
                          batch_size=8, output_dir=str(tmp_path / "noval"))
    assert [r["epoch"] for r in plain.history] == [1] and "eval_accuracy" not in plain.history[0]
    assert (tmp_path / "noval" / "final").is_dir()


def test_log_samples_writes_the_same_rows_at_every_evaluation_to_files_tensorboard_and_report(tiny_lm_dir, lm_data,
                                                                                             tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, data = lm_data
    out = tmp_path / "r"
    # 32 training rows / batch 8 = 4 steps an epoch: evaluations at steps 0 (before training), 2, 4 (epoch end).
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "8",
                 "--lora_r", "4", "--val_fraction", "0.2", "--max_seq_length", "128", "--eval_every", "2",
                 "--log_samples", "2", "--report_to", "tensorboard", "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    folder = out / "predictions" / "samples"
    assert sorted(p.name for p in folder.iterdir()) == ["step_0.jsonl", "step_2.jsonl", "step_4.jsonl"]
    logged = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in folder.iterdir()}
    val = [json.loads(x) for x in (out / "predictions" / "epoch_1.jsonl").read_text().splitlines()]
    for rows in logged.values():
        assert [r["sample"] for r in rows] == [0, 1]
        assert [r["prompt"] for r in rows] == [v["input"] for v in val[:2]]  # the same rows every time
        assert [r["reference"] for r in rows] == [v["gold"] for v in val[:2]]
    assert [r["prediction"] for r in logged["step_4.jsonl"]] == [v["prediction"] for v in val[:2]]
    assert said.count("  sample 0 at step ") == 3
    acc = EventAccumulator(str(out / "tensorboard" / "surefit"))
    acc.Reload()
    tags = acc.Tags()["tensors"]
    assert {"samples/0/text_summary", "samples/1/text_summary"} <= set(tags), tags
    assert [e.step for e in acc.Tensors("samples/0/text_summary")] == [0, 2, 4]
    # The step-2 evaluation is a TensorBoard point at its step, between the epoch ones, with the same metrics.
    evals = {r["step"]: r for r in _records(out) if r["type"] == "eval"}
    assert [e.step for e in acc.Scalars("eval/f1")] == [0, 2, 4]
    assert acc.Scalars("eval/loss")[1].value == pytest.approx(evals[2]["eval_loss"], rel=1e-6)
    html = (out / "report.html").read_text()
    assert "logged samples at each evaluation (--log_samples)" in html and val[0]["input"][:20] in html


def test_log_samples_is_refused_for_custom_models():
    with pytest.raises(ConfigError, match="--log_samples needs predictions"):
        parse_train_config(["--task", "custom", "--model", "m.py:build", "--data", "d", "--log_samples", "2"])


def test_a_gpu_preset_without_a_gpu_says_so_and_leaves_checkpointing_off_unless_asked(monkeypatch):
    from surefit.config import build_config
    from surefit.config.task_configs import ClassifyConfig
    from surefit.tasks.runner import gpu_preset_without_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    said = []
    cfg = gpu_preset_without_gpu(build_config(ClassifyConfig, None, {"data": "d", "preset": "gtx1650-4gb"}), said.append)
    assert cfg.gradient_checkpointing is False and (cfg.batch_size, cfg.grad_accum, cfg.gpu_memory_gb) == (16, 4, "3.8")
    assert said == ["preset gtx1650-4gb plans for a GPU with 3.8 GB, and this machine has no CUDA GPU: the memory plan "
                    "is for that GPU's budget, and training runs on the CPU; the preset's gradient checkpointing is "
                    "left off (on a CPU it only slows training; pass --gradient_checkpointing to keep it)"]
    said.clear()
    asked = build_config(ClassifyConfig, None, {"data": "d", "preset": "gtx1650-4gb", "gradient_checkpointing": True})
    assert gpu_preset_without_gpu(asked, said.append).gradient_checkpointing is True
    assert "gradient checkpointing" not in said[0] and "no CUDA GPU" in said[0]
    plain = build_config(ClassifyConfig, None, {"data": "d", "preset": "cpu"})
    said.clear()
    assert gpu_preset_without_gpu(plain, said.append) is plain and said == []


def test_a_small_validation_split_is_warned_about_with_its_size():
    from surefit.config import SFTConfig, build_config
    from surefit.data.summary import DataSummary
    from surefit.tasks.runner import warn_small_validation

    said = []
    cfg = build_config(SFTConfig, None, {"data": "d", "keep_best": "eval_f1"})
    warn_small_validation(DataSummary(val_rows=12, encoding={"validation": {"encoded": 11}}), cfg, said.append)
    assert said == ["warning: the validation split has only 11 examples (fewer than 20): each metric moves in steps "
                    "of 1/11 and --keep_best/--early_stopping would choose on noise; give more with --val_fraction or "
                    "--val_data"]
    said.clear()
    warn_small_validation(DataSummary(val_rows=20), cfg, said.append)
    warn_small_validation(DataSummary(val_rows=0), cfg, said.append)
    assert said == []
