"""A run folder is data, every key of it (run_folder/code_gate.py): one table of the settings that can name code, one
gate for all of them, and a walk over the config dataclasses so that a setting added later cannot skip it."""

import dataclasses
import json
import shutil

import pytest
import yaml

from conftest import qa_rows
from surefit.cli import main
from surefit.config import field_kind
from surefit.config.task_configs import TASK_CONFIGS
from surefit.run_folder.code_gate import DATA_SETTINGS, NAMES_CODE, code_problems


def test_every_text_or_switch_setting_of_every_task_is_classified_as_code_or_data():
    unclassified, both = [], set(NAMES_CODE) & DATA_SETTINGS
    for task, cls in TASK_CONFIGS.items():
        for f in dataclasses.fields(cls):
            base, _, choices = field_kind(f.type)
            if choices is None and base in (str, bool) and f.name not in NAMES_CODE and f.name not in DATA_SETTINGS:
                unclassified.append(f"{task}.{f.name}")
    assert not unclassified, ("settings that may name code, in neither NAMES_CODE nor DATA_SETTINGS of "
                              f"run_folder/code_gate.py: {unclassified}")
    assert not both


# A value of each code-naming setting that names code, for a task that has the setting.
CODE_VALUES = {"trust_remote_code": ("sft", True), "head": ("classify", "heads.py:Head"),
               "model": ("custom", "factory.py:build"), "data": ("custom", "make_data:make"),
               "val_data": ("custom", "make_data:make_val"), "metric": ("sft", "mymetric:score")}


def test_the_gate_refuses_every_setting_of_the_table_without_the_flag():
    assert set(CODE_VALUES) == set(NAMES_CODE)  # a new entry gets a case here
    for key, (task, value) in CODE_VALUES.items():
        extra = {"model": "factory.py:build"} if task == "custom" and key != "model" else {}
        cfg = TASK_CONFIGS[task](**{key: value, **extra})
        found = code_problems(cfg, lambda k: f"config.yaml '{k}'", allow_code=False, trust_remote_code=False)
        assert any(p.where == f"config.yaml '{key}'" and "--allow_code" in p.fix for p in found), key
        assert not code_problems(cfg, str, allow_code=True, trust_remote_code=False)


@pytest.fixture(scope="module")
def sft_run(tiny_lm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gate")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    out = tmp / "run"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "4",
                 "--lora_r", "4", "--val_fraction", "0.25", "--max_seq_length", "96", "--max_new_tokens", "4",
                 "--output_dir", str(out)]) == 0
    return out


def test_a_metric_module_named_in_a_run_config_is_not_imported_without_allow_code(sft_run, tmp_path, monkeypatch,
                                                                                   capsys):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["metric"] = "surefit_marker_metric:score"
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    marker = tmp_path / "imported"
    code = tmp_path / "code"
    code.mkdir()
    (code / "surefit_marker_metric.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "def score(preds, refs):\n    return {'mine': 1.0}\n")
    monkeypatch.syspath_prepend(str(code))
    capsys.readouterr()
    for command in (["eval"], ["predict", "--input", "x"], ["export", "--to", str(tmp_path / "e")]):
        assert main([command[0], "--run", str(run), *command[1:]]) == 2
        err = capsys.readouterr().err
        assert "metric: 'surefit_marker_metric:score'" in err and f"{run / 'config.yaml'} 'metric'" in err
        assert "--allow_code" in err
    assert not marker.exists()
    assert main(["eval", "--run", str(run), "--allow_code", "--json"]) == 0
    assert marker.exists() and json.loads(capsys.readouterr().out)["metrics"]["eval_mine"] == 1.0
