"""The run's pictures and page: ``OUTPUT/curves.svg`` and ``OUTPUT/report.html``.

Both are built only from files the run folder already holds (``metrics.jsonl``, ``config.yaml``, ``doctor.json``,
``memory_plan.json``, the checkpoints' ``trainer_state.json``, ``predictions/epoch_N.jsonl``), so ``surefit report
--run OUTPUT`` rebuilds them for a finished run, an interrupted one, or one still training.

The page is one self-contained file: inline CSS, the curves embedded as a base64 ``data:`` URI, no script and no
external resource, so it can be mailed or opened offline. Everything taken from the run's data is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import yaml

from surefit.config.yaml_files import load_yaml_text
from surefit.run_folder.svg_chart import Panel, Series
from surefit.run_folder.svg_chart import render as render_chart
from surefit.startup.walltime import Profile
from surefit.units import human_bytes

CURVES = "curves.svg"
SCHEDULE = "schedule.json"  # written by tasks/common.train: the learning-rate schedule, drawn in the curves
REPORT = "report.html"
# Task metrics drawn per epoch, in this order, when the records hold them: sft (eval_f1, eval_em), classification
# single-label (accuracy, macro-F1), multi-label (micro/macro-F1, subset accuracy), regression (Pearson). The
# custom task has none. (Regression's MSE is its evaluation loss, already in the loss panel.)
TASK_METRICS = ("eval_f1", "eval_em", "eval_accuracy", "eval_macro_f1", "eval_micro_f1", "eval_subset_accuracy",
                "eval_pearson")
SAMPLE_ROWS = 10
_CELL_CHARS = 400


# ------------------------------------------------------------------------------------------------------ reading


def read_metrics(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(step records, epoch records)`` of ``metrics.jsonl``; a torn last line (a crash mid-write) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    steps: list[dict[str, Any]] = []
    epochs: list[dict[str, Any]] = []
    if not path.is_file():
        return steps, epochs
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("type") == "step" and _num(rec.get("step")) is not None:
            steps.append(rec)
        elif rec.get("type") == "epoch" and _num(rec.get("epoch")) is not None:
            epochs.append(rec)
    return steps, epochs


def read_evaluations(run_dir: str | Path) -> list[dict[str, Any]]:
    """The ``eval`` records of ``metrics.jsonl``: evaluations inside an epoch (``--eval_every``), at their step."""
    path = Path(run_dir) / "metrics.jsonl"
    out: list[dict[str, Any]] = []
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("type") == "eval" and _num(rec.get("epoch_progress")) is not None:
            out.append(rec)
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _read_config(run_dir: Path) -> dict[str, Any]:
    try:
        data = load_yaml_text((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def task_metrics(epochs: list[dict[str, Any]]) -> list[str]:
    """The task metrics the epoch records hold (empty for the custom task)."""
    return [k for k in TASK_METRICS if any(_num(r.get(k)) is not None for r in epochs)]


# ------------------------------------------------------------------------------------------------------ curves


def write_curves(run_dir: str | Path) -> Path:
    """Draw ``curves.svg``: training loss per step, train/eval loss per epoch, the task metric per epoch and the
    learning-rate schedule (:mod:`surefit.run_folder.svg_chart`: milliseconds, no plotting library).

    The file is replaced atomically: a reader never sees half a picture.
    """
    run_dir = Path(run_dir)
    steps, epochs = read_metrics(run_dir)
    metrics = task_metrics(epochs)
    schedule = _read_json(run_dir / SCHEDULE)
    panels = [_loss_panel(steps, epochs)]

    evals = read_evaluations(run_dir)
    per_epoch = Panel("loss per epoch (epoch 0 = before training)", "epoch", "loss", empty_note="no evaluation yet")
    for key, label, color, marker in (("train_loss", "train", "#1f77b4", "circle"),
                                      ("eval_loss", "evaluation", "#ff7f0e", "square")):
        pts = [(r["epoch"], r[key]) for r in epochs if _num(r.get(key)) is not None]
        if key == "eval_loss":  # --eval_every: the evaluations between epoch ends, at their fraction of an epoch
            pts = sorted(pts + [(r["epoch_progress"], r[key]) for r in evals if _num(r.get(key)) is not None])
        if pts:
            per_epoch.series.append(Series([x for x, _ in pts], [y for _, y in pts], color, label, "line+points",
                                           marker))
    panels.append(per_epoch)

    if metrics:
        scores = Panel("evaluation metrics", "epoch", "score")
        for key, color in zip(metrics, _COLORS, strict=False):
            pts = [(r["epoch"], r[key]) for r in epochs if _num(r.get(key)) is not None]
            pts = sorted(pts + [(r["epoch_progress"], r[key]) for r in evals if _num(r.get(key)) is not None])
            scores.series.append(Series([x for x, _ in pts], [y for _, y in pts], color, key.removeprefix("eval_"),
                                        "line+points"))
        values = [r[k] for r in epochs for k in metrics if _num(r.get(k)) is not None and math.isfinite(r[k])]
        if values and -1.0 <= min(values) and max(values) <= 1.0:  # scores: show them on their whole scale
            scores.ylim = (min(0.0, min(values)) - 0.03, 1.03)
        panels.append(scores)
    if isinstance(schedule, dict):
        panels.append(_schedule_panel(schedule, steps))
    config = _read_config(run_dir)
    target = run_dir / CURVES
    tmp = run_dir / f".{CURVES}.tmp"
    tmp.unlink(missing_ok=True)  # a leftover (or planted) temporary name is never written through
    tmp.write_text(render_chart(panels, f"{run_dir.name}  ({config.get('task', '?')})"), encoding="utf-8")
    os.replace(tmp, target)
    return target


# matplotlib's first colours: the curves look as they did when matplotlib drew them
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def _loss_panel(steps: list[dict[str, Any]], epochs: list[dict[str, Any]]) -> Panel:
    """The logged steps' training loss, with each epoch's mean at its last step and a guide line there."""
    panel = Panel("training loss", "optimizer step", "loss", empty_note="no training step logged yet")
    logged = [r for r in steps if _num(r.get("loss")) is not None]
    if logged:
        panel.series.append(Series([r["step"] for r in logged], [r["loss"] for r in logged], "#1f77b4",
                                   "training loss (logged steps)"))
    ends = [r for r in epochs if r["epoch"] >= 1 and _num(r.get("train_loss")) is not None and _num(r.get("step"))]
    if ends:
        panel.series.append(Series([r["step"] for r in ends], [r["train_loss"] for r in ends], "#ff7f0e",
                                   "epoch mean", "points"))
        panel.vlines = [float(r["step"]) for r in ends]
    return panel


def _schedule_panel(schedule: dict[str, Any], steps: list[dict[str, Any]]) -> Panel:
    """The planned learning rate of every optimizer step (schedule.json) and the rates the logged steps ran at."""
    from surefit.training.schedule import Schedule

    panel = Panel("learning rate", "optimizer step", "lr", empty_note="schedule.json unreadable")
    try:
        plan = Schedule(**schedule)
        # As metrics.jsonl's "lr": the rate set after step n, which step n + 1 runs at.
        xs = list(range(0, plan.total_steps + 1))
        panel.series.append(Series([float(x) for x in xs], [plan.lr_at(x) for x in xs], "#2ca02c",
                                   f"{plan.kind}, warmup {plan.warmup_steps}"))
    except (TypeError, ValueError):
        return panel
    logged = [(r["step"], r["lr"]) for r in steps if _num(r.get("lr")) is not None]
    if logged:
        panel.series.append(Series([x for x, _ in logged], [y for _, y in logged], "#d62728", "logged steps",
                                   "points", "dot"))
    return panel


# ------------------------------------------------------------------------------------------------------ the page


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(v: Any) -> str:
    """A number as a reader wants it (4 decimals, or scientific for tiny/huge); anything else as text."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0 or 1e-3 <= abs(v) < 1e6:
            return f"{v:.4f}"
        return f"{v:.3e}"
    return str(v)


