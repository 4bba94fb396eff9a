"""No output path may resolve to an input (run_folder/guard.py): every command's outputs are checked against what it
reads before anything is written, through real symlinks, ``..`` and hard links; files are written to a temporary
name and renamed, so a write that fails (a real file-size limit) leaves the previous file whole."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import qa_rows
from surefit.cli import main

REPO = Path(__file__).resolve().parents[1]


def _digest(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def setup(tiny_lm_dir, tmp_path_factory):
    """A finished run trained from its own copy of the base model (so that a failing test cannot damage others')."""
    tmp = tmp_path_factory.mktemp("guard")
    base = tmp / "base"
    shutil.copytree(tiny_lm_dir, base)
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    out = tmp / "run"
    assert main(["train", "--model", str(base), "--data", str(data), "--epochs", "1", "--batch_size", "4",
                 "--lora_r", "4", "--val_fraction", "0.25", "--max_seq_length", "96", "--max_new_tokens", "4",
                 "--output_dir", str(out)]) == 0
    return out, base, data


def _refused(capsys, argv: list[str], protected: Path) -> str:
    before = _digest(protected)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert _digest(protected) == before, f"{protected} changed"
    assert "which this command reads" in err and "pass another path for" in err
    return err


def test_predict_out_at_the_runs_own_adapter_is_refused_also_via_symlink_dotdot_and_hard_link(setup, tmp_path, capsys):
    run, _, _ = setup
    adapter = run / "final" / "adapter_model.safetensors"
    err = _refused(capsys, ["predict", "--run", str(run), "--input", "x", "--out", str(adapter)], run / "final")
    assert f"--out {adapter}" in err and "the run's final" in err
    link = tmp_path / "preds.jsonl"
    link.symlink_to(adapter)
    err = _refused(capsys, ["predict", "--run", str(run), "--input", "x", "--out", str(link)], run / "final")
    assert f"it resolves to {adapter}" in err
    dotdot = run / "checkpoints" / ".." / "final" / "adapter_config.json"
    _refused(capsys, ["predict", "--run", str(run), "--input", "x", "--out", str(dotdot)], run / "final")
    hard = tmp_path / "hard.jsonl"
    os.link(adapter, hard)
    _refused(capsys, ["predict", "--run", str(run), "--input", "x", "--out", str(hard)], run / "final")
    # A folder symlinked into checkpoints/: a new file there is inside the run's checkpoints.
    (tmp_path / "ck").symlink_to(run / "checkpoints", target_is_directory=True)
    _refused(capsys, ["predict", "--run", str(run), "--input", "x", "--out", str(tmp_path / "ck" / "new.jsonl")],
             run / "checkpoints")


def test_eval_outputs_at_the_runs_records_or_its_data_are_refused(setup, tmp_path, capsys):
    run, _, data = setup
    err = _refused(capsys, ["eval", "--run", str(run), "--predictions", str(run / "metrics.jsonl")], run)
    assert "the run's metrics.jsonl" in err
    _refused(capsys, ["eval", "--run", str(run), "--out", str(run / "config.yaml")], run)
    _refused(capsys, ["eval", "--run", str(run), "--out", str(data)], data)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(6)))
    _refused(capsys, ["eval", "--run", str(run), "--data", str(other), "--predictions", str(other)], other)
    # Beside the records is fine (docs/outputs.md writes RUN/eval.json).
    assert main(["eval", "--run", str(run), "--out", str(run / "eval.json")]) == 0
    assert json.loads((run / "eval.json").read_text())["task"] == "sft"
    (run / "eval.json").unlink()


def test_inspect_out_at_the_data_file_is_refused(setup, capsys):
    run, base, data = setup
    err = _refused(capsys, ["inspect", "--task", "sft", "--model", str(base), "--data", str(data), "--output_dir",
                            str(run.parent / "x"), "--out", str(data)], data)
    assert "--data" in err


