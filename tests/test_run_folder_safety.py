"""Run folders are data, not code: eval, predict and export run the code a run's config.yaml names only when the
command line allows it; a tampered or partial run folder gives an error naming the file; final/ is verified against
its manifest; changed training data is warned about; an export never writes into the run; --output_dir that is a
file is a configuration problem found before anything loads."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import qa_rows
from surefit.cli import main
from surefit.config import build_config
from surefit.config.task_configs import ClassifyConfig


@pytest.fixture(scope="module")
def sft_run(tiny_lm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sftrun")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    out = tmp / "run"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "4",
                 "--lora_r", "4", "--val_fraction", "0.25", "--max_seq_length", "128", "--max_new_tokens", "4",
                 "--output_dir", str(out)]) == 0
    return out


@pytest.fixture()
def run_copy(sft_run, tmp_path):
    """A copy of the finished run (and of its data) to tamper with."""
    data = tmp_path / "train.jsonl"
    shutil.copy(sft_run.parent / "train.jsonl", data)
    out = tmp_path / "run"
    shutil.copytree(sft_run, out)
    config = yaml.safe_load((out / "config.yaml").read_text())
    config["data"] = str(data)
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def _eval(run, capsys, *extra):
    capsys.readouterr()
    code = main(["eval", "--run", str(run), "--batch_size", "4", *extra])
    return code, capsys.readouterr().err


def test_final_has_a_manifest_and_a_clean_run_evaluates_without_warnings(run_copy, capsys):
    manifest = json.loads((run_copy / "final" / "manifest.json").read_text())
    assert "adapter_model.safetensors" in manifest["files"]
    code, err = _eval(run_copy, capsys)
    assert code == 0, err
    assert "warning" not in err


# ------------------------------------------------------------------------------------------------------------ code


def test_trust_remote_code_in_a_run_config_needs_the_flag_on_the_command_line(run_copy, capsys):
    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    config["trust_remote_code"] = True
    (run_copy / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for command in (["eval"], ["predict", "--input", "x"], ["export", "--to", str(run_copy.parent / "exp")]):
        capsys.readouterr()
        assert main([command[0], "--run", str(run_copy), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert f"{run_copy / 'config.yaml'} 'trust_remote_code': the run's config sets trust_remote_code: True" in err
        assert "add --trust_remote_code (or --allow_code) to this command" in err
    assert not (run_copy.parent / "exp").exists()
    code, err = _eval(run_copy, capsys, "--trust_remote_code")
    assert code == 0, err


MARKED_MODEL = '''
from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("the factory module ran")
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
    def forward(self, x, y):
        return ((self.lin(x).squeeze(-1) - y) ** 2).mean()

def build():
    return M()
'''


def test_a_custom_runs_model_factory_is_not_imported_without_allow_code(tmp_path, capsys):
    factory = tmp_path / "marked.py"
    factory.write_text(MARKED_MODEL)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    np.save(data / "x.npy", rng.normal(size=(40, 4)).astype(np.float32))
    np.save(data / "y.npy", rng.normal(size=40).astype(np.float32))
    out = tmp_path / "run"
    assert main(["train", "--task", "custom", "--model", f"{factory}:build", "--data", str(data), "--epochs", "1",
                 "--batch_size", "8", "--output_dir", str(out)]) == 0
    marker = tmp_path / "IMPORTED"
    marker.unlink()  # training imported it (asked for on its command line)
    for command in (["eval"], ["export", "--to", str(tmp_path / "exp")]):
        capsys.readouterr()
        assert main([command[0], "--run", str(out), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert f"{out / 'config.yaml'} 'model': the run's config sets model: '{factory}:build', which imports the " \
               "model factory's Python module" in err
        assert "add --allow_code to this command" in err
        assert not marker.exists()  # nothing of the run's code ran
    capsys.readouterr()
    assert main(["eval", "--run", str(out), "--allow_code"]) == 0
    assert marker.exists()


def test_a_head_in_a_run_config_is_code(tmp_path):
    from surefit.run_folder.untrusted import code_problems

    cfg = build_config(ClassifyConfig, {"data": "x.csv", "head": "heads.py:Head", "output_dir": str(tmp_path / "o")})
    problems = code_problems(cfg, tmp_path / "config.yaml", allow_code=False, trust_remote_code=False)
    assert [p.where for p in problems] == [f"{tmp_path / 'config.yaml'} 'head'"]
    assert code_problems(cfg, tmp_path / "config.yaml", allow_code=True, trust_remote_code=False) == []
    # --trust_remote_code allows remote code only, not a head
    assert len(code_problems(cfg, tmp_path / "config.yaml", allow_code=False, trust_remote_code=True)) == 1


# ------------------------------------------------------------------------------------------------------------ tampering


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tamper,where,expected", [
    (lambda r: (r / "final" / "adapter_model.safetensors").unlink(), "final/manifest.json",
     "final does not match its manifest: adapter_model.safetensors is missing"),
    (lambda r: _flip(r / "final" / "adapter_model.safetensors"), "final/manifest.json",
     "adapter_model.safetensors does not match its checksum (corrupted)"),
    (lambda r: (r / "final" / "manifest.json").write_text("[1, 2]"), "final/manifest.json",
     "manifest.json holds a list, not a mapping of files"),
    (lambda r: (r / "memory_plan.json").write_text("[1]"), "memory_plan.json",
     "(the memory plan) holds a list, not a JSON object"),
    (lambda r: (r / "memory_plan.json").write_text('{"eval_batch_size": "abc"}'), "memory_plan.json 'eval_batch_size'",
     "'eval_batch_size' is 'abc' (str); expected int"),
    (lambda r: (r / "data_report.json").write_text("{not json"), "data_report.json",
     "(what happened to the data) is not valid JSON"),
    (lambda r: (r / "data_report.json").write_text('{"encoding": "x"}'), "data_report.json 'encoding'",
     "'encoding' is 'x' (str); expected dict"),
    (lambda r: (r / "data_report.json").write_text('{"stop_ids": [2, "eos"]}'), "data_report.json 'stop_ids'",
     "'stop_ids' is [2, 'eos'] (list); expected a list of int"),
    (lambda r: (r / "data_report.json").write_text('{"version": 2}'), "data_report.json 'version'",
     "is version 2; this surefit reads version 1"),
    (lambda r: (r / "memory_plan.json").write_text('{"frozen_dtype": "fp8"}'), "memory_plan.json 'frozen_dtype'",
     "'frozen_dtype' is 'fp8' (str); expected bf16, fp16 or null"),
])
def test_a_tampered_run_folder_is_refused_naming_the_file(run_copy, capsys, tamper, where, expected):
    tamper(run_copy)
    code, err = _eval(run_copy, capsys)
    assert code == 2
    assert "Traceback" not in err
    assert f"{run_copy}/{where}" in err and expected in err


def test_a_metrics_record_with_a_string_for_a_number_is_named(run_copy, capsys):
    lines = (run_copy / "metrics.jsonl").read_text().splitlines()
    last = max(i for i, x in enumerate(lines) if json.loads(x)["type"] == "epoch")
    record = json.loads(lines[last])
    record["eval_loss"] = "low"
    lines[last] = json.dumps(record)
    (run_copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code, err = _eval(run_copy, capsys)
    assert code == 2
    assert f"{run_copy / 'metrics.jsonl'} line {last + 1}: 'eval_loss' is 'low', not a number" in err


def test_training_data_changed_after_training_is_warned_about(run_copy, capsys):
    saved = json.loads((run_copy / "data_files.json").read_text())
    assert len(saved["data"]["sha256"]) == 64
    data = Path(yaml.safe_load((run_copy / "config.yaml").read_text())["data"])
    rows = data.read_text().splitlines()
    data.write_text("\n".join(reversed(rows)) + "\n")  # same rows, another order: another validation split
    code, err = _eval(run_copy, capsys)
    assert code == 0, err
    assert f"warning: the run's training data {data} changed" in err
    assert "may not be the one training scored" in err


# ------------------------------------------------------------------------------------------------------------ export, output_dir


@pytest.mark.parametrize("inside", ["checkpoints", "final", "newdir", "predictions/x", "."])
def test_export_into_the_run_folder_is_refused(run_copy, capsys, inside):
    before = sorted(p.relative_to(run_copy) for p in run_copy.rglob("*"))
    capsys.readouterr()
    assert main(["export", "--run", str(run_copy), "--to", str(run_copy / inside), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "the run folder" in err and "pass a folder outside the run" in err
    assert sorted(p.relative_to(run_copy) for p in run_copy.rglob("*")) == before


def test_an_output_dir_that_is_a_file_is_a_configuration_problem_found_first(tmp_path, capsys):
    afile = tmp_path / "taken"
    afile.write_text("x")
    for out in (afile, afile / "run"):
        capsys.readouterr()
        assert main(["train", "--data", str(tmp_path / "none.jsonl"), "--epochs", "0", "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("configuration error (2 problems):")  # with --epochs 0, before anything loads
        assert f"--output_dir: {out} is not a folder" in err
