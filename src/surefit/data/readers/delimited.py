"""CSV and TSV: the header, cell counts and quoting checked record by record."""

from __future__ import annotations

import csv
from typing import Any, Literal

from surefit.data.readers.common import (
    ICONV_FIX,
    MAX_HEADER_NAME,
    MAX_ROW_BYTES,
    CappedProblems,
    Rejected,
    clip_raw,
    short,
)
from surefit.data.readers.text import TextFile, too_big_what
from surefit.data.rows import Row
from surefit.errors import Problem

# --- CSV / TSV ----------------------------------------------------------------------------------------------------


def read_delimited(
    decoded: TextFile, source: str, delimiter: str, problems: list[Problem], rejects: list[Rejected] | None = None,
    limit: int | None = None,
) -> list[Row] | None:
    trial: list[Problem] = []
    collect = rejects is not None  # skip mode: rejected rows are kept, each parse into its own list first
    trial_rejects: list[Rejected] = []
    rows, issues = _parse_delimited(decoded, source, delimiter, csv.QUOTE_MINIMAL, trial,
                                    trial_rejects if collect else None, limit)
    if issues and delimiter == "\t":
        # Many TSVs (GLUE among them) never quote, and a sentence opening with '"' is text, not a quoted field.
        # If the file only parses as unquoted, it was written unquoted. Both modes decide alike: rows rejected for
        # their bytes are rejected either way, so only the parse's own complaints count.
        unquoted: list[Problem] = []
        unquoted_rejects: list[Rejected] = []
        plain, unquoted_issues = _parse_delimited(
            decoded, source, delimiter, csv.QUOTE_NONE, unquoted, unquoted_rejects if collect else None, limit
        )
        if not unquoted_issues:
            if rejects is not None:
                rejects.extend(unquoted_rejects)
            return plain
    problems.extend(trial)
    if rejects is not None:
        rejects.extend(trial_rejects)
    return rows


