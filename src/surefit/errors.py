"""Errors a user can cause, collected and reported together.

Every user-facing error is a list of :class:`Problem` s, each saying what happened, the offending value, where
(file and row, flag, column) and the fix. Code that validates appends problems and raises once at the end, so a
user fixes everything in one pass instead of one crash per run (torchtune's ``ConfigError``, litgpt's
``validate_args``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input.

    Attributes:
        what: what happened, including the offending value.
        where: where it is: ``"train.jsonl row 17"``, ``"--epochs"``, ``"column 'label'"``; may be empty.
        fix: what the user should do, in their terms; may be empty.
    """

    what: str
    where: str = ""
    fix: str = ""

    def render(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        text = text.replace("\n", "\n     ")  # continuation lines stay under their number
        if self.fix:
            text += f"\n     fix: {self.fix}"
        return text


class SurefitError(Exception):
    """Base class for errors the user can fix. The CLI prints them without a traceback and exits with ``exit_code``."""

    exit_code = 2
    title = "surefit found problems"

    def __init__(self, problems: list[Problem] | Problem | str):
        if isinstance(problems, str):
            problems = [Problem(problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        # Rows dropped under --on_bad_rows skip before the problems were found: the run folder lists them.
        self.rejected: list[Any] = []
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.title} ({n} problem{'s' if n != 1 else ''}):"
        lines = [head] + [f"  {i}. {p.render()}" for i, p in enumerate(self.problems, 1)]
        return "\n".join(lines)


class ConfigError(SurefitError):
    title = "configuration error"


class DataError(SurefitError):
    title = "data error"


class ModelError(SurefitError):
    title = "model error"


def raise_if(problems: list[Problem], error_type: type[SurefitError] = SurefitError) -> None:
    """Raise ``error_type`` with every collected problem, if there are any."""
    if problems:
        raise error_type(problems)


# Flags whose problems are not about the data; a report holding one is titled generically, not "data error".
_NOT_DATA = ("--model", "--output_dir", "--resume", "--head", "--overwrite", "--quantize")


def raise_input_problems(problems: list[Problem]) -> None:
    """Raise the problems found while checking a run's inputs (data, model, run folder) as one report."""
    if problems:
        not_data = any(p.where.startswith(_NOT_DATA) for p in problems)
        raise (SurefitError if not_data else DataError)(problems)


def raise_with_rejected(problems: list[Problem], rejected: list[Any]) -> None:
    """:func:`raise_input_problems`, the error carrying the rows rejected so far (``--on_bad_rows skip``), so that the
    run folder lists them and "all rows rejected" points at a list that exists."""
    try:
        raise_input_problems(problems)
    except SurefitError as e:
        e.rejected = list(rejected)
        raise