def _clip(text: str, limit: int = _CELL_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _value_html(value: Any, key: str = "", depth: int = 0) -> str:
    """Any JSON value as HTML: mappings become nested tables, lists of mappings tables, the rest escaped text."""
    if isinstance(value, dict) and depth < 3:
        if not value:
            return '<span class="muted">(empty)</span>'
        return _kv_table(value, depth + 1, parent=key)
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value) and depth < 3:
        cols = list(dict.fromkeys(k for x in value for k in x))
        return _table(cols, [[x.get(c) for c in cols] for x in value])
    if isinstance(value, list) and not value:
        return '<span class="muted">(none)</span>'
    if isinstance(value, list):
        return _e(_clip(" | ".join(_fmt(x) if not isinstance(x, dict | list) else json.dumps(x) for x in value)))
    if isinstance(value, dict):
        return _e(_clip(json.dumps(value)))
    text = _fmt(value)
    if isinstance(value, int) and not isinstance(value, bool) and (key.endswith("bytes") or key == "estimate"):
        text += f" ({human_bytes(value)})"
    return _e(_clip(text))


def _kv_table(mapping: dict[str, Any], depth: int = 0, parent: str = "") -> str:
    """A key | value table; ``None`` shows as null (as in config.yaml)."""
    rows = "".join(
        f"<tr><th>{_e(k)}</th><td>"
        + ("null" if v is None else _value_html(v, parent if parent == "estimate" else str(k), depth))
        + "</td></tr>"
        for k, v in mapping.items()
    )
    return f'<table class="kv">{rows}</table>'


