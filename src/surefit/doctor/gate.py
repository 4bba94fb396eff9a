"""The doctor in front of training: `surefit train` runs the checks first and refuses to start on an error.

With several processes the doctor runs once, on the main process (the others pass ``None`` for the report), and
its verdict is shared, so every process starts training, or stops with the same exit code, together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from surefit.config import TrainConfig
from surefit.doctor.core import Finding, Report
from surefit.errors import Problem, SurefitError
from surefit.startup.cache import StartupCache
from surefit.training.processes import is_main_process, share_from_main


class DoctorRefused(SurefitError):
    title = "the doctor found errors; training did not start"


def run_doctor(make_report: Callable[[], Report]) -> Report | None:
    """``make_report()`` on the main process; ``None`` on the others (pass it to :func:`gate` either way)."""
    return make_report() if is_main_process() else None


def cached_doctor(make_report: Callable[[], Report], key: Any, cache: StartupCache, status: dict[str, str]) -> Report:
    """``make_report()``, or the report stored for ``key`` (an identical setup: see ``surefit/startup/__init__.py``).

    ``status["doctor"]`` says which it was. A stored entry that is not a report is ignored with a note.
    """
    stored = cache.get("doctor", key)
    if stored is not None:
        try:
            findings = [Finding(**f) for f in stored["findings"]]
            if all(f.severity in ("error", "warning", "info") for f in findings):
                status["doctor"] = "reused"
                return Report(findings=findings, checks_run=int(stored["checks_run"]))
        except (TypeError, KeyError, ValueError):
            pass
        cache.say("note: ignored a start-up cache entry for the doctor that is not a report; recomputing it")
    report = make_report()
    status["doctor"] = cache.status(key, False)
    cache.put("doctor", key, {"findings": [f.__dict__ for f in report.findings], "checks_run": report.checks_run})
    return report


def gate(report: Report | None, cfg: TrainConfig, say: Callable[[str], None]) -> None:
    """Print the report and refuse to train on errors unless ``--force`` (the run folder saves the report).

    ``report`` is ``None`` on a process other than the main one: it waits for the main process's verdict.
    """
    if report is None:
        verdict = share_from_main(None)
        if verdict == "refused":
            raise DoctorRefused([Problem("the main process's doctor found errors (listed in its output)", "--force")])
        return
    say(str(report))
    errors = [f for f in report.findings if f.severity == "error"]
    refused = bool(errors) and not getattr(cfg, "force", False)
    share_from_main("refused" if refused else "train")
    if not errors:
        return
    if getattr(cfg, "force", False):
        say(f"--force: training despite {len(errors)} doctor error{'s' if len(errors) != 1 else ''} "
            f"({', '.join(f.code for f in errors)})")
        return
    raise DoctorRefused([Problem(f"[{f.code}] {f.message}", f.where, f.fix) for f in errors]
                        + [Problem("fix the errors above, or pass --force to train anyway", "--force")])