def test_export_to_the_base_model_folder_is_refused_even_with_overwrite(setup, tmp_path, capsys):
    run, base, _ = setup
    err = _refused(capsys, ["export", "--run", str(run), "--merge", "--to", str(base), "--overwrite"], base)
    assert "--model" in err
    (tmp_path / "b").symlink_to(base, target_is_directory=True)
    _refused(capsys, ["export", "--run", str(run), "--merge", "--to", str(tmp_path / "b"), "--overwrite"], base)
    _refused(capsys, ["export", "--run", str(run), "--to", str(base / "sub")], base)
    # and any other run's final/ is protected too
    other = tmp_path / "other_run"
    shutil.copytree(run, other)
    err = _refused(capsys, ["export", "--run", str(run), "--to", str(other / "checkpoints" / ".." / "final"),
                            "--overwrite"], other / "final")
    assert f"the final/ folder of the run {other}" in err


def test_train_output_dir_inside_the_base_model_or_onto_its_data_is_refused(setup, tmp_path, capsys):
    _, base, _ = setup
    rows = "".join(json.dumps(r) + "\n" for r in qa_rows(24))
    common = ["train", "--model", str(base), "--epochs", "1", "--batch_size", "4", "--lora_r", "4"]
    data = tmp_path / "d.jsonl"
    data.write_text(rows)
    capsys.readouterr()
    assert main([*common, "--data", str(data), "--output_dir", str(base / "run")]) == 2
    assert "is inside --model" in capsys.readouterr().err
    assert not (base / "run" / "config.yaml").exists()
    # the data is named like a record of the run it would train: --overwrite would replace it
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(rows)
    assert main([*common, "--data", str(run / "metrics.jsonl"), "--output_dir", str(run), "--overwrite"]) == 2
    assert "--output_dir" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == rows


def test_a_predict_write_that_fails_leaves_the_previous_file_whole(setup, tmp_path):
    """A real file-size limit (RLIMIT_FSIZE, the error a full disk gives) cuts the write; the previous file stays."""
    run, _, _ = setup
    out = tmp_path / "preds.jsonl"
    previous = "".join(json.dumps({"prediction": f"kept {i}"}) + "\n" for i in range(40))
    out.write_text(previous)
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (20, 20)); from surefit.cli import main; "
              f"sys.exit(main(['predict', '--run', {str(run)!r}, '--input', 'one', '--input', 'two', '--out', "
              f"{str(out)!r}]))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"could not write {out}" in done.stderr and "file-size limit" in done.stderr
    assert "Traceback" not in done.stderr
    assert out.read_text() == previous  # old code opened --out with "w": emptied before the first line
    assert [p.name for p in tmp_path.iterdir()] == ["preds.jsonl"]  # no temporary file left


def test_the_guard_reads_config_settings_generically(tmp_path):
    """Every setting that names a file is an input, whatever its name (a setting added later included)."""
    from surefit.config import build_config
    from surefit.config.task_configs import SFTConfig
    from surefit.run_folder.guard import config_inputs

    tpl = tmp_path / "tpl.jinja"
    tpl.write_text("{{ messages }}")
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    cfg = build_config(SFTConfig, {"data": str(data), "chat_format": str(tpl), "output_dir": str(tmp_path / "o")},
                       None)
    named = {i.what: i.path for i in config_inputs(cfg)}
    assert named["--data"] == data and named["--chat_format"] == tpl and "--output_dir" not in named



def test_two_outputs_of_one_command_at_the_same_file_are_refused_and_dev_null_is_written_not_replaced(setup, tmp_path,
                                                                                                    capsys):
    run, _, _ = setup
    link = tmp_path / "same.json"
    link.symlink_to(tmp_path / "eval.json")
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--out", str(tmp_path / "eval.json"), "--predictions", str(link)]) == 2
    assert "are the same file" in capsys.readouterr().err
    assert main(["predict", "--run", str(run), "--input", "x", "--out", os.devnull]) == 0
    assert Path(os.devnull).is_char_device()
