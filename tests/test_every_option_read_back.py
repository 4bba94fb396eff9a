"""Every record surefit writes is read back by surefit in every combination of options: tiny runs trained with each
training-control option (and combinations), then ``eval``, ``predict``, ``export`` (plain and ``--merge``),
``report`` and ``inspect`` (from the run's own config.yaml) on each result."""

import json
from pathlib import Path

import pytest

from conftest import qa_rows, sentiment_rows, write_tsv
from surefit.cli import main

# Each training-control option at least once, and the ones that write extra records together.
SFT_OPTIONS = {
    "keep_best": ["--epochs", "2", "--keep_best", "eval_loss"],
    "early_stopping": ["--epochs", "3", "--early_stopping", "eval_loss:1"],
    "steps": ["--max_steps", "5", "--eval_every", "2", "--save_every", "2", "--keep_checkpoints", "1",
              "--warmup", "2", "--lr_scheduler", "wsd", "--min_lr", "1e-4"],
    "combined": ["--epochs", "2", "--eval_every", "3", "--save_every", "3", "--keep_checkpoints", "1",
                 "--keep_best", "eval_f1", "--log_samples", "2", "--log_every", "1"],
    # The caches' folder, with a keep-best run: eval/predict/export read the run's saved settings, inspect the store.
    "cache_dir": ["--epochs", "2", "--keep_best", "eval_loss", "--cache_dir", "{tmp}/my cache"],
    "pad_to_multiple_of": ["--epochs", "2", "--keep_best", "eval_f1", "--pad_to_multiple_of", "32"],
    # evaluation's generation switches, saved with the run and used again by eval and predict
    "eval_generation": ["--epochs", "2", "--keep_best", "eval_f1", "--eval_pack_lora", "true",
                        "--eval_share_prefixes", "true", "--prompt_lookup_num_tokens", "3"],
    # the evaluation's loss in a pass of its own (the default computes it in the prompts' forward), with early stopping
    # on the loss it writes
    "eval_two_passes": ["--epochs", "3", "--early_stopping", "eval_loss:1", "--eval_loss_in_prefill", "false"],
}
CLS_OPTIONS = {
    "early_stopping_steps": ["--epochs", "2", "--early_stopping", "eval_macro_f1:2", "--eval_every", "3",
                             "--save_every", "3", "--keep_checkpoints", "1"],
    "keep_best_max_steps": ["--max_steps", "6", "--keep_best", "eval_accuracy", "--log_samples", "2"],
}


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _read_back(run: Path, tmp: Path, capsys, predict_args: list[str], merge: bool, allow: list[str]) -> None:
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--json", *allow]) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    epochs = [r for r in _records(run) if r.get("type") == "epoch"]
    assert result["training"]["epoch"] == epochs[-1]["epoch"] and result["rows"] > 0
    assert main(["predict", "--run", str(run), *predict_args, "--out", str(tmp / "p.jsonl"), *allow]) == 0, \
        capsys.readouterr().err
    assert len((tmp / "p.jsonl").read_text().splitlines()) == 2
    assert main(["export", "--run", str(run), "--to", str(tmp / "export"), *allow]) == 0, capsys.readouterr().err
    assert (tmp / "export" / "manifest.json").is_file() or any((tmp / "export").iterdir())
    if merge:
        assert main(["export", "--run", str(run), "--merge", "--to", str(tmp / "merged"), *allow]) == 0, \
            capsys.readouterr().err
        assert (tmp / "merged" / "config.json").is_file()
    assert main(["report", "--run", str(run)]) == 0, capsys.readouterr().err
    assert (run / "report.html").stat().st_size > 0


@pytest.mark.parametrize("name", sorted(SFT_OPTIONS))
def test_an_sft_run_with_each_training_control_option_is_read_back(name, tiny_lm_dir, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--lora_r", "4", "--batch_size", "4",
                 "--lr", "1e-2", "--val_fraction", "0.25", "--max_seq_length", "96", "--max_new_tokens", "4",
                 "--output_dir", str(run), *[a.format(tmp=tmp_path) for a in SFT_OPTIONS[name]]]) == 0, \
        capsys.readouterr().err
    if "--keep_best" in SFT_OPTIONS[name] or "--early_stopping" in SFT_OPTIONS[name]:
        assert any("best_metric" in r for r in _records(run))  # the records that once made the run unreadable
    _read_back(run, tmp_path, capsys, ["--input", "what is one", "--input", "what is two"], merge=True, allow=[])
    # inspect reads the run's own config.yaml back (every option it saved)
    capsys.readouterr()
    assert main(["inspect", "--task", "sft", "--config", str(run / "config.yaml"), "--output_dir",
                 str(tmp_path / "unused"), "--out", str(tmp_path / "inspect.jsonl")]) == 0, capsys.readouterr().err
    assert len((tmp_path / "inspect.jsonl").read_text().splitlines()) == 24
    if name == "cache_dir":  # the store went to --cache_dir, and inspect (from config.yaml) read it there
        stores = list((tmp_path / "my cache" / "startup" / "encoded").glob("*/*/header.json"))
        assert len(stores) == 1 and f"read from the cache {stores[0].parent}" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(CLS_OPTIONS))
def test_a_classify_run_with_training_control_options_is_read_back(name, tiny_bert_dir, tmp_path, capsys):
    train = write_tsv(tmp_path / "train.tsv", sentiment_rows(48))
    run = tmp_path / "run"
    assert main(["train", "--task", "classify", "--model", str(tiny_bert_dir), "--data", str(train),
                 "--val_fraction", "0.25", "--batch_size", "8", "--lr", "3e-3", "--output_dir", str(run),
                 *CLS_OPTIONS[name]]) == 0, capsys.readouterr().err
    assert any("best_metric" in r for r in _records(run))
    _read_back(run, tmp_path, capsys, ["--input", "the movie was very good", "--input", "the plot was very bad"],
               merge=False, allow=[])


def test_a_custom_run_with_keep_best_and_step_options_is_read_back(tmp_path, capsys):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(repo / "examples/custom/make_shards.py"), "--out", str(tmp_path / "d"),
                    "--vocab", "11", "--train", "48", "--val", "16", "--shard_rows", "16"], check=True,
                   capture_output=True)
    run = tmp_path / "run"
    assert main(["train", "--task", "custom", "--model", str(repo / "examples/custom/projection_model.py") + ":build",
                 "--model_args", '{"vocab": 11, "hidden": 16}', "--data", str(tmp_path / "d/train"), "--epochs", "2",
                 "--batch_size", "16", "--keep_best", "eval_loss", "--eval_every", "2", "--save_every", "2",
                 "--keep_checkpoints", "1", "--output_dir", str(run)]) == 0, capsys.readouterr().err
    assert any("best_metric" in r for r in _records(run))
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--json", "--allow_code"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["metrics"]["eval_loss"] > 0
    assert main(["export", "--run", str(run), "--to", str(tmp_path / "export"), "--allow_code"]) == 0
    assert main(["report", "--run", str(run)]) == 0 and (run / "report.html").is_file()
