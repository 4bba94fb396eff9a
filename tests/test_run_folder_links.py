"""The run folder's own files are never written, emptied or deleted through a symbolic link (run_folder/links.py):
real symlinks planted at the lock, the metrics log and the records; a symlinked checkpoints/ is storage."""

import json
import os

import pytest

from conftest import qa_rows
from surefit.cli import main


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(16)), encoding="utf-8")
    return path


def _train(tiny_lm_dir, data, out, *extra):
    return main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "4",
                 "--lora_r", "4", "--val_fraction", "0.25", "--max_seq_length", "96", "--max_new_tokens", "4",
                 "--output_dir", str(out), *extra])


def test_a_lock_file_that_is_a_symlink_never_gets_its_target_emptied(tiny_lm_dir, data, tmp_path, capsys):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".surefit.lock").symlink_to(precious)
    capsys.readouterr()
    assert _train(tiny_lm_dir, data, out) == 2
    err = capsys.readouterr().err
    assert f"{out / '.surefit.lock'} (the run's lock file) is a symbolic link to {precious}" in err
    assert f"rm {out / '.surefit.lock'}" in err
    assert precious.read_text() == "keep me\n"
    assert not (out / "config.yaml").exists()


def test_a_metrics_log_that_is_a_symlink_is_refused_not_appended_to(tmp_path):
    from surefit.errors import SurefitError
    from surefit.training.trackers import MetricsLog

    precious = tmp_path / "precious.jsonl"
    precious.write_text("{}\n")
    (tmp_path / "metrics.jsonl").symlink_to(precious)
    with pytest.raises(SurefitError, match="is a symbolic link to"):
        MetricsLog(tmp_path / "metrics.jsonl")
    assert precious.read_text() == "{}\n"


def test_a_symlinked_checkpoints_folder_is_storage_and_overwrite_never_deletes_through_a_link(
        tiny_lm_dir, data, tmp_path, capsys):
    disk = tmp_path / "bigdisk" / "ck"
    disk.mkdir(parents=True)
    (disk / "NOTES.txt").write_text("not surefit's\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").symlink_to(disk, target_is_directory=True)
    assert _train(tiny_lm_dir, data, out) == 0, capsys.readouterr().err  # was refused: "already holds a run"
    assert (out / "checkpoints").is_symlink() and (disk / "epoch-1" / "manifest.json").is_file()
    assert main(["eval", "--run", str(out)]) == 0

    # --overwrite: a record symlinked elsewhere is removed as a link; the checkpoint storage stays a link, and only
    # the previous run's checkpoints are removed from it.
    precious = tmp_path / "precious.json"
    precious.write_text('{"mine": 1}')
    (out / "data_report.json").unlink()
    (out / "data_report.json").symlink_to(precious)
    capsys.readouterr()
    assert _train(tiny_lm_dir, data, out, "--overwrite") == 0, capsys.readouterr().err
    said = capsys.readouterr()
    err = said.out + said.err
    assert "removed the previous run's checkpoints epoch-1" in err and "kept as the run's checkpoint storage" in err
    assert precious.read_text() == '{"mine": 1}'
    assert not (out / "data_report.json").is_symlink() and "encoding" in json.loads((out / "data_report.json").read_text())
    assert (out / "checkpoints").is_symlink() and os.path.realpath(out / "checkpoints") == str(disk)
    assert (disk / "NOTES.txt").read_text() == "not surefit's\n" and (disk / "epoch-1" / "manifest.json").is_file()


def test_a_planted_predictions_link_is_replaced_not_written_through(tmp_path):
    from surefit.run_folder import write_jsonl

    precious = tmp_path / "precious.jsonl"
    precious.write_text("mine\n")
    (tmp_path / "predictions").mkdir()
    (tmp_path / "predictions" / "epoch_1.jsonl").symlink_to(precious)
    write_jsonl(tmp_path / "predictions" / "epoch_1.jsonl", [{"a": 1}])
    assert precious.read_text() == "mine\n"
    assert json.loads((tmp_path / "predictions" / "epoch_1.jsonl").read_text()) == {"a": 1}
