"""Shared by the readers: limits, the record of a rejected row, and small helpers for messages."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

from surefit.data.rows import Row
from surefit.errors import Problem

SUPPORTED_FORMATS = (
    "JSONL (.jsonl), JSON (.json, a list of objects or SQuAD format), CSV (.csv), TSV (.tsv), Parquet (.parquet), "
    "a saved `datasets` folder (save_to_disk)"
)

# Past this many problems of one kind the rest of the file almost always has the same cause; one summary line
# keeps the report readable while still saying how much is affected.
MAX_PROBLEMS_PER_KIND = 20
# How many row locations one aggregated problem lists before saying "and N more".
MAX_WHERES = 10

# A row this large is not a training example (it would be tokenized for minutes and then truncated); refusing it
# keeps one stray dump line from stalling or exhausting the run.
MAX_ROW_BYTES = 16 * 2**20
# Rejected rows keep this much of their text: enough to find and fix the row, small enough for a report file.
MAX_RAW_CHARS = 2000

JSONL_EXTS = {".jsonl", ".ndjson"}
DATA_EXTS = JSONL_EXTS | {".json", ".csv", ".tsv", ".parquet"}
KIND_OF_EXT = {".jsonl": "JSONL", ".ndjson": "JSONL", ".json": "JSON", ".csv": "CSV", ".tsv": "TSV"}
SKIP_HINT = "or pass --on_bad_rows skip to drop such rows (they are written to rejected_rows.jsonl)"
# Binary sniffing looks at the start of the file only, as git and file(1) do: a text file does not turn binary later.
SNIFF_BYTES = 8192
MAX_CONTROL_SHARE = 0.3
# Control bytes never found in text files (tab, line feed, carriage return, form feed, vertical tab, backspace and
# escape do occur in real text).
CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\f\v\b\x1b") + b"\x7f"
BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32", "little-endian"),
    (b"\x00\x00\xfe\xff", "UTF-32", "big-endian"),
    (b"\xff\xfe", "UTF-16", "little-endian"),
    (b"\xfe\xff", "UTF-16", "big-endian"),
)
UTF8_BOM = b"\xef\xbb\xbf"
ICONV_FIX = "re-save the file as UTF-8 (for example: iconv -f latin1 -t utf-8 IN > OUT)"
JSONL_FIX = 'make every line one JSON object, e.g. {"input": "...", "target": "..."} (write each line with json.dumps)'
# Column names longer than this are sentences: the file has no header line.
MAX_HEADER_NAME = 64
SQUAD_SHAPE = "data[].paragraphs[].{context, qas[].{id, question, answers[].text}}"


@dataclass(frozen=True)
class Rejected:
    """One row left out under ``--on_bad_rows skip``, with why; written to ``rejected_rows.jsonl``.

    Attributes:
        where: the row's location, e.g. ``"data/train.jsonl line 7"``.
        reason: what is wrong with it, in the words the matching :class:`Problem` would use.
        raw: the row's text as found (the line, record or JSON item), cut to 2,000 characters; ``None`` when the row
            has no text of its own.
    """

    where: str
    reason: str
    raw: str | None = None

    def to_json(self) -> dict:
        """The record written as one line of ``rejected_rows.jsonl``."""
        return {"where": self.where, "reason": self.reason, "raw": self.raw}


@overload
def clip_raw(raw: str) -> str: ...
@overload
def clip_raw(raw: None) -> None: ...
def clip_raw(raw: str | None) -> str | None:
    return raw if raw is None or len(raw) <= MAX_RAW_CHARS else raw[:MAX_RAW_CHARS]


def raw_json(value: Any) -> str | None:
    try:
        return clip_raw(json.dumps(value, ensure_ascii=False, default=str))
    except (ValueError, RecursionError):  # nested near the recursion limit: the reason and location still say enough
        return None


def with_hint(fix: str) -> str:
    return f"{fix}; {SKIP_HINT}" if fix else SKIP_HINT


class CappedProblems:
    """Collects row-level problems of one kind for one file.

    In ``error`` mode (``rejects`` is None) it keeps the first few problems and counts the rest, and tells the user
    about ``--on_bad_rows skip``. In ``skip`` mode every bad row becomes a :class:`Rejected`, uncapped: a rejected
    row that is not listed would be a silently dropped row.
    """

    def __init__(self, problems: list[Problem], source: str, unit: str, rejects: list[Rejected] | None = None):
        self.problems = problems
        self.source = source
        self.unit = unit
        self.rejects = rejects
        self.count = 0
        self.fix = ""

    def add(self, problem: Problem, raw: str | None = None) -> None:
        self.count += 1
        if self.rejects is not None:
            self.rejects.append(Rejected(problem.where, problem.what, clip_raw(raw)))
            return
        problem = Problem(problem.what, where=problem.where, fix=with_hint(problem.fix))
        self.fix = problem.fix
        if self.count <= MAX_PROBLEMS_PER_KIND:
            self.problems.append(problem)

    def close(self) -> None:
        extra = self.count - MAX_PROBLEMS_PER_KIND
        if extra > 0 and self.rejects is None:
            self.problems.append(
                Problem(f"... and {extra} more {self.unit} with the same problem", where=self.source, fix=self.fix)
            )


def all_rejected_problem(source: str, n: int, first: Rejected) -> Problem:
    return Problem(
        f"no usable rows in {source}: all {n} row{'s' if n != 1 else ''} rejected (see rejected_rows.jsonl)",
        fix=f"fix the rejected rows (the first: {first.where}: {first.reason})",
    )


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def n_rows(n: int) -> str:
    return f"{n} row{'s' if n != 1 else ''}"


def have(n: int) -> str:
    return "has" if n == 1 else "have"


def wheres(rows: list[Row], source: str) -> str:
    # The problem's `where` already names the source, so each location drops it: "line 3" not "data.csv line 3".
    prefix = f"{source} "
    shown = [r.where[len(prefix) :] if r.where.startswith(prefix) else r.where for r in rows[:MAX_WHERES]]
    more = f" and {len(rows) - MAX_WHERES} more" if len(rows) > MAX_WHERES else ""
    return ", ".join(shown) + more




@dataclass
class CountedNote:
    """A note that counts rows over a file, with what a file read in chunks needs to add the chunks' counts up into
    the text one read over all rows gives (:func:`merge_counted`).

    Attributes:
        order: where the note stands among a file's notes (stage, then field), whichever chunk first has it.
        rows: rows counted.
        render: the text for a count of rows out of the rows kept (the first chunk's example kept).
    """

    order: tuple[int, int]
    rows: int
    render: Callable[[int, int], str]


def merge_counted(chunks: list[list[CountedNote]], kept: int) -> list[str]:
    """The notes of one read over all the chunks' rows, ``kept`` of them kept: counts summed per note, the first
    chunk's example kept, in the order one read gives them."""
    first: dict[tuple[int, int], CountedNote] = {}
    count: dict[tuple[int, int], int] = {}
    for notes in chunks:
        for n in notes:
            first.setdefault(n.order, n)
            count[n.order] = count.get(n.order, 0) + n.rows
    return [first[k].render(count[k], kept) for k in sorted(first)]
