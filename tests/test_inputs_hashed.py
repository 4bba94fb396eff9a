"""Everything a run depends on is hashed by content at the start (data_files.json) and checked where it is used:
--resume refuses changed data unless --allow_changed_data (then counted and recorded); eval, predict and export name
a base model whose files changed since training. Real files are changed on disk."""

import json
import shutil

import pytest

from conftest import qa_rows
from surefit.cli import main


@pytest.fixture()
def run(tiny_lm_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_lm_dir, base)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(16)), encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--model", str(base), "--data", str(data), "--epochs", "1", "--batch_size", "4",
                 "--lora_r", "4", "--val_fraction", "0.25", "--max_seq_length", "96", "--max_new_tokens", "4",
                 "--output_dir", str(out)]) == 0
    return out, base, data


def test_the_base_models_files_are_hashed_and_a_changed_base_is_named_before_use(run, capsys):
    out, base, _ = run
    saved = json.loads((out / "data_files.json").read_text())
    assert saved["model"]["path"] == str(base)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(saved["model"]["files"])
    weights = base / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-4:] = bytes(b ^ 1 for b in raw[-4:])  # same size, other weights
    weights.write_bytes(bytes(raw))
    for argv in (["eval"], ["predict", "--input", "x"], ["export", "--to", str(out.parent / "exp")]):
        capsys.readouterr()
        assert main([argv[0], "--run", str(out), *argv[1:]]) == 0
        err = capsys.readouterr().err
        assert f"warning: the run's model {base} changed (model.safetensors) since training" in err, argv[0]


def test_resume_refuses_changed_data_unless_allowed_then_records_it(run, capsys):
    out, _, data = run
    with data.open("a") as fh:
        fh.write(json.dumps({"input": "what is new", "target": "new"}) + "\n")
    capsys.readouterr()
    assert main(["train", "--config", str(out / "config.yaml"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--data {data} changed" in err and "--allow_changed_data" in err
    assert "resumed_with_changes" not in json.loads((out / "data_files.json").read_text())
    assert main(["train", "--config", str(out / "config.yaml"), "--resume", "--allow_changed_data"]) == 0
    said = capsys.readouterr()
    assert f"--allow_changed_data: resuming although --data {data} changed" in said.out + said.err
    changes = json.loads((out / "data_files.json").read_text())["resumed_with_changes"]
    assert len(changes) == 1 and list(changes[0]["changed"]) == ["data"]
