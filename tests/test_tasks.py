"""Every registered task has the surface the runner and the finished-run commands call (tasks/common.Task)."""

from __future__ import annotations

import inspect

import pytest

from surefit.config.task_configs import TASK_CONFIGS
from surefit.errors import ConfigError
from surefit.tasks import TASKS, get_task
from surefit.tasks.runner import Task


def _surface() -> dict[str, inspect.Signature | None]:
    """The protocol's members: a method's signature without ``self``, or None for an attribute."""
    out: dict[str, inspect.Signature | None] = {}
    for name, member in vars(Task).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            out[name] = None
        elif callable(member):
            sig = inspect.signature(member)
            out[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return out


def test_the_protocol_names_what_the_runner_and_the_commands_call():
    assert set(_surface()) == {"FIELDS", "final_files", "prepare", "run", "evaluate", "predict", "export"}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_registered_task_has_the_surface_with_its_parameters(name):
    task = TASKS[name]
    for member, want in _surface().items():
        assert hasattr(task, member), f"task {name} lacks {member}"
        if want is None:
            assert isinstance(getattr(task, member), tuple), f"{name}.{member}"
            continue
        got = inspect.signature(getattr(task, member))
        assert [p.name for p in got.parameters.values()] == [p.name for p in want.parameters.values()], \
            f"{name}.{member}{got} does not take {want}"
        required = [p.name for p in got.parameters.values() if p.default is inspect.Parameter.empty]
        assert required == [p.name for p in want.parameters.values() if p.default is inspect.Parameter.empty], \
            f"{name}.{member}{got}: required parameters differ from {want}"


def test_every_task_config_has_a_task_and_an_unknown_name_is_refused():
    assert set(TASKS) == set(TASK_CONFIGS)
    with pytest.raises(ConfigError, match="unknown task 'dpo2'"):
        get_task("dpo2")


def test_inspect_goes_to_the_tasks_that_have_it_and_refuses_the_others():
    from surefit.tasks import INSPECTS, inspector
    from surefit.tasks.runner import Inspects

    want = inspect.signature(Inspects.inspect)
    for name, task in INSPECTS.items():
        assert inspector(name) is task is TASKS[name]
        got = inspect.signature(task.inspect)
        assert [p.name for p in got.parameters.values()] == [p.name for p in want.parameters.values()][1:], name
    # custom.py imports the stdlib module `inspect`: only a function counts
    assert set(INSPECTS) == {n for n, t in TASKS.items() if callable(getattr(t, "inspect", None))}
    with pytest.raises(ConfigError, match="task 'classify' has no supervised spans to inspect"):
        inspector("classify")
    with pytest.raises(ConfigError, match="unknown task 'dpo2'"):
        inspector("dpo2")


def test_a_finished_run_config_is_read_as_its_tasks_class_or_refused(tmp_path):
    from surefit.config import SFTConfig
    from surefit.config.task_configs import ClassifyConfig
    from surefit.run_folder.open_run import Run

    cfg = ClassifyConfig(data="d.csv")
    run = Run(tmp_path, cfg, tmp_path / "final")
    assert run.config_as(ClassifyConfig) is cfg
    with pytest.raises(ConfigError, match="is a classify run, not one this command reads as SFTConfig"):
        run.config_as(SFTConfig)
