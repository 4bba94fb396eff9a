"""CSV and TSV: the header, cell counts and quoting checked record by record."""

from __future__ import annotations

import csv
import io
import sys
from typing import Any, Literal

from surefit.data.readers.common import ICONV_FIX, MAX_HEADER_NAME, CappedProblems, Rejected, clip_raw, short
from surefit.data.readers.text import DecodedText, oversize_bytes, too_big_what
from surefit.data.rows import Row
from surefit.errors import Problem

# --- CSV / TSV ----------------------------------------------------------------------------------------------------


def read_delimited(
    decoded: DecodedText, source: str, delimiter: str, problems: list[Problem], rejects: list[Rejected] | None = None
) -> list[Row] | None:
    trial: list[Problem] = []
    trial_rejects: list[Rejected] | None = [] if rejects is not None else None
    rows, issues = _parse_delimited(decoded, source, delimiter, csv.QUOTE_MINIMAL, trial, trial_rejects)
    if issues and delimiter == "\t":
        # Many TSVs (GLUE among them) never quote, and a sentence opening with '"' is text, not a quoted field.
        # If the file only parses as unquoted, it was written unquoted. Both modes decide alike: rows rejected for
        # their bytes are rejected either way, so only the parse's own complaints count.
        unquoted: list[Problem] = []
        unquoted_rejects: list[Rejected] | None = [] if rejects is not None else None
        plain, unquoted_issues = _parse_delimited(
            decoded, source, delimiter, csv.QUOTE_NONE, unquoted, unquoted_rejects
        )
        if not unquoted_issues:
            if rejects is not None and unquoted_rejects is not None:
                rejects.extend(unquoted_rejects)
            return plain
    problems.extend(trial)
    if rejects is not None and trial_rejects is not None:
        rejects.extend(trial_rejects)
    return rows


def _parse_delimited(
    decoded: DecodedText,
    source: str,
    delimiter: str,
    quoting: Literal[0, 1, 2, 3],
    problems: list[Problem],
    rejects: list[Rejected] | None,
) -> tuple[list[Row] | None, int]:
    """Parse one way; returns the rows and how many problems or rejects the parse itself caused (bytes aside)."""
    text = decoded.text
    # strict=True: an unclosed quote otherwise silently swallows the rest of the file into one cell.
    # newline="\n": physical lines split on '\n' only, so line numbers agree with editors and the UTF-8 check.
    reader = csv.reader(
        io.StringIO(text, newline="\n"), delimiter=delimiter, quoting=quoting, strict=quoting != csv.QUOTE_NONE
    )
    kind = "CSV" if delimiter == "," else "TSV"
    # Long documents in one cell are normal for fine-tuning data; the csv default of 128 KiB per cell is not.
    old_limit = csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    rows: list[Row] = []
    before = len(problems)
    encoding_rejects = 0
    wrong_count = CappedProblems(problems, source, "lines", rejects)
    too_big = CappedProblems(problems, source, "lines", rejects)
    lines: list[str] = []
    spanning: list[tuple[int, int, int]] = []  # (row position, first line, last line) of records with line breaks

    def raw(first: int, last: int) -> str:
        # Split only when a row is rejected: most files have none, and a copy of every line costs memory.
        if not lines:
            lines.extend(text.split("\n"))
        return "\n".join(lines[first - 1 : last])

    try:
        header: list[str] | None = None
        last_line = 0
        for record in reader:
            first_line, last_line = last_line + 1, reader.line_num
            if not record or (len(record) == 1 and not record[0].strip()):
                continue
            where = f"{source} line {first_line}"
            bad_at = None
            if decoded.bad_lines:
                bad_at = next((n for n in range(first_line, last_line + 1) if n in decoded.bad_lines), None)
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
                if bad_at != first_line:
                    reason += f" (line {bad_at}, inside this record)"
                if first_line != last_line:
                    raw_line = clip_raw(raw(first_line, last_line))
                assert rejects is not None  # bad_lines is only filled in skip mode
                rejects.append(Rejected(where, reason, raw_line))
                encoding_rejects += 1
                continue
            size = oversize_bytes(record)
            if size is not None:
                too_big.add(
                    Problem(
                        too_big_what(f"the record at line {first_line}", size),
                        where=where,
                        fix="split the text into smaller rows, or remove the record",
                    ),
                    raw=clip_raw(raw(first_line, last_line)),
                )
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
                    raw=clip_raw(raw(first_line, last_line)),
                )
                continue
            if first_line != last_line:
                spanning.append((len(rows), first_line, last_line))
            rows.append(Row(fields=dict(zip(header, record, strict=True)), where=where, index=len(rows)))
    except csv.Error as e:
        # The record that failed began after the last one read: that is where its quote opened.
        start = last_line + 1
        stopped = f" (reading stopped at line {reader.line_num})" if reader.line_num != start else " (reading stopped here)"
        opened = (f"; the quote that opened at line {start} is never closed" if "end of data" in str(e) else "")
        problems.append(
            Problem(
                f"malformed {kind}: {e}{opened}{stopped}",
                where=f"{source} line {start}",
                fix=_cell_fix(kind),
            )
        )
    finally:
        csv.field_size_limit(old_limit)
    if header is not None and quoting != csv.QUOTE_NONE:
        rows = _stray_quotes(rows, spanning, len(header), delimiter, raw, source, kind, problems, rejects)
    wrong_count.close()
    too_big.close()
    # In skip mode the row complaints went to rejects; they still mean this way of parsing fits the file less well.
    issues = len(problems) - before + (wrong_count.count + too_big.count if rejects is not None else 0)
    return rows, issues


def _stray_quotes(rows: list[Row], spanning: list[tuple[int, int, int]], n_columns: int, delimiter: str, raw: Any,
                  source: str, kind: str, problems: list[Problem], rejects: list[Rejected] | None) -> list[Row]:
    """Records that hold line breaks in a file where such records are rare (at most 5% of 20 or more), and whose inner
    lines read alone as whole rows: a stray quote merged those lines into one record. Each is a problem (or, with
    --on_bad_rows skip, a rejected record) named at the line where the quote opened, instead of silently fewer rows.
    """
    if not spanning or n_columns < 2 or len(rows) < 20 or len(spanning) > 0.05 * len(rows):
        return rows
    dropped = set()
    for position, first, last in spanning:
        inner = raw(first, last).split("\n")[1:]
        looks_like_rows = [first + 1 + i for i, line in enumerate(inner[:-1]) if len(line.split(delimiter)) == n_columns]
        if not looks_like_rows:
            continue
        shown = ", ".join(map(str, looks_like_rows[:5])) + (" ..." if len(looks_like_rows) > 5 else "")
        problem = Problem(
            f"a quote opened at line {first} closes only at line {last}: lines {first}-{last} were read as one record, "
            f"though line{'s' if len(looks_like_rows) > 1 else ''} {shown} look{'' if len(looks_like_rows) > 1 else 's'}"
            f" like rows of their own, and no other record of the file spans lines (a stray '\"'?)",
            where=f"{source} line {first}",
            fix=f"remove the stray quote, or write a quote inside a cell as \"\" within a quoted cell; a {kind} cell "
                "that really spans lines must be quoted whole",
        )
        if rejects is not None:
            rejects.append(Rejected(problem.where, problem.what, clip_raw(raw(first, last))))
        else:
            problems.append(problem)
        dropped.add(position)
    if not dropped:
        return rows
    kept = [r for i, r in enumerate(rows) if i not in dropped]
    return [Row(fields=r.fields, where=r.where, index=i) for i, r in enumerate(kept)]


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
