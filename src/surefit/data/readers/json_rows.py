"""JSON Lines (one object per line) and .json documents (a list of objects, or a dict of equal-length columns)."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

from surefit.config.yaml_files import TooDeep, check_depth
from surefit.data.readers.common import JSONL_FIX, SQUAD_SHAPE, CappedProblems, Rejected, json_type, raw_json, short
from surefit.data.readers.limits import available_memory
from surefit.data.readers.squad import flatten_squad
from surefit.data.readers.text import TextFile, too_big_what
from surefit.data.rows import Row
from surefit.errors import Problem

# --- JSON Lines ---------------------------------------------------------------------------------------------------


class _DuplicateKeys:
    """``object_pairs_hook`` that builds objects as ``json`` does and remembers those that repeat a key.

    ``json.loads`` silently keeps the last of two values for one key, so a row written twice over (``"target"``
    set by two tools) would lose a value without a word. Objects are remembered by identity so a caller can ask
    about the top level of a row only: nested objects are the row's own business.
    """

    __slots__ = ("found",)

    def __init__(self) -> None:
        self.found: dict[int, tuple[dict, str]] = {}

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            # Keeping the object alive keeps its id from being reused by another object.
            self.found[id(obj)] = (obj, _describe_duplicate(pairs))
        return obj

    def of(self, obj: Any) -> str | None:
        """The duplicate-key description of ``obj`` if it repeated a key, else None."""
        hit = self.found.get(id(obj))
        return hit[1] if hit is not None and hit[0] is obj else None


def _describe_duplicate(pairs: list[tuple[str, Any]]) -> str:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            return f"duplicate key {key!r} (values {_short_repr(seen[key])} and {_short_repr(value)})"
        seen[key] = value
    return "duplicate key"


def _short_repr(value: Any) -> str:
    # Slice before repr: a long text's repr would be built in full only to be cut.
    return short(repr(value[:80] if isinstance(value, str) else value))


_DUPLICATE_FIX = "keep one of them"
# Besides malformed text, the parser refuses what Python cannot hold: nesting past the recursion limit
# (RecursionError) and integers of more than 4,300 digits (ValueError). Both are the file's fault, not a crash.
_JSON_ERRORS = (ValueError, RecursionError)
# A row is a few levels deep (a conversation: row, messages, turn, tool call, arguments); past this depth later
# stages (copying, hashing, templates) would recurse into a RecursionError. A whole document adds two levels.
MAX_DATA_DEPTH = 64


def _loads(text: str) -> tuple[Any, _DuplicateKeys]:
    keys = _DuplicateKeys()
    return check_depth(json.JSONDecoder(object_pairs_hook=keys).decode(text), MAX_DATA_DEPTH + 2), keys


def read_jsonl(
    decoded: TextFile, source: str, problems: list[Problem], rejects: list[Rejected] | None = None,
    limit: int | None = None,
) -> list[Row] | None:
    rows: list[Row] = []
    stream = iter_jsonl(decoded, source, problems, rejects, limit)
    while True:
        try:
            rows.append(next(stream))
        except StopIteration as end:
            return rows if end.value else None


def iter_jsonl(
    decoded: TextFile, source: str, problems: list[Problem], rejects: list[Rejected] | None = None,
    limit: int | None = None,
) -> Generator[Row, None, bool]:
    """The rows of :func:`read_jsonl` one at a time (a file streamed, not held); returns False where the file was a
    JSON document that could not be read as rows (``read_jsonl``'s ``None``). A document read whole sets
    ``decoded.whole_used``: its rows came from the whole text, not streamed."""
    count = 0
    invalid = CappedProblems(problems, source, "lines", rejects)
    not_object = CappedProblems(problems, source, "lines", rejects)
    duplicate = CappedProblems(problems, source, "lines", rejects)
    too_big = CappedProblems(problems, source, "lines", rejects)
    keys = _DuplicateKeys()
    decoder = json.JSONDecoder(object_pairs_hook=keys)
    first = True
    for n, line in decoded.lines():
        line = line.removesuffix("\n")
        if n not in decoded.oversized and not line.strip():
            # Blank lines (often a trailing newline or two) carry no data; they are separators, not rows.
            continue
        where = f"{source} line {n}"
        was_first, first = first, False
        if was_first and line.lstrip().startswith("["):
            # A whole JSON array of objects saved as .jsonl: unambiguous, and reading it beats reporting every line
            # as broken. (A lone line such as [1, 2] is a bad line, not a document.)
            whole = _try_whole_document(decoded, source, problems)
            if whole is not None and isinstance(whole[0], list) and any(isinstance(item, dict) for item in whole[0]):
                got = _whole_document(whole[0], whole[1], decoded, source, problems, rejects)
                yield from got or []
                return got is not None
        if n in decoded.bad_lines:
            reason, raw = decoded.bad_lines[n]
            assert rejects is not None  # bad_lines is only filled in skip mode, which collects rejects
            rejects.append(Rejected(where, reason, raw))  # bad_lines is only filled in skip mode
            continue
        if n in decoded.oversized:
            too_big.add(
                Problem(
                    too_big_what(f"line {n}", decoded.oversized[n]),
                    where=where,
                    fix="split the text into smaller rows, or remove the line",
                ),
                raw=line,
            )
            continue
        # Files joined with `cat` carry each part's byte order mark into the middle of the result.
        body = line[1:] if line.startswith("\ufeff") else line
        if keys.found:
            keys.found.clear()
        try:
            value = check_depth(decoder.decode(body), MAX_DATA_DEPTH)
        except _JSON_ERRORS as e:
            if was_first and not line.lstrip().startswith("["):
                whole = _try_whole_document(decoded, source, problems)
                if whole is not None and isinstance(whole[0], (list, dict)):
                    # A pretty-printed JSON document saved as .jsonl.
                    got = _whole_document(whole[0], whole[1], decoded, source, problems, rejects)
                    yield from got or []
                    return got is not None
            invalid.add(
                Problem(f"not valid JSON: {_json_error(e, body)}", where=where, fix=JSONL_FIX),
                raw=line,
            )
            continue
        if not isinstance(value, dict):
            not_object.add(
                Problem(f"line holds a JSON {json_type(value)}, not an object", where=where, fix=JSONL_FIX), raw=line
            )
            continue
        dup = keys.of(value)
        if dup is not None:
            duplicate.add(Problem(dup, where=where, fix=_DUPLICATE_FIX), raw=line)
            continue
        yield Row(fields=value, where=where, index=count)
        count += 1
        if limit is not None and count >= limit:
            break
    for capped in (invalid, not_object, duplicate, too_big):
        capped.close()
    return True


def _whole_document(
    value: Any,
    keys: _DuplicateKeys,
    decoded: TextFile,
    source: str,
    problems: list[Problem],
    rejects: list[Rejected] | None,
) -> list[Row] | None:
    decoded.whole_used = True
    if decoded.problem is not None:
        # Rows of a whole document have no line of their own to reject, so bad bytes stop the file.
        problems.append(decoded.problem)
    return _rows_from_json(value, source, problems, rejects, keys)


def _try_whole_document(decoded: TextFile, source: str, problems: list[Problem]) -> tuple[Any, _DuplicateKeys] | None:
    """The .jsonl file read whole as one JSON document, when it is one that fits in memory."""
    free = available_memory()
    if free is not None and decoded.size > free:
        return None
    text = decoded.whole()
    if text is None:
        return None
    try:
        value, keys = _loads(text)
    except _JSON_ERRORS:
        return None
    return (value, keys) if isinstance(value, (list, dict)) else None


def _json_error(e: Exception, line: str) -> str:
    if isinstance(e, TooDeep):
        return str(e)
    if isinstance(e, RecursionError):
        return "nested too deeply to read (more than about 1,000 levels of [ ] or { })"
    if not isinstance(e, json.JSONDecodeError):
        return str(e)  # e.g. an integer of more than 4,300 digits, which Python refuses to convert
    detail = f"{e.msg} (column {e.colno})"
    if e.msg.startswith("Expecting property name enclosed in double quotes") and "'" in line:
        detail += "; it looks like a Python dict (single quotes): write it with json.dumps, not str()"
    elif e.msg.startswith("Unterminated string") or (e.msg.startswith("Expecting") and e.pos >= len(line.rstrip())):
        detail += "; the line ends early (truncated, or a string with a raw line break inside)"
    return detail


# --- JSON ---------------------------------------------------------------------------------------------------------


def read_json(
    decoded: TextFile, source: str, problems: list[Problem], rejects: list[Rejected] | None = None
) -> list[Row] | None:
    text = decoded.whole()
    if decoded.problem is not None:
        problems.append(decoded.problem)
    if text is None:
        return None
    try:
        value, keys = _loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            # Several top-level values one per line: JSON Lines saved as .json (common, and what `datasets`
            # accepts too). Read it as JSON Lines if every line is an object; otherwise report the real error.
            trial: list[Problem] = []
            trial_rejects: list[Rejected] = []
            rows = read_jsonl(decoded, source, trial, trial_rejects)
            if rows and not trial and not trial_rejects:
                return rows
        problems.append(
            Problem(
                f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                where=f"{source} line {e.lineno}",
                fix="fix the JSON at that position (a JSON validator or `python -m json.tool FILE` shows it)",
            )
        )
        return None
    except _JSON_ERRORS as e:
        problems.append(
            Problem(
                f"cannot read {source} as JSON: {_json_error(e, '')}",
                fix="re-save the data as plain rows of text fields (json.dumps of each row)",
            )
        )
        return None
    return _rows_from_json(value, source, problems, rejects, keys)


def _rows_from_json(
    value: Any,
    source: str,
    problems: list[Problem],
    rejects: list[Rejected] | None = None,
    keys: _DuplicateKeys | None = None,
) -> list[Row] | None:
    if isinstance(value, list):
        return _rows_from_list(value, source, problems, rejects, keys)
    if isinstance(value, dict):
        data = value.get("data")
        if isinstance(data, list) and data and any(isinstance(a, dict) and "paragraphs" in a for a in data):
            return flatten_squad(value, source, problems, rejects=rejects)
        if value and all(isinstance(v, list) for v in value.values()):
            return _rows_from_columns(value, source, problems)
    problems.append(
        Problem(
            f"{source} holds {_describe_shape(value)}; surefit reads a list of objects "
            f'([{{"input": ..., "target": ...}}, ...]), an object of equal-length lists '
            f'({{"input": [...], "target": [...]}}), or SQuAD ({SQUAD_SHAPE})',
            fix="re-save the data in one of these shapes (if the rows sit under a key, save that list on its own)",
        )
    )
    return None


def _describe_shape(value: Any) -> str:
    if isinstance(value, dict):
        if not value:
            return "an empty JSON object"
        parts = []
        for key in list(value)[:8]:
            v = value[key]
            kind = (
                f"a list of {len(v)}"
                if isinstance(v, list)
                else f"a{'n' if json_type(v)[0] in 'aeiou' else ''} {json_type(v)}"
            )
            parts.append(f"'{key}' ({kind})")
        more = f" and {len(value) - 8} more" if len(value) > 8 else ""
        return "a JSON object with keys " + ", ".join(parts) + more
    kind = json_type(value)
    return f"a single JSON {kind}"


def _rows_from_list(
    items: list,
    source: str,
    problems: list[Problem],
    rejects: list[Rejected] | None = None,
    keys: _DuplicateKeys | None = None,
) -> list[Row]:
    rows: list[Row] = []
    not_object = CappedProblems(problems, source, "items", rejects)
    duplicate = CappedProblems(problems, source, "items", rejects)
    for i, item in enumerate(items, 1):
        where = f"{source} item {i}"
        if not isinstance(item, dict):
            not_object.add(
                Problem(
                    f"item is a JSON {json_type(item)}, not an object",
                    where=where,
                    fix='make every item of the list an object, e.g. {"input": "...", "target": "..."}',
                ),
                raw=raw_json(item),
            )
            continue
        dup = keys.of(item) if keys is not None else None
        if dup is not None:
            duplicate.add(Problem(dup, where=where, fix=_DUPLICATE_FIX), raw=raw_json(item))
            continue
        rows.append(Row(fields=item, where=where, index=len(rows)))
    not_object.close()
    duplicate.close()
    return rows


def _rows_from_columns(columns: dict[str, list], source: str, problems: list[Problem]) -> list[Row] | None:
    lengths = {k: len(v) for k, v in columns.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"'{k}' has {n}" for k, n in lengths.items())
        problems.append(
            Problem(
                f"{source} holds columns of different lengths ({listed}), so rows cannot be paired up",
                fix="give every list the same number of values (one per row)",
            )
        )
        return None
    keys = list(columns)
    n = next(iter(lengths.values()))
    return [Row(fields={k: columns[k][i] for k in keys}, where=f"{source} item {i + 1}", index=i) for i in range(n)]
