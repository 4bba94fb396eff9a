"""The doctor in front of training: `surefit train` runs the checks first and refuses to start on an error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from surefit.doctor.core import Report
from surefit.errors import Problem, SurefitError


class DoctorRefused(SurefitError):
    title = "the doctor found errors; training did not start"


class DoctorOnly(Exception):
    """Raised by a task after the checks when only the doctor was asked for; carries the report."""

    def __init__(self, report: Report):
        super().__init__("doctor only")
        self.report = report


def gate(report: Report, cfg: Any, say: Callable[[str], None], out: Path | None, doctor_only: bool) -> None:
    """Print the report, save it, and stop (doctor only) or refuse to train on errors unless ``--force``."""
    say(str(report))
    if out is not None and not doctor_only:
        (out / "doctor.json").write_text(report.to_json(), encoding="utf-8")
    if doctor_only:
        raise DoctorOnly(report)
    errors = [f for f in report.findings if f.severity == "error"]
    if not errors:
        return
    if getattr(cfg, "force", False):
        say(f"--force: training despite {len(errors)} doctor error{'s' if len(errors) != 1 else ''} "
            f"({', '.join(f.code for f in errors)})")
        return
    raise DoctorRefused([Problem(f"[{f.code}] {f.message}", f.where, f.fix) for f in errors]
                        + [Problem("fix the errors above, or pass --force to train anyway", "--force")])
