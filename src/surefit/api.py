"""Python API: the same jobs as the CLI, with the same configs.

>>> import surefit
>>> result = surefit.train(task="sft", data="train.jsonl", epochs=2)   # doctest: +SKIP
>>> result.history[-1]["eval_f1"]                                       # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surefit.config import TASK_CONFIGS, build_config
from surefit.errors import ConfigError, Problem


@dataclass
class RunResult:
    """What a training run produced.

    Attributes:
        output_dir: the run folder; final_dir: the saved model (or adapter) and tokenizer.
        history: one record per evaluation, epoch 0 (before training) first, as written to metrics.jsonl.
        data_report: counts of what happened to the data (split, augmentation, truncation, exclusions).
    """

    output_dir: Path
    final_dir: Path
    history: list[dict[str, Any]]
    data_report: dict[str, Any] = field(default_factory=dict)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return self.history


def _config(config: Any, settings: dict[str, Any]) -> Any:
    """A validated task config from a config object, a mapping, or settings by name (which override)."""
    if config is None or isinstance(config, dict):
        values = {**(config or {}), **settings}
        task = values.get("task", "sft")
        cls = TASK_CONFIGS.get(task)
        if cls is None:
            raise ConfigError(Problem(f"unknown task {task!r}", "task", f"use one of: {', '.join(sorted(TASK_CONFIGS))}"))
        return build_config(cls, None, values, yaml_name="arguments")
    if settings:
        return build_config(type(config), None, {**config.__dict__, **settings}, yaml_name="arguments")
    return config


def _task_module(task: str) -> Any:
    import importlib

    return importlib.import_module(f"surefit.tasks.{task}")


def train(config: Any = None, /, **settings: Any) -> RunResult:
    """Train a model.

    Args:
        config: a task config (e.g. :class:`surefit.config.SFTConfig`), a mapping of settings, or ``None``.
        **settings: settings by name (``data=``, ``epochs=``, ``lora_r=`` ...); they override ``config``.

    Raises:
        ConfigError, DataError, ModelError: with every problem found, each naming where and how to fix it.
        DoctorRefused: the doctor found errors in the setup (``force=True`` trains anyway).
    """
    cfg = _config(config, settings)
    out = _task_module(cfg.task).run(cfg)
    return RunResult(out["output_dir"], out["final_dir"], out["history"], out["data_report"])


def doctor(config: Any = None, /, **settings: Any) -> Any:
    """Build a run's setup exactly as ``train`` would (data, encoding, model, collator) and return the doctor's
    report, without training and without writing to the run's ``--output_dir``."""
    import dataclasses
    import tempfile

    from surefit.doctor.gate import DoctorOnly

    cfg = _config(config, settings)
    with tempfile.TemporaryDirectory(prefix="surefit-doctor-") as tmp:
        cfg = dataclasses.replace(cfg, output_dir=tmp, overwrite=True, resume=None)
        try:
            _task_module(cfg.task).run(cfg, doctor_only=True)
        except DoctorOnly as done:
            return done.report
    raise RuntimeError("the task returned without running the doctor")  # pragma: no cover


def report(run: str | Path, say=print) -> Path:
    """(Re)build ``curves.png`` and ``report.html`` in a run folder (finished, interrupted or still training).

    Returns:
        The path of ``report.html``.

    Raises:
        ConfigError: the folder does not exist or holds no run (no ``config.yaml`` and no ``metrics.jsonl``).
    """
    from surefit.report import write_report

    folder = Path(run)
    if not folder.is_dir():
        raise ConfigError(Problem(f"no such run folder: {folder}", "--run", "pass a run's --output_dir"))
    if not (folder / "config.yaml").is_file() and not (folder / "metrics.jsonl").is_file():
        raise ConfigError(Problem(f"{folder} holds no run (no config.yaml or metrics.jsonl)", "--run",
                                  "pass the --output_dir a `surefit train` wrote"))
    return write_report(folder, say=say)