def _table(columns: list[str], rows: list[list[Any]], classes: str = "") -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_value_html(v, depth=3)}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table class="grid {classes}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}"><h2>{_e(title)}</h2>\n{body}\n</section>\n'


def _note(text: str) -> str:
    return f'<p class="muted">{_e(text)}</p>'


def _status(run_dir: Path, config: dict[str, Any], epochs: list[dict[str, Any]]) -> str:
    done = max((int(r["epoch"]) for r in epochs), default=None)
    planned = config.get("epochs")
    if (run_dir / "final").is_dir() and (planned is None or done == planned):
        return f"finished: {done} of {planned} epochs, model saved in final/"
    if done is None:
        return "no evaluation logged yet (the run stopped before training, or is starting)"
    return f"interrupted or still running: last evaluation after epoch {done} of {planned}"


def _plan_section(run_dir: Path, config: dict[str, Any]) -> str:
    plan = _read_json(run_dir / "memory_plan.json")
    if isinstance(plan, dict):
        return _note("from memory_plan.json") + _kv_table(plan)
    newest: tuple[int, str, dict[str, Any]] | None = None
    for state_file in sorted((run_dir / "checkpoints").glob("*/trainer_state.json")):
        state = _read_json(state_file)
        if isinstance(state, dict) and isinstance(state.get("plan"), dict):
            step = int(_num(state.get("global_step")) or 0)
            if newest is None or step >= newest[0]:
                newest = (step, state_file.parent.name, state["plan"])
    if newest is not None:
        return _note(f"no memory_plan.json; the plan in force at checkpoint {newest[1]}") + _kv_table(newest[2])
    keys = ("batch_size", "grad_accum", "precision", "gradient_checkpointing", "eval_batch_size")
    fallback = {k: config[k] for k in keys if k in config}
    if "batch_size" in fallback and fallback.get("grad_accum"):
        fallback = {"batch_size": fallback["batch_size"],
                    "micro_batch_size": int(fallback["batch_size"]) // int(fallback["grad_accum"]), **fallback}
    if not fallback:
        return _note("no memory_plan.json, checkpoint or config.yaml to read it from")
    return _note("no memory_plan.json or checkpoint; the settings from config.yaml") + _kv_table(fallback)


def _doctor_section(run_dir: Path) -> str:
    report = _read_json(run_dir / "doctor.json")
    if not isinstance(report, dict):
        return _note("no doctor report saved in this run folder (doctor.json is absent)")
    findings = [f for f in report.get("findings") or [] if isinstance(f, dict)]
    if not findings:
        return '<p class="ok">no findings: every check passed</p>'
    errors = sum(f.get("severity") == "error" for f in findings)
    head = (f'<p class="{"bad" if errors else "ok"}">{len(findings)} finding{"s" if len(findings) != 1 else ""}, '
            f"{errors} error{'s' if errors != 1 else ''}</p>")
    cols = ["severity", "code", "where", "message", "fix"]
    return head + _table(cols, [[f.get(c, "") for c in cols] for f in findings])


def _time_section(run_dir: Path) -> str:
    """``profile.json`` (``--profile``: the whole run) or else ``startup.json`` (the command to step 1)."""
    data = _read_json(run_dir / "profile.json")
    if isinstance(data, dict):
        try:
            profile = Profile.from_json(data)
        except (KeyError, TypeError, ValueError) as e:
            return _note(f"profile.json is not a profile ({type(e).__name__}: {e})")
        rows = [[k, f"{v:.1f}", f"{100 * v / profile.seconds:.1f}%" if profile.seconds > 0 else "-"]
                for k, v in profile.parts.items()]
        return (_note(f"from profile.json (--profile): {profile.seconds:.1f} s from the command to the end of the run")
                + _table(["part", "seconds", "share"], rows)
                + _note("the start-up, by phase") + _table(["phase", "seconds"],
                                                           [[k, f"{v:.2f}"] for k, v in profile.startup.items()]))
    data = _read_json(run_dir / "startup.json")
    if isinstance(data, dict) and isinstance(data.get("phases"), dict):
        rows = [[k, f"{_num(v) or 0.0:.2f}"] for k, v in data["phases"].items()]
        cache = data.get("cache") if isinstance(data.get("cache"), dict) else {}
        cached = "; start-up cache: " + ", ".join(f"{k} {v}" for k, v in cache.items()) if cache else ""
        return (_note(f"from startup.json: {_num(data.get('seconds')) or 0.0:.1f} s from the command to step 1"
                      f"{cached} (the whole run's split: surefit train --profile)")
                + _table(["phase", "seconds"], rows))
    return _note("no startup.json or profile.json in this run folder (the run stopped before step 1)")


def _metrics_section(epochs: list[dict[str, Any]], steps: list[dict[str, Any]]) -> str:
    if not epochs:
        return _note("no epoch record in metrics.jsonl yet")
    first = ["epoch", "step", "train_loss", "eval_loss", *task_metrics(epochs)]
    scalar = [k for r in epochs for k, v in r.items() if _num(v) is not None and k not in ("time",)]
    cols = [c for c in first if c in scalar] + [c for c in dict.fromkeys(scalar) if c not in first]
    out = _table(cols, [[r.get(c) for c in cols] for r in epochs], "metrics")
    out += _note(f"{len(epochs)} epoch records (epoch 0 = before training) and {len(steps)} step records in "
                 "metrics.jsonl")
    last = epochs[-1]
    if isinstance(last.get("eval_per_class_f1"), dict):
        out += f"<h3>per-class F1 after epoch {_e(last['epoch'])}</h3>" + _kv_table(last["eval_per_class_f1"])
    matrix, labels = last.get("eval_confusion_matrix"), last.get("labels")
    if isinstance(matrix, list) and isinstance(labels, list) and len(matrix) == len(labels):
        out += f"<h3>confusion matrix after epoch {_e(last['epoch'])} (rows: gold, columns: predicted)</h3>"
        out += _table(["gold \\ predicted", *map(str, labels)],
                      [[labels[i], *row] for i, row in enumerate(matrix) if isinstance(row, list)], "matrix")
    return out


def _evaluations_section(run_dir: Path, epochs: list[dict[str, Any]]) -> str:
    """Evaluations between epoch ends (``--eval_every``) and which evaluation final/ holds (``--keep_best``)."""
    evals = read_evaluations(run_dir)
    out = ""
    if evals:
        first = ["epoch_progress", "step", "eval_loss", *task_metrics(epochs or evals)]
        scalar = [k for r in evals for k, v in r.items() if _num(v) is not None and k not in ("time", "epoch")]
        cols = [c for c in first if c in scalar] + [c for c in dict.fromkeys(scalar) if c not in first]
        out += "<h3>evaluations between epoch ends (--eval_every)</h3>"
        out += _table(cols, [[r.get(c) for c in cols] for r in evals], "metrics")
    chosen = [r for r in [*epochs, *evals] if r.get("best_checkpoint")]
    if chosen:
        best = max(chosen, key=lambda r: r.get("step") or 0)
        out += _note(f"final/ holds the best evaluation by {best.get('best_metric')}: {_fmt(best.get('best_value'))} "
                     f"at step {best.get('best_step')} (checkpoints/{best.get('best_checkpoint')})")
    return out


def _samples_section(run_dir: Path) -> str:
    """``--log_samples``: each logged validation row's prediction at every evaluation, so progress reads as text."""
    by_sample: dict[Any, list[dict[str, Any]]] = {}
    for path in (run_dir / "predictions" / "samples").glob("step_*.jsonl"):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                by_sample.setdefault(rec.get("sample"), []).append(rec)
    if not by_sample:
        return ""
    out = "<h3>logged samples at each evaluation (--log_samples)</h3>"
    for key in sorted(by_sample, key=str):
        recs = sorted(by_sample[key], key=lambda r: (_num(r.get("step")) or 0, _num(r.get("epoch")) or 0))
        first = recs[0]
        out += (f"<p><b>sample {_e(key)}</b> ({_e(first.get('where'))}): prompt <code>{_e(_clip(str(first.get('prompt'))))}"
                f"</code>; reference <code>{_e(_clip(str(first.get('reference'))))}</code></p>")
        out += _table(["step", "epoch", "prediction"],
                      [[r.get("step"), r.get("epoch"), _clip(str(r.get("prediction")))] for r in recs], "predictions")
    return out


def _predictions_section(run_dir: Path) -> str:
    files = []
    for p in (run_dir / "predictions").glob("epoch_*.jsonl"):
        suffix = p.stem.removeprefix("epoch_")
        if suffix.isdigit():
            files.append((int(suffix), p))
    if not files:
        return _note("no predictions/epoch_N.jsonl in this run folder (the custom task writes none)")
    epoch, path = max(files)
    rows: list[dict[str, Any]] = []
    total = 0
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            total += 1
            if len(rows) < SAMPLE_ROWS:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    rows.append(rec)
    if not rows:
        return _note(f"predictions/{path.name} holds no rows")
    cols = list(dict.fromkeys(k for r in rows for k in r))
    body = _note(f"the first {len(rows)} of {total} rows of predictions/{path.name} (after epoch {epoch})")
    return body + _table(cols, [[r.get(c) for c in cols] for r in rows], "predictions")


_CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:24px auto;max-width:1160px;
color:#1d1d1f;background:#fff;padding:0 16px;line-height:1.4}
h1{font-size:26px;margin:0 0 4px}h2{font-size:20px;border-bottom:2px solid #e3e6ea;padding-bottom:4px;margin-top:32px}
h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #d7dbe0;padding:4px 8px;text-align:left;vertical-align:top}
thead th{background:#eef2f7}table.kv>tbody>tr>th,table.kv>tr>th{background:#f6f8fa;font-weight:600;white-space:nowrap}
table.metrics td,table.matrix td{text-align:right;font-variant-numeric:tabular-nums}
table.predictions td{white-space:pre-wrap;word-break:break-word;max-width:520px}
.muted{color:#5f6b7a;font-size:13px}.ok{color:#17703a;font-weight:600}.bad{color:#b3261e;font-weight:600}
nav a{margin-right:14px;font-size:14px}.cols{display:flex;flex-wrap:wrap;gap:0 18px;align-items:flex-start}img.curves{max-width:100%;border:1px solid #e3e6ea}
"""

SECTIONS = (("config", "Configuration"), ("memory-plan", "Memory plan"), ("doctor", "Doctor findings"),
            ("metrics", "Metrics"), ("curves", "Curves"), ("predictions", "Sample predictions"),
            ("time", "Where the time went"))


def render_report(run_dir: str | Path) -> str:
    """The report page of a run folder, as one self-contained HTML string (reads ``curves.svg`` if present)."""
    run_dir = Path(run_dir)
    config = _read_config(run_dir)
    steps, epochs = read_metrics(run_dir)
    title = f"surefit run: {run_dir.resolve().name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="muted">task {_e(config.get("task", "?"))}; {_e(_status(run_dir, config, epochs))}; folder '
        f"{_e(run_dir.resolve())}; report written {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>",
        "<nav>" + "".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in SECTIONS) + "</nav>",
    ]
    if config:
        body = _note("config.yaml: the resolved settings; pass it back with --config to repeat the run")
        # Three side-by-side columns: some forty settings read better as a block than as one long list.
        items = list(config.items())
        third = -(-len(items) // 3)
        body += '<div class="cols">' + "".join(
            _kv_table(dict(items[i : i + third])) for i in range(0, len(items), third)) + "</div>"
    else:
        body = _note("no config.yaml in this run folder")
    parts.append(_section("config", "Configuration", body))
    parts.append(_section("memory-plan", "Memory plan", _plan_section(run_dir, config)))
    parts.append(_section("doctor", "Doctor findings", _doctor_section(run_dir)))
    parts.append(_section("metrics", "Metrics", _metrics_section(epochs, steps) + _evaluations_section(run_dir, epochs)))
    svg = run_dir / CURVES
    if svg.is_file():
        # As an image, not inline markup: the picture cannot add script or style to the page, whatever its text.
        data = base64.b64encode(svg.read_bytes()).decode("ascii")
        body = (f'<img class="curves" alt="training loss per step, loss and metrics per epoch" '
                f'src="data:image/svg+xml;base64,{data}">')
    else:
        body = _note(f"no {CURVES} (run `surefit report --run` on this folder to draw it)")
    parts.append(_section("curves", "Curves", body))
    parts.append(_section("predictions", "Sample predictions", _samples_section(run_dir) + _predictions_section(run_dir)))
    parts.append(_section("time", "Where the time went", _time_section(run_dir)))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def curves_current(run_dir: Path) -> bool:
    """Whether ``curves.svg`` was drawn after the last change to what it shows (metrics.jsonl, schedule.json)."""
    try:
        drawn = (run_dir / CURVES).stat().st_mtime_ns
    except OSError:
        return False
    sources = [run_dir / "metrics.jsonl", run_dir / SCHEDULE]
    return all(drawn >= f.stat().st_mtime_ns for f in sources if f.is_file())


def write_report(run_dir: str | Path, say: Any = None, redraw: bool = True) -> Path:
    """(Re)build ``curves.svg`` and ``report.html`` in a run folder; returns the page's path.

    Args:
        run_dir: a run's ``--output_dir`` (finished, interrupted or still training).
        say: where to print the one-line summary (``None``: silent).
        redraw: ``False``: keep a ``curves.svg`` drawn after the last metrics were written (the end of a run, whose
            last epoch has just drawn it).
    """
    run_dir = Path(run_dir)
    if redraw or not curves_current(run_dir):
        write_curves(run_dir)
    target = run_dir / REPORT
    tmp = run_dir / f".{REPORT}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.write_text(render_report(run_dir), encoding="utf-8")
    os.replace(tmp, target)
    if say is not None:
        say(f"wrote {run_dir / CURVES} and {target}")
    return target


# ------------------------------------------------------------------------------------------------------ eval table


def render_eval(result: dict[str, Any]) -> str:
    """The evaluation as a table (and, for a classifier, per-class F1 and the confusion matrix)."""
    metrics, training = result["metrics"], result["training"]
    lines = [f"{result['task']} run {result['run']} on {result['data']}: {result['rows']} rows"]
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    width = max(len(k) for k in scalars) if scalars else 6
    head = f"  {'metric'.ljust(width)}  {'now':>8}"
    if training:
        head += f"  {'metrics.jsonl, epoch ' + str(training.get('epoch')):>25}"
    lines.append(head)
    for k, v in scalars.items():
        line = f"  {k.ljust(width)}  {_eval_num(v):>8}"
        if training and k in training:
            line += f"  {_eval_num(training[k]):>25}"
        lines.append(line)
    per_class = metrics.get("eval_per_class_f1")
    if per_class:
        lines.append("  per-class F1: " + ", ".join(f"{name} {_eval_num(v)}" for name, v in per_class.items()))
    cm = metrics.get("eval_confusion_matrix")
    if cm:
        names = [str(n) for n in metrics.get("labels", range(len(cm)))]
        w = max(max(len(n) for n in names), max(len(str(x)) for row in cm for x in row), 4)
        lines.append("  confusion (rows: gold, columns: predicted)")
        lines.append("    " + " " * w + "  " + "  ".join(n.rjust(w) for n in names))
        for name, row in zip(names, cm, strict=True):
            lines.append("    " + name.rjust(w) + "  " + "  ".join(str(x).rjust(w) for x in row))
    return "\n".join(lines)


def _eval_num(v: float) -> str:
    return str(v) if isinstance(v, int) else "nan" if math.isnan(v) else f"{v:.4f}"
