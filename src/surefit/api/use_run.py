"""Python API for a finished run folder: ``evaluate``, ``predict``, ``export`` and ``report`` (the CLI's commands of
the same names). Each opens the run through ``run_folder.open_run.open_run`` (a run folder is data, not code) and hands it to
its task module. Training is ``api/__init__.py``; these names are importable from there too.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from surefit.errors import ConfigError, Problem, raise_if
from surefit.run_folder.guard import Output, atomic_file
from surefit.startup.cache import cache_dir_scope, set_cache_dir
from surefit.tasks import get_task


def report(run: str | Path, say=print) -> Path:
    """(Re)build ``curves.svg`` and ``report.html`` in a run folder (finished, interrupted or still training).

    Returns:
        The path of ``report.html``.

    Raises:
        ConfigError: the folder does not exist or holds no run (no ``config.yaml`` and no ``metrics.jsonl``).
    """
    from surefit.run_folder.report import write_report

    folder = Path(run)
    if not folder.is_dir():
        raise ConfigError(Problem(f"no such run folder: {folder}", "--run", "pass a run's --output_dir"))
    if not (folder / "config.yaml").is_file() and not (folder / "metrics.jsonl").is_file():
        raise ConfigError(Problem(f"{folder} holds no run (no config.yaml or metrics.jsonl)", "--run",
                                  "pass the --output_dir a `surefit train` wrote"))
    from surefit.run_folder.guard import check_outputs, run_inputs

    pages = [folder / "curves.svg", folder / "report.html"]
    check_outputs([Output("surefit report", p) for p in pages], [i for i in run_inputs(folder) if i.path not in pages])
    return write_report(folder, say=say)


def _open(run: str | Path, allow_code: bool = False, trust_remote_code: bool = False, say=print) -> tuple[Any, Any]:
    """The finished run and its task module; ``final/`` must hold what the task saves. The code the run's config
    names (head, model or data factory, remote code) only runs with ``allow_code`` / ``trust_remote_code``."""
    from surefit.models import quiet_libraries
    from surefit.run_folder.open_run import open_run

    quiet_libraries()
    r = open_run(run, allow_code=allow_code, trust_remote_code=trust_remote_code, say=say)
    task = get_task(r.task)
    r.require(*task.final_files(r.cfg))
    set_cache_dir(getattr(r.cfg, "cache_dir", None))  # the run's --cache_dir: its converted GGUF base is there
    return r, task


def _check_outputs(run: Any, outputs: list[Output], data: str | Path | None) -> None:
    """Refuse, before anything is loaded, an output that resolves to what the command reads (run_folder/guard.py)."""
    from surefit.run_folder.guard import Input, check_outputs, run_inputs

    inputs = run_inputs(run.folder, run.cfg)
    if data is not None:
        inputs.append(Input(Path(data), "the data this command reads", tree=Path(data).is_dir()))
    check_outputs([o for o in outputs if o.path is not None], inputs)


def _check_counts(**values: int | None) -> None:
    raise_if([Problem(f"must be >= 1 (got {v})", f"--{k}") for k, v in values.items() if v is not None and v < 1],
             ConfigError)


def _check_fields(run: Any, task: Any, fields: dict[str, str | None]) -> dict[str, str]:
    """Column flags given for ``--data`` / ``--file``: only the run's task's apply."""
    wrong = [k for k, v in fields.items() if v is not None and k not in task.FIELDS]
    if wrong:
        allowed = ", ".join(f"--{k}" for k in task.FIELDS) or "none"
        raise ConfigError([Problem(f"--{k} does not apply to a {run.task} run ({run.folder})", f"--{k}",
                                   f"drop it (field flags of {run.task} runs: {allowed})") for k in wrong])
    return {k: v for k, v in fields.items() if v is not None}


@dataclass(frozen=True)
class UseOptions:
    """The rarely changed settings of :func:`evaluate` and :func:`predict`; the defaults reproduce the run's own
    evaluation. ``show`` applies to ``evaluate`` only, ``stream`` and ``collect`` to ``predict`` only.

    Attributes:
        batch_size: rows per batch (default: the run's evaluation batch, so the numbers match its last epoch).
        max_new_tokens: sft generation length (default: the run's).
        fields: column names for the rows read: ``input_field``/``target_field`` (sft), ``text_field``,
            ``text_pair_field``, ``label_field`` (classify).
        show: ``"table"`` or ``"json"``: print the evaluation that way (to stdout); ``None`` prints nothing.
        stream: write each prediction to this text stream (e.g. ``sys.stdout``) as soon as its batch is done.
        collect: also return the predictions (``False`` for inputs too large to hold).
    """

    batch_size: int | None = None
    max_new_tokens: int | None = None
    fields: dict[str, str | None] | None = None
    show: str | None = None
    stream: TextIO | None = None
    collect: bool = True


def _check_options(o: UseOptions, command: str) -> None:
    """Counts >= 1, and no setting of the other command (it would be ignored)."""
    other = ({"stream": o.stream is not None, "collect": not o.collect} if command == "evaluate" else
             {"show": o.show is not None})
    raise_if([Problem(f"UseOptions.{k} applies to {'predict' if command == 'evaluate' else 'evaluate'} only",
                      f"options.{k}", f"drop it from the options of {command}()") for k, v in other.items() if v],
             ConfigError)
    _check_counts(batch_size=o.batch_size, max_new_tokens=o.max_new_tokens)


@cache_dir_scope
def evaluate(run: str | Path, data: str | None = None, *, out: str | Path | None = None,
             predictions: str | Path | None = None, say=print, allow_code: bool = False,
             trust_remote_code: bool = False, options: UseOptions | None = None) -> dict[str, Any]:
    """Evaluate a finished run on its validation split, re-derived exactly as training did, or on ``data``.

    sft: eval loss, SQuAD F1 and exact match of greedy generations; classify: accuracy, macro-F1, per-class F1 and
    the confusion matrix (multi-label, regression: their metrics); custom: eval loss. On the run's own validation
    split the numbers match the last epoch of ``metrics.jsonl`` (returned under ``"training"`` to compare).

    Args:
        run: the run folder (``--output_dir`` of ``surefit train``).
        data: evaluate on this file (sft, classify) or tensor folder (custom) instead.
        out: also write the result as JSON to this file.
        predictions: write one JSON line per example (input, gold, prediction) to this file.
        say: where progress and notes go.
        allow_code: run the code the run's config.yaml names (a ``head``, a ``model`` or ``data`` factory, remote
            code); without it such a run is refused (a run folder is data). trust_remote_code: allow only the
            latter.
        options: the rarely changed settings (:class:`UseOptions`: ``batch_size``, ``max_new_tokens``, ``fields``
            for ``data``'s columns, ``show``), e.g. ``options=UseOptions(batch_size=8)``.

    Returns:
        ``{"run", "task", "data", "rows", "metrics", "training"}``; ``training`` holds the last epoch's values of the
        same metrics from ``metrics.jsonl`` when the run's own validation split was evaluated (else ``None``).
    """
    import json as _json

    from surefit.run_folder.report import render_eval

    o = options or UseOptions()
    _check_options(o, "evaluate")
    r, task = _open(run, allow_code, trust_remote_code, say)
    _check_outputs(r, [Output(flag, Path(p)) for flag, p in (("--out", out), ("--predictions", predictions))
                       if p is not None], data)
    given = _check_fields(r, task, o.fields or {})
    if data is None and given:
        raise ConfigError([Problem(f"--{k} names a column of --data, and no --data was given (the run's own validation "
                                   "data is read with the run's fields)", f"--{k}", "pass --data FILE, or drop it")
                           for k in given])
    described, n, metrics, records = task.evaluate(r, data, o.batch_size or r.eval_batch_size, o.max_new_tokens,
                                                   given, say)
    if predictions is not None:
        with atomic_file(predictions) as fh:
            fh.writelines(_json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
    training = None
    if data is None and r.last_epoch is not None:
        training = {"epoch": r.last_epoch.get("epoch")}
        training.update({k: r.last_epoch[k] for k in metrics if k in r.last_epoch})
    result = {"run": str(r.folder), "task": r.task, "data": described, "rows": n, "metrics": metrics,
              "training": training}
    if out is not None:
        with atomic_file(out) as fh:
            fh.write(_json.dumps(result, indent=2) + "\n")
    if o.show == "json":
        print(_json.dumps(result, indent=2))
    elif o.show == "table":
        print(render_eval(result))
    return result


@cache_dir_scope
def predict(run: str | Path, inputs: str | list[str] | None = None, file: str | Path | None = None, *,
            out: str | Path | None = None, say=print, allow_code: bool = False, trust_remote_code: bool = False,
            options: UseOptions | None = None) -> list[dict[str, Any]]:
    """Predict with a finished sft or classify run: one record per input, in input order.

    sft records hold the generated ``prediction`` (the run's prompt format, greedy, stopped at EOS); classify records
    the ``label`` (``labels`` for multi-label, ``value`` for regression) and ``probabilities`` per label.

    Args:
        run: the run folder. inputs: one text or a list of texts. file: rows (JSONL, JSON, CSV, TSV, Parquet) holding
            the run's input field (sft) or text field(s) (classify); every bad row is reported, with its line, before
            anything is predicted.
        out: write the records as JSON lines to this file.
        say, allow_code, trust_remote_code: as for :func:`evaluate`.
        options: the rarely changed settings (:class:`UseOptions`: ``batch_size``, ``max_new_tokens``, ``fields``
            (``input_field`` for sft, ``text_field``/``text_pair_field`` for classify, read from ``file``),
            ``stream``, ``collect``), e.g. ``options=UseOptions(stream=sys.stdout, collect=False)``.
    """
    import json as _json

    o = options or UseOptions()
    _check_options(o, "predict")
    r, task = _open(run, allow_code, trust_remote_code, say)
    _check_outputs(r, [Output("--out", Path(out))] if out is not None else [], file)
    given = _check_fields(r, task, o.fields or {})
    batches = task.predict(r, inputs, None if file is None else str(file), o.batch_size or r.eval_batch_size,
                           o.max_new_tokens, given, say)  # a task without predictions refuses here
    if (inputs is None) == (file is None):
        raise ConfigError(Problem("give either --input TEXT or --file ROWS" if inputs is None else
                                  "both --input and --file given", "--input", "use one of them"))
    if out is not None:
        if Path(out).is_dir():
            raise ConfigError(Problem(f"{out} is a folder", "--out", "pass a file path, e.g. predictions.jsonl"))
    records: list[dict[str, Any]] = []
    count = 0
    with atomic_file(out) if out is not None else nullcontext() as fh:  # renamed into place once all are written
        for batch in batches:
            sinks = [s for s in (fh, o.stream) if s is not None]
            for rec in batch:
                line = _json.dumps(rec, ensure_ascii=False) + "\n"
                for sink in sinks:
                    sink.write(line)
            for sink in sinks:
                sink.flush()
            count += len(batch)
            if o.collect:
                records += batch
    if out is not None:
        say(f"wrote {count} prediction{'s' if count != 1 else ''} to {out}")
    return records


@cache_dir_scope
def export(run: str | Path, to: str | Path, *, merge: bool = False, overwrite: bool = False, say=print,
           allow_code: bool = False, trust_remote_code: bool = False) -> Path:
    """Copy a run's final model to ``to``; with ``merge``, fold its LoRA adapter into the base weights first.

    A merged sft run is a plain causal LM (loads with ``AutoModelForCausalLM``, no peft), a merged or fully trained
    classifier a plain sequence classifier with ``label2id``/``id2label`` in its config; a backbone + custom head
    keeps that layout (``backbone/``, ``head.safetensors``, ``surefit_head.json``), with the backbone merged.

    Returns:
        The folder written.

    Raises:
        SurefitError: ``to`` is not empty (without ``overwrite``), is a file, holds the run or is inside it.

    ``allow_code``, ``trust_remote_code``: as for :func:`evaluate`.
    """
    from surefit.run_folder.open_run import check_destination, export_folder

    r, task = _open(run, allow_code, trust_remote_code, say)
    check_destination(r, Path(to), overwrite)  # the run folder itself: its own message
    _check_outputs(r, [Output("--to", Path(to), folder=True)], None)
    what: list[str] = []
    dest = export_folder(r, Path(to), overwrite, lambda tmp: what.append(task.export(r, tmp, merge, say)))
    say(f"exported the {what[0]} of {r.folder} to {dest}")
    return dest