def inspect_data(data: str, model: str | None = None, model_args: str | None = None,
                 max_memory_gb: float | None = None, say=print) -> str:
    """Describe every array of a tensor dataset; with a model factory, each input's first layer and any mismatch.

    Returns:
        The report text (also passed to ``say``).
    """
    import json as _json

    from surefit.data.tensors import load_tensor_data
    from surefit.doctor.shapes import diagnose, trace
    from surefit.heads import load_factory

    tensors = load_tensor_data(data, max_memory_gb)
    lines = [tensors.describe()]
    if model:
        from surefit.config import CustomConfig
        from surefit.tasks.custom import Caller, forward_protocol

        args = _json.loads(model_args or "{}")
        net = load_factory(model, flag="--model")(**args)
        mode, passed, problems = forward_protocol(net, list(tensors.arrays))
        lines += [f"problem: {p.what}" for p in problems]
        caller = Caller(CustomConfig(data=data, model=model, loss="cross_entropy"), mode, passed)
        batch = tensors.batch(list(range(min(2, len(tensors)))))
        net.eval()
        tr = trace(net, batch, lambda: caller.forward(net, batch))
        lines.append(f"model {type(net).__name__}: forward({'batch' if mode == 'single' else ', '.join(passed)})")
        for key in tensors.arrays:
            use = tr.uses.get(key)
            if use is None:
                status = "passed but not consumed by a layer before the pass ended" if key in passed else "not passed"
                lines.append(f"  {key}: {status}")
            else:
                verdict = "" if use.agrees is None else " - shapes agree" if use.agrees else f" - MISMATCH: expects {use.expects}"
                lines.append(f"  {key} {list(use.shape)} {use.dtype} -> first consumed by {use.module} ({use.layer}){verdict}")
        message = diagnose(tr, batch, args)
        if message:
            lines.append(message)
    text = "\n".join(lines)
    say(text)
    return text


def evaluate(run: str | Path, data: str | None = None, *, out: str | Path | None = None,
             show: str | None = None, say=print, **options: Any) -> dict[str, Any]:
    """Evaluate a finished run on its validation split, re-derived exactly as training did, or on ``data``.

    sft: eval loss, SQuAD F1 and exact match of greedy generations; classify: accuracy, macro-F1, per-class F1 and
    the confusion matrix (multi-label, regression: their metrics); custom: eval loss. On the run's own validation
    split the numbers match the last epoch of ``metrics.jsonl`` (returned under ``"training"`` to compare).

    Args:
        run: the run folder (``--output_dir`` of ``surefit train``).
        data: evaluate on this file (sft, classify) or tensor folder (custom) instead.
        out: also write the result as JSON to this file.
        show: ``"table"`` or ``"json"``: print the result that way (to stdout); ``None`` prints nothing.
        say: where progress and notes go.
        **options: ``batch_size``, ``max_new_tokens``, ``predictions`` (a JSONL file of per-row predictions),
            ``fields`` (``{"input_field": ...}``, ``{"text_field": ...}``: columns of ``data``).

    Returns:
        ``{"run", "task", "data", "rows", "metrics", "training"}``.
    """
    import json as _json

    from surefit.use import evaluate as _evaluate
    from surefit.use import render_eval

    result = _evaluate(run, data, say=say, **options)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(_json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if show == "json":
        print(_json.dumps(result, indent=2))
    elif show == "table":
        print(render_eval(result))
    return result


def predict(run: str | Path, inputs: str | list[str] | None = None, file: str | Path | None = None,
            **options: Any) -> list[dict[str, Any]]:
    """Predict with a finished sft run (generated response) or classify run (label and probabilities).

    Args:
        run: the run folder. inputs: a text or a list of texts. file: rows holding the run's input field.
        **options: ``out`` (a JSONL file), ``stream`` (a text stream written as each batch finishes), ``collect``,
            ``batch_size``, ``max_new_tokens``, ``fields``, ``say``; see :func:`surefit.use.predict`.

    Returns:
        One record per input, in order.
    """
    from surefit.use import predict as _predict

    return _predict(run, inputs, file, **options)


def export(run: str | Path, to: str | Path, *, merge: bool = False, overwrite: bool = False, say=print) -> Path:
    """Copy a run's final model to ``to``; with ``merge``, fold its LoRA adapter into the base weights (safetensors,
    loadable with plain ``transformers``). A non-empty ``to`` is refused unless ``overwrite``.

    Returns:
        The folder written.
    """
    from surefit.use import export as _export

    return _export(run, to, merge=merge, overwrite=overwrite, say=say)
