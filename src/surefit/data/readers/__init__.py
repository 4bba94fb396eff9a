"""Read a data source (JSONL, JSON, SQuAD, CSV, TSV, Parquet, a saved ``datasets`` folder) into :class:`Row` s.

Readers never raise for something the user can fix: they append :class:`Problem` s, each naming the file and line
(or item, row, question id) and the fix, so one run reports everything wrong with a file. Every row keeps where it
came from, so later stages can point at the exact line.

Problems are of two levels. A file-level problem (missing file, binary file, unreadable JSON document, broken CSV
quoting) means the file as a whole cannot be trusted and is always a :class:`Problem`. A row-level problem (one bad
line, item, record or field value) is a :class:`Problem` by default (``--on_bad_rows error``); when the caller passes
a ``rejects`` list (``--on_bad_rows skip``) each bad row becomes one :class:`Rejected` there instead and is left out,
so nothing is dropped without being reported.
"""

from __future__ import annotations

from pathlib import Path

from surefit.data.readers.common import (
    MAX_ROW_BYTES,
    MAX_WHERES,
    SKIP_HINT,
    SUPPORTED_FORMATS,
    CountedNote,
    Rejected,
    merge_counted,
)
from surefit.data.readers.fields import check_text_fields, field_not_found
from surefit.data.readers.files import read_rows
from surefit.data.readers.squad import flatten_squad
from surefit.data.rows import Row
from surefit.errors import Problem


def read_splits(data: str, val_data: str | None, limit: int | None, problems: list[Problem],
                rejects: list[Rejected] | None, notes: list[str]) -> dict[str, list[Row]]:
    """``{"train": rows, "validation": rows}`` (validation only when a file is given), each cut to ``limit`` rows.

    A cut is noted in ``notes`` (never silent); every problem of both files goes to ``problems``.
    """
    loaded: dict[str, list[Row]] = {}
    for name, path in (("train", data), ("validation", val_data)):
        if path is not None:
            loaded[name] = read_limited(path, limit, problems, rejects, notes)
    return loaded


def read_limited(path: str, limit: int | None, problems: list[Problem], rejects: list[Rejected] | None,
                 notes: list[str]) -> list[Row]:
    """One file of :func:`read_splits`: its rows, cut to ``limit`` (the cut noted in ``notes``)."""
    # A line-based file is read no further than one row past the limit, so a part of a file too big for memory
    # can be trained on; a document (.json, Parquet) is read whole, and its size told.
    rows = read_rows(path, problems, rejects=rejects, limit=None if limit is None else limit + 1)
    if limit is not None and len(rows) > limit:
        notes.append(limit_note(path, limit, None if Path(path).suffix.lower() in {".jsonl", ".ndjson", ".csv", ".tsv"}
                                else len(rows)))
        rows = rows[:limit]
    return rows


def limit_note(path: str, limit: int, rows: int | None) -> str:
    """The note of a file cut by ``--limit``: ``rows`` read in all (a document), ``None`` for a streamed file (the rest
    is not read)."""
    if rows is None:
        return f"--limit {limit}: using the first {limit} rows of {path} (it holds more; the rest is not read)"
    return f"--limit {limit}: using the first {limit} of {rows} rows of {path}"


def read_checked(path: str, text_fields: list[tuple[str, str]]) -> list[Row]:
    """Every row of ``path`` with each of ``text_fields`` (``(field, flag)``) checked, for a command that must give
    every row a result (``surefit eval --data``, ``predict --file``): no row is skipped, so the readers' hint about
    ``--on_bad_rows skip`` (a training flag) is left out. Raises every problem at once, each with file and line."""
    import dataclasses

    from surefit.errors import raise_input_problems

    problems: list[Problem] = []
    rows = read_rows(path, problems)
    if rows:
        rows, _ = check_text_fields(rows, text_fields, problems, str(path))
    raise_input_problems([dataclasses.replace(p, fix=p.fix.replace(f"; {SKIP_HINT}", "").replace(SKIP_HINT, ""))
                          for p in problems])
    return rows


__all__ = ["MAX_ROW_BYTES", "MAX_WHERES", "SUPPORTED_FORMATS", "CountedNote", "Rejected", "merge_counted", "check_text_fields", "field_not_found",
           "flatten_squad", "limit_note", "read_checked", "read_limited", "read_rows", "read_splits"]
