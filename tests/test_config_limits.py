"""Config values that no range check would catch: every float setting of every task must be finite (one check over
the dataclass fields), and JSON given in a setting is refused past a depth limit, never a RecursionError."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from surefit.config import build_config, field_kind
from surefit.config.task_configs import TASK_CONFIGS
from surefit.errors import ConfigError


def _float_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if field_kind(f.type)[0] is float]


def _required(task: str) -> dict:
    return {"data": "x.jsonl"} | ({"model": "m.py:build"} if task == "custom" else {})


@pytest.mark.parametrize("task", sorted(TASK_CONFIGS))
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_setting_of_every_task_must_be_finite(task, value):
    cls = TASK_CONFIGS[task]
    names = _float_fields(cls)
    assert {"lr", "min_lr", "warmup"} <= set(names)  # the walk finds the fields (min_lr and warmup passed before)
    for name in names:
        with pytest.raises(ConfigError) as e:
            build_config(cls, None, _required(task) | {name: value})
        flagged = [p for p in e.value.problems if p.where == f"--{name}"]
        assert [p.what for p in flagged] == [f"must be a finite number (got {float(value)})"], name
        assert flagged[0].fix.startswith(f"e.g. --{name} ")


def test_a_nan_warmup_and_min_lr_on_the_command_line_are_refused_before_anything_runs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "surefit", "train", "--data", str(tmp_path / "d.jsonl"), "--warmup",
                          "nan", "--min_lr", "nan", "--output_dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--warmup: must be a finite number (got nan)" in out.stderr
    assert "--min_lr: must be a finite number (got nan)" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("depth", [33, 50_000])
def test_json_settings_nested_too_deep_are_configuration_problems(depth):
    deep = "[" * depth + "]" * depth
    with pytest.raises(ConfigError) as e:
        build_config(TASK_CONFIGS["custom"], None, _required("custom") | {"model_args": '{"a": ' + deep + "}"})
    (problem,) = e.value.problems
    assert problem.where == "--model_args" and "nested more than 32 levels deep" in problem.what
    assert len(problem.what) < 300  # the value is named by its start and size, not printed whole
    with pytest.raises(ConfigError, match="--head_args: not a JSON object \\(nested more than 32 levels deep"):
        build_config(TASK_CONFIGS["classify"], None, {"data": "x.csv", "head": "h.py:H", "head_args": deep})


def test_json_nested_within_the_limit_is_accepted():
    cfg = build_config(TASK_CONFIGS["custom"], None, _required("custom") | {"model_args": '{"a": [[[1]]]}'})
    assert cfg.model_args == '{"a": [[[1]]]}'


def test_a_yaml_mapping_for_a_json_setting_is_that_json_and_an_object_for_a_path_is_refused_by_kind():
    cfg = build_config(TASK_CONFIGS["custom"], {"model_args": {"vocab": 271, "dims": [1, 2]}}, _required("custom"))
    assert cfg.model_args == '{"vocab": 271, "dims": [1, 2]}'
    with pytest.raises(ConfigError) as e:
        build_config(TASK_CONFIGS["sft"], {"data": ["a.jsonl", "b.jsonl"], "template": {"x": 1}}, {})
    assert sorted((p.where, p.what.split(" (in")[0]) for p in e.value.problems) == [
        ("--data", "expected text (a file path or a name), got a list of 2 strs"),
        ("--template", "expected text (a file path or a name), got a dict with keys x")]