def _parse_delimited(
    decoded: TextFile,
    source: str,
    delimiter: str,
    quoting: Literal[0, 1, 2, 3],  # csv.QUOTE_MINIMAL or csv.QUOTE_NONE
    problems: list[Problem],
    rejects: list[Rejected] | None,
    limit: int | None = None,
) -> tuple[list[Row] | None, int]:
    """Parse one way; returns the rows and how many problems or rejects the parse itself caused (bytes aside)."""
    # The lines of the record being parsed: csv reads one line at a time, exactly up to the end of a record.
    current: list[tuple[int, str]] = []

    def feed() -> Any:
        for n, line in decoded.lines():
            current.append((n, line))
            # An oversized line goes in as a blank line (its head could open a quote that swallows what follows);
            # the record holding it is refused by size below.
            yield "\n" if n in decoded.oversized else line

    # strict=True: an unclosed quote otherwise silently swallows the rest of the file into one cell.
    reader = csv.reader(feed(), delimiter=delimiter, quoting=quoting, strict=quoting != csv.QUOTE_NONE)
    kind = "CSV" if delimiter == "," else "TSV"
    # A cell may hold a long document, but not more than a row may (an unclosed quote would otherwise gather the
    # rest of a big file into one cell in memory).
    old_limit = csv.field_size_limit(MAX_ROW_BYTES)
    rows: list[Row] = []
    before = len(problems)
    wrong_count = CappedProblems(problems, source, "lines", rejects)
    too_big = CappedProblems(problems, source, "lines", rejects)
    merged = CappedProblems(problems, source, "records", rejects)
    spanning: list[tuple[int, list[tuple[int, str]], _Raw]] = []  # (row position, lines, raw) of records with breaks
    profile = _Columns()

    try:
        header: list[str] | None = None
        last_line = 0
        for record in reader:
            lines = current.copy()
            current.clear()
            first_line, last_line = lines[0][0] if lines else last_line + 1, reader.line_num
            # The record's text, built only for a record that is rejected or reported (most are neither).
            raw = _Raw(lines)
            where = f"{source} line {first_line}"
            over = next((n for n, _ in lines if n in decoded.oversized), None) if decoded.oversized else None
            if over is not None and header is not None:
                too_big.add(
                    Problem(
                        too_big_what(f"the record at line {first_line}", decoded.oversized[over]),
                        where=where,
                        fix="split the text into smaller rows, or remove the record",
                    ),
                    raw=str(raw),
                )
                continue
            if not record or (len(record) == 1 and not record[0].strip()):
                continue
            bad_at = next((n for n, _ in lines if n in decoded.bad_lines), None) if decoded.bad_lines else None
            if header is None:
                if bad_at is not None:
                    # Column names with replaced bytes would match no field; the header is the file's, not a row's.
                    problems.append(
                        Problem(
                            "the header line "
                            + decoded.bad_lines[bad_at][0].replace("not valid UTF-8:", "is not valid UTF-8:", 1),
                            where=f"{source} line {bad_at}",
                            fix=ICONV_FIX,
                        )
                    )
                    return None, len(problems) - before
                header = _header(record, source, first_line, kind, problems)
                if header is None:
                    return None, len(problems) - before
                continue
            if bad_at is not None:
                reason, raw_line = decoded.bad_lines[bad_at]
                assert rejects is not None  # bad_lines is only filled in skip mode, which collects rejects
                if bad_at != first_line:
                    reason += f" (line {bad_at}, inside this record)"
                rejects.append(Rejected(where, reason, str(raw) if first_line != last_line else raw_line))
                continue
            if len(record) != len(header):
                spans = (f" (a quote opened at line {first_line} closes at line {last_line}: lines {first_line}-"
                         f"{last_line} were read as one record)" if first_line != last_line else "")
                wrong_count.add(
                    Problem(
                        f"expected {len(header)} cells (as in the header) but got {len(record)}{spans}",
                        where=where,
                        fix=_cell_fix(kind),
                    ),
                    raw=str(raw),
                )
                continue
            if first_line != last_line and quoting != csv.QUOTE_NONE:
                spanning.append((len(rows), lines, raw))
            elif len(record) > 1 and profile.rows < _Columns.MAX_ROWS:
                profile.add(record)
            rows.append(Row(fields=dict(zip(header, record, strict=True)), where=where, index=len(rows)))
            if limit is not None and len(rows) >= limit:
                break
    except csv.Error as e:
        # The record that failed began after the last one read: that is where its quote opened.
        start = last_line + 1
        stopped = f" (reading stopped at line {reader.line_num})" if reader.line_num != start else " (reading stopped here)"
        opened = (f"; the quote that opened at line {start} is never closed" if "end of data" in str(e) else "")
        what = f"malformed {kind}: {e}{opened}{stopped}"
        if "field larger than field limit" in str(e):
            what = (f"a cell that starts in the record at line {start} grows past {MAX_ROW_BYTES // 2**20} MiB (a quote "
                    f"that is never closed?){stopped}")
        problems.append(Problem(what, where=f"{source} line {start}", fix=_cell_fix(kind)))
    finally:
        csv.field_size_limit(old_limit)
    if spanning:
        dropped = set()
        for position, lines, raw in spanning:
            stray = _stray_quote(lines, header or [], profile, delimiter, source, kind)
            if stray is not None:
                merged.add(stray, raw=str(raw))
                dropped.add(position)
        if dropped:
            kept = [r for i, r in enumerate(rows) if i not in dropped]
            rows = [Row(fields=r.fields, where=r.where, index=i) for i, r in enumerate(kept)]
    wrong_count.close()
    too_big.close()
    merged.close()
    # In skip mode the row complaints went to rejects; they still mean this way of parsing fits the file less well.
    issues = len(problems) - before + (
        wrong_count.count + too_big.count + merged.count if rejects is not None else 0)
    return rows, issues


class _Raw:
    """A record's text from its lines, made when first asked for (``str``)."""

    __slots__ = ("lines",)

    def __init__(self, lines: list[tuple[int, str]]) -> None:
        self.lines = lines

    def __str__(self) -> str:
        return clip_raw("".join(text for _, text in self.lines).removesuffix("\n")) or ""


