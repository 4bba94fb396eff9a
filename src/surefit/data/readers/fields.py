"""The text fields a task reads: present, non-null, text; every bad row listed with its line."""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any

from surefit.data.readers.common import (
    CountedNote,
    Rejected,
    all_rejected_problem,
    have,
    n_rows,
    raw_json,
    short,
    wheres,
    with_hint,
)
from surefit.data.rows import Row
from surefit.errors import Problem

# --- field checks -------------------------------------------------------------------------------------------------


def check_text_fields(
    rows: list[Row],
    fields: list[tuple[str, str]],
    problems: list[Problem],
    source: str,
    *,
    rejects: list[Rejected] | None = None,
    counted: list[CountedNote] | None = None,
) -> tuple[list[Row], list[str]]:
    """Check that every row has each field with a non-empty string value.

    Numbers are converted to text (a numeric label such as ``1912`` is a common, harmless case) and reported in
    ``notes``; missing fields, nulls, empty strings and other types (lists, objects, booleans) are problems.

    Args:
        rows: rows from :func:`read_rows`.
        fields: ``(field_name, flag_name)`` pairs, e.g. ``[("input", "--input_field"), ("target", "--target_field")]``;
            the flag is named in fixes so the user knows which option to change.
        problems: every problem found is appended here.
        source: the data source as shown in messages (usually its path).
        rejects: ``None`` (``--on_bad_rows error``): bad rows are problems. A list (``--on_bad_rows skip``): each bad
            row is appended here once, with every reason, instead. Either way a field missing from every row is a
            problem (the flag is wrong, not the rows), and so is a source whose every row was rejected.
        counted: where given, each note also goes here with its count (a file read in chunks adds them up).

    Returns:
        ``(rows, notes)``: the rows with no problem in any checked field, numeric values converted to strings, and
        one human note per field that had numbers converted.
    """
    notes: list[str] = []
    bad: set[int] = set()
    reasons: dict[int, list[str]] = {}
    converted: dict[int, dict[str, str]] = {}
    present: list[str] | None = None
    # A field missing from every row is a wrong flag: the rows it drops are covered by that problem.
    explained = False
    for field_at, (field, flag) in enumerate(fields):
        missing: list[Row] = []
        null: list[Row] = []
        empty: list[Row] = []
        wrong: dict[str, list[Row]] = {}
        numeric: list[tuple[Row, Any]] = []
        why: list[tuple[int, str]] = []
        missing_at: list[int] = []
        for position, row in enumerate(rows):
            if field not in row.fields:
                missing.append(row)
                missing_at.append(position)
                bad.add(position)
                continue
            value = row.fields[field]
            if isinstance(value, str):
                if not value.strip():
                    empty.append(row)
                    bad.add(position)
                    why.append((position, f"'{field}' is empty or whitespace-only"))
            elif value is None or is_nan(value):
                # NaN is how pandas writes a missing cell; str() would turn it into the text "nan".
                null.append(row)
                bad.add(position)
                why.append((position, f"'{field}' is null"))
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                numeric.append((row, value))
                converted.setdefault(position, {})[field] = str(value)
            else:
                type_name = _value_type(value)
                wrong.setdefault(type_name, []).append(row)
                bad.add(position)
                why.append((position, f"'{field}' is a {type_name}, not text"))

        if rows and len(missing) == len(rows):
            if present is None:
                present = sorted({name for row in rows for name in row.fields})
            problems.append(field_not_found(field, flag, present, source))
            explained = True
            continue
        if numeric:
            first_row, first_value = numeric[0]
            example = f"(e.g. {first_row.where}: {first_value!r} -> {str(first_value)!r})"

            def numeric_note(count: int, _: int, field: str = field, example: str = example) -> str:
                return f"{n_rows(count)} had a numeric '{field}'; converted to text {example}"

            notes.append(numeric_note(len(numeric), len(rows)))
            if counted is not None:
                counted.append(CountedNote((0, field_at), len(numeric), numeric_note))
        if rejects is not None:
            for position, reason in why + [(position, f"no '{field}' field") for position in missing_at]:
                reasons.setdefault(position, []).append(reason)
            continue
        if missing:
            problems.append(
                Problem(
                    f"{len(missing)} of {len(rows)} rows {have(len(missing))} no '{field}' field: {wheres(missing, source)}",
                    where=source,
                    fix=with_hint(f"add '{field}' to these rows or remove them"),
                )
            )
        if null or empty:
            parts = []
            if null:
                parts.append(f"{len(null)} null")
            if empty:
                parts.append(f"{len(empty)} empty or whitespace-only")
            listed = sorted(null + empty, key=lambda r: r.index)
            problems.append(
                Problem(
                    f"{n_rows(len(listed))} {have(len(listed))} a null or empty '{field}' ({', '.join(parts)}): {wheres(listed, source)}",
                    where=source,
                    fix=with_hint("fill in or remove these rows"),
                )
            )
        for type_name, wrong_rows in wrong.items():
            problems.append(
                Problem(
                    f"{n_rows(len(wrong_rows))} {have(len(wrong_rows))} a {type_name} as '{field}', not text: {wheres(wrong_rows, source)}",
                    where=source,
                    fix=with_hint(
                        f"make '{field}' a single string in every row (pick or join list items; json.dumps objects), "
                        f"or pass {flag} NAME to use another field"
                    ),
                )
            )

    kept: list[Row] = []
    for position, row in enumerate(rows):
        if position in bad:
            continue
        updates = converted.get(position)
        kept.append(row.with_fields(**updates) if updates else row)

    if rejects is not None:
        # Rows read_rows already rejected from this source count too: "all N rows" means all rows of the file.
        prefix = f"{source} "
        earlier = [r for r in rejects if r.where == source or r.where.startswith(prefix)]
        for position in sorted(reasons):
            row = rows[position]
            rejects.append(Rejected(row.where, "; ".join(reasons[position]), raw_json(row.fields)))
        if rows and not kept and not explained:
            first = earlier[0] if earlier else rejects[-len(reasons)]
            problems.append(all_rejected_problem(source, len(earlier) + len(rows), first))
    return kept, notes


def field_not_found(field: str, flag: str, present: list[str], source: str) -> Problem:
    listed = ", ".join(repr(short(name)) for name in present) if present else "(none)"
    lowered = {name.lower(): name for name in present}
    guess = lowered.get(field.lower())
    if guess is None:
        close = difflib.get_close_matches(field, present, n=1, cutoff=0.6)
        guess = close[0] if close else None
    fix = f"pass {flag} NAME with one of: {listed}"
    if guess is not None:
        fix = f"did you mean '{guess}'? " + fix
    return Problem(f"field '{field}' not found in {source} (its fields: {listed})", where=flag, fix=fix)


def is_nan(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isnan(value)


def _value_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__