class _Columns:
    """What the one-line records show of each column: a column whose values are all numbers, or a few values that
    repeat (labels), constrains what a line can hold in it."""

    _MAX_VALUES = 20
    MAX_ROWS = 10_000  # enough to know a column; the rest of a big file is not profiled

    def __init__(self) -> None:
        self.rows = 0
        self.values: dict[int, dict[str, int] | None] = {}
        self.numeric: dict[int, bool] = {}

    def add(self, record: list[str]) -> None:
        self.rows += 1
        for i, cell in enumerate(record):
            cell = cell.strip()
            self.numeric[i] = self.numeric.get(i, True) and _is_number(cell)
            seen = self.values.get(i, {})
            if seen is not None:
                seen[cell] = seen.get(cell, 0) + 1
                self.values[i] = seen if len(seen) <= self._MAX_VALUES and len(cell) <= 32 else None

    def constrained(self) -> list[int]:
        if self.rows < 2:
            return []
        return [i for i in self.numeric if self.numeric[i] or self._labels(i) is not None]

    def _labels(self, i: int) -> set[str] | None:
        seen = self.values.get(i)
        # Labels repeat: on average each value comes back, or the column is text that happens to be short.
        return set(seen) if seen is not None and self.rows >= 2 * len(seen) else None

    def fits(self, cells: list[str]) -> bool:
        for i in self.constrained():
            cell = cells[i].strip()
            labels = self._labels(i)
            if not ((self.numeric[i] and _is_number(cell)) or (labels is not None and cell in labels)):
                return False
        return True


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _stray_quote(lines: list[tuple[int, str]], header: list[str], columns: _Columns, delimiter: str, source: str,
                 kind: str) -> Problem | None:
    """A record read over several lines whose lines read alone as whole rows: a stray quote merged them.

    Decided by the record and what the file's one-line records show of the columns, never by the file's size or by
    how many records span lines. A line reads as a row when, with its quotes taken as text, it has one cell per
    column and each cell fits its column (a number column holds a number, a label column one of its labels). A
    record is merged when every line inside it reads as a row and its first and last lines do too, or when two or
    more lines inside do; a two-line record needs a column that constrains it, else it is read as a cell that spans
    lines. A cell that really spans lines leaves its lines with other cell counts or values that fit no column.
    """
    n_columns = len(header)
    if n_columns < 2:
        return None

    def whole_row(text: str) -> bool:
        cells = text.rstrip("\r\n").split(delimiter)
        return len(cells) == n_columns and columns.fits(cells)

    first, last = lines[0][0], lines[-1][0]
    inner = [n for n, text in lines[1:-1] if whole_row(text)]
    if len(inner) != len(lines) - 2:
        return None
    ends = whole_row(lines[0][1]) and whole_row(lines[-1][1])
    if not ((ends and (inner or columns.constrained())) or len(inner) >= 2):
        return None
    looks = inner or [first, last]
    shown = ", ".join(map(str, looks[:5])) + (" ..." if len(looks) > 5 else "")
    return Problem(
        f"a quote opened at line {first} closes only at line {last}: lines {first}-{last} were read as one record, "
        f"though line{'s' if len(looks) > 1 else ''} {shown} look{'' if len(looks) > 1 else 's'} like "
        f"{'rows of their own' if len(looks) > 1 else 'a row of its own'} (a stray '\"'?)",
        where=f"{source} line {first}",
        fix=f"remove the stray quote, or write a quote inside a cell as \"\" within a quoted cell; a {kind} cell "
            "that really spans lines must be quoted whole",
    )


def _header(record: list[str], source: str, line: int, kind: str, problems: list[Problem]) -> list[str] | None:
    names = [cell.strip() for cell in record]
    if not any(names):
        problems.append(
            Problem(
                f"empty header: the first line of a {kind} file must name the columns",
                where=f"{source} line {line}",
                fix="add a header line naming the columns, e.g. input,target",
            )
        )
        return None
    # A file without a header would silently lose its first row to column names; sentence-length names give it away.
    long_names = [name for name in names if len(name) > MAX_HEADER_NAME]
    if long_names:
        problems.append(
            Problem(
                f"the first line looks like data, not a header: a column would be named {short(long_names[0])!r}",
                where=f"{source} line {line}",
                fix=f"add a header line naming the columns as the first line, e.g. {_example_header(len(names), kind)}",
            )
        )
        return None
    # An unnamed column is usually a saved pandas index; name it as pandas does instead of failing.
    names = [name or f"Unnamed: {i}" for i, name in enumerate(names)]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(
            Problem(
                f"duplicate column names in the header: {', '.join(repr(d) for d in duplicates)}",
                where=f"{source} line {line}",
                fix="give every column a different name",
            )
        )
        return None
    return names


def _example_header(n_columns: int, kind: str) -> str:
    names = ["input", "target"] if n_columns == 2 else [f"col{i}" for i in range(1, n_columns + 1)]
    return ("," if kind == "CSV" else "<TAB>").join(names)


def _cell_fix(kind: str) -> str:
    if kind == "TSV":
        return "every line needs one cell per header column; a tab or line break inside a cell must be quoted"
    return (
        "every line needs one cell per header column; quote cells holding commas, quotes or line breaks "
        '("...", with inner quotes doubled ""), e.g. write the file with pandas.to_csv or Python\'s csv module'
    )
