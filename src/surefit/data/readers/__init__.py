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

import csv
import difflib
import io
import json
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

_JSONL_EXTS = {".jsonl", ".ndjson"}
_DATA_EXTS = _JSONL_EXTS | {".json", ".csv", ".tsv", ".parquet"}
_KIND = {".jsonl": "JSONL", ".ndjson": "JSONL", ".json": "JSON", ".csv": "CSV", ".tsv": "TSV"}
SKIP_HINT = "or pass --on_bad_rows skip to drop such rows (they are written to rejected_rows.jsonl)"
# Binary sniffing looks at the start of the file only, as git and file(1) do: a text file does not turn binary later.
_SNIFF_BYTES = 8192
_MAX_CONTROL_SHARE = 0.3
# Control bytes never found in text files (tab, line feed, carriage return, form feed, vertical tab, backspace and
# escape do occur in real text).
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\f\v\b\x1b") + b"\x7f"
_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32", "little-endian"),
    (b"\x00\x00\xfe\xff", "UTF-32", "big-endian"),
    (b"\xff\xfe", "UTF-16", "little-endian"),
    (b"\xfe\xff", "UTF-16", "big-endian"),
)
_UTF8_BOM = b"\xef\xbb\xbf"
_ICONV_FIX = "re-save the file as UTF-8 (for example: iconv -f latin1 -t utf-8 IN > OUT)"
_JSONL_FIX = 'make every line one JSON object, e.g. {"input": "...", "target": "..."} (write each line with json.dumps)'
# Column names longer than this are sentences: the file has no header line.
_MAX_HEADER_NAME = 64
_SQUAD_SHAPE = "data[].paragraphs[].{context, qas[].{id, question, answers[].text}}"


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


def _clip(raw: str | None) -> str | None:
    return raw if raw is None or len(raw) <= MAX_RAW_CHARS else raw[:MAX_RAW_CHARS]


def _raw_json(value: Any) -> str | None:
    try:
        return _clip(json.dumps(value, ensure_ascii=False, default=str))
    except (ValueError, RecursionError):  # nested near the recursion limit: the reason and location still say enough
        return None


def _with_hint(fix: str) -> str:
    return f"{fix}; {SKIP_HINT}" if fix else SKIP_HINT


class _Capped:
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
            self.rejects.append(Rejected(problem.where, problem.what, _clip(raw)))
            return
        problem = Problem(problem.what, where=problem.where, fix=_with_hint(problem.fix))
        self.fix = problem.fix
        if self.count <= MAX_PROBLEMS_PER_KIND:
            self.problems.append(problem)

    def close(self) -> None:
        extra = self.count - MAX_PROBLEMS_PER_KIND
        if extra > 0 and self.rejects is None:
            self.problems.append(
                Problem(f"... and {extra} more {self.unit} with the same problem", where=self.source, fix=self.fix)
            )


def read_rows(path: str | os.PathLike, problems: list[Problem], *, rejects: list[Rejected] | None = None) -> list[Row]:
    """Read every row of one data source.

    The format comes from the extension (case-insensitive): ``.jsonl``/``.ndjson``, ``.json`` (a list of objects,
    a dict of equal-length lists, or SQuAD), ``.csv``, ``.tsv``, ``.parquet``, or a folder written by
    ``datasets.Dataset.save_to_disk``.

    Args:
        path: the file or folder, as the user gave it (it is quoted as given in every message).
        problems: every problem found is appended here; user errors never raise.
        rejects: ``None`` (``--on_bad_rows error``): a bad row is a problem. A list (``--on_bad_rows skip``): each bad
            row (a line that is not a JSON object, a record with the wrong cell count, a line with non-UTF-8 bytes,
            a duplicate key, an oversized line, an unanswerable SQuAD question) is appended here instead and left
            out. File-level problems stay problems either way, including a file whose every row was rejected.

    Returns:
        The rows that could be read, possibly empty. ``Row.index`` is the 0-based position among these rows.
    """
    source = os.fspath(path)
    p = Path(source)
    before = len(problems)
    rejected_before = len(rejects) if rejects is not None else 0
    if not p.exists():
        problems.append(_missing_path_problem(p, source))
        return []
    if p.is_dir():
        return _read_folder(p, source, problems)

    ext = p.suffix.lower()
    if ext not in _DATA_EXTS:
        problems.append(_unknown_extension_problem(p, source, ext))
        return []

    if ext == ".parquet":
        rows = _read_parquet(source, problems)
    else:
        # A .json document has no lines to drop one by one; the other text formats do.
        decoded = _read_text(p, source, _KIND[ext], problems, by_line=ext != ".json", skip=rejects is not None)
        if decoded is None:
            return []
        if ext in _JSONL_EXTS:
            rows = _read_jsonl(decoded, source, problems, rejects)
        elif ext == ".json":
            rows = _read_json(decoded, source, problems, rejects)
        else:
            rows = _read_delimited(decoded, source, "," if ext == ".csv" else "\t", problems, rejects)
    if rows is None:
        return []
    # "No rows" only when nothing else explains it: a file whose every line is broken already says why.
    if not rows and len(problems) == before:
        rejected = rejects[rejected_before:] if rejects is not None else []
        if rejected:
            # Skipping bad rows must not turn a wholly broken file into an empty, silently "successful" run.
            problems.append(_all_rejected_problem(source, len(rejected), rejected[0]))
        else:
            problems.append(Problem(f"no rows in {source}", fix="check the file: it holds no data rows"))
    return rows


def _all_rejected_problem(source: str, n: int, first: Rejected) -> Problem:
    return Problem(
        f"no usable rows in {source}: all {n} row{'s' if n != 1 else ''} rejected (see rejected_rows.jsonl)",
        fix=f"fix the rejected rows (the first: {first.where}: {first.reason})",
    )


# --- paths -------------------------------------------------------------------------------------------------------


def _missing_path_problem(p: Path, source: str) -> Problem:
    fix = f"check the path (relative paths are resolved from {os.getcwd()})"
    parent = p.parent if str(p.parent) else Path(".")
    if parent.is_dir():
        try:
            names = [c.name for c in parent.iterdir()]
        except OSError:
            names = []
        close = difflib.get_close_matches(p.name, names, n=3, cutoff=0.6)
        if close:
            fix += "; did you mean " + " or ".join(str(parent / c) for c in close) + "?"
    else:
        fix += f"; the folder {parent} does not exist either"
    return Problem(f"file not found: {source}", fix=fix)


def _unknown_extension_problem(p: Path, source: str, ext: str) -> Problem:
    if not ext:
        what = f"{source} has no file extension, so its format is unknown; surefit reads {SUPPORTED_FORMATS}"
    else:
        what = f"unsupported file type '{ext}' for {source}; surefit reads {SUPPORTED_FORMATS}"
    fix = "convert it to one of these formats, or rename it if it already is one (e.g. a .txt of JSON lines -> .jsonl)"
    if ext in {".gz", ".bz2", ".xz", ".zst", ".zip"}:
        fix = f"decompress it first (it is a '{ext}' archive), then point at the extracted file"
    elif ext == ".arrow" and _is_dataset_folder(p.parent):
        fix = f"point at the folder instead: {p.parent} (it was written by save_to_disk)"
    return Problem(what, fix=fix)


def _is_dataset_folder(p: Path) -> bool:
    return (p / "dataset_info.json").is_file() or (p / "state.json").is_file()


def _read_folder(p: Path, source: str, problems: list[Problem]) -> list[Row]:
    if (p / "dataset_dict.json").is_file():
        splits = _dataset_dict_splits(p)
        listed = ", ".join(splits) if splits else "(none listed)"
        example = p / (splits[0] if splits else "train")
        problems.append(
            Problem(
                f"{source} holds several splits ({listed}); say which one to read",
                fix=f"point --data at one split, e.g. {example}",
            )
        )
        return []
    if _is_dataset_folder(p):
        return _read_dataset_folder(source, problems)

    found = _data_files_inside(p)
    if found:
        fix = "point at one of the data files inside, e.g. " + ", ".join(found)
    else:
        fix = f"point at a data file ({SUPPORTED_FORMATS}); no data files were found inside"
    problems.append(Problem(f"{source} is a folder, not a data file or a saved `datasets` folder", fix=fix))
    return []


def _dataset_dict_splits(p: Path) -> list[str]:
    try:
        splits = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
    except (OSError, ValueError, AttributeError, RecursionError):
        splits = []
    if not isinstance(splits, list) or not splits:
        splits = sorted(c.name for c in p.iterdir() if c.is_dir() and _is_dataset_folder(c))
    return [str(s) for s in splits]


def _data_files_inside(p: Path, limit: int = 5) -> list[str]:
    found: list[str] = []
    visited = 0
    # Bounded walk: a folder given by mistake can be huge (a home directory), and a few hints are enough.
    for top, dirs, files in os.walk(p):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        visited += len(dirs) + len(files)
        here = Path(top)
        if here != p and _is_dataset_folder(here):
            found.append(str(here))
            dirs[:] = []
        else:
            found.extend(str(here / f) for f in sorted(files) if Path(f).suffix.lower() in _DATA_EXTS)
        if len(found) >= limit or visited > 10_000:
            break
    return found[:limit]


# --- text and encoding -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Text:
    """A text file's content, decoded.

    Attributes:
        text: the content, with invalid bytes replaced (U+FFFD) so line numbers stay right.
        bad_lines: in ``skip`` mode for line-based formats, ``{line number: (reason, raw line)}`` for each line
            with invalid bytes; the reader rejects the rows on those lines. Empty otherwise.
        problem: the file-level encoding problem, held back while ``bad_lines`` is used; a reader that cannot
            attribute the bad bytes to rows (a whole JSON document in a .jsonl file) reports it instead.
    """

    text: str
    bad_lines: dict[int, tuple[str, str]]
    problem: Problem | None = None


def _read_text(p: Path, source: str, kind: str, problems: list[Problem], *, by_line: bool, skip: bool) -> _Text | None:
    try:
        data = p.read_bytes()
    except OSError as e:
        problems.append(Problem(f"cannot read {source}: {e.strerror or e}", fix="check the file's permissions"))
        return None
    binary = _binary_problem(data, source, kind)
    if binary is not None:
        # One problem for the file: a binary file decoded as text would list every "line" of it as broken.
        problems.append(binary)
        return None
    bom = len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0
    try:
        return _Text(data[bom:].decode("utf-8"), {})
    except UnicodeDecodeError as e:
        # Keep reading with the bad bytes replaced, so the same report also lists the file's other problems; the
        # encoding problem stops the run (error mode), or the rows on the bad lines are rejected (skip mode), so the
        # replaced text never reaches training.
        text = data[bom:].decode("utf-8", errors="replace")
        if skip and by_line:
            held = _encoding_problem(data, bom + e.start, bom + e.end, source, hint=False)
            return _Text(text, _bad_lines(data), held)
        problems.append(_encoding_problem(data, bom + e.start, bom + e.end, source, hint=by_line))
        return _Text(text, {})


def _binary_problem(data: bytes, source: str, kind: str) -> Problem | None:
    head = data[:_SNIFF_BYTES]
    for bom, name, order in _BOMS:
        if head.startswith(bom):
            return _utf16_problem(source, name, f"{order}, it starts with a {name} byte order mark")
    nul = head.find(b"\x00")
    if nul >= 0:
        # ASCII text saved as UTF-16 without a byte order mark: every other byte is NUL.
        for parity in (0, 1):
            half = head[parity::2]
            if len(half) >= 4 and half.count(0) >= 0.9 * len(half):
                return _utf16_problem(source, "UTF-16", "no byte order mark, but every other byte is NUL")
        return Problem(
            f"looks like a binary file, not {kind} (NUL byte at offset {nul})",
            where=source,
            fix=f"check that this is the right file; a compressed, spreadsheet or other binary file must be "
            f"exported to {kind} first",
        )
    control = len(head) - len(head.translate(None, _CONTROL_BYTES))
    if head and control > _MAX_CONTROL_SHARE * len(head):
        return Problem(
            f"looks like a binary file, not {kind} ({control} of its first {len(head)} bytes are control bytes)",
            where=source,
            fix=f"check that this is the right file; a binary file must be exported to {kind} first",
        )
    return None


def _utf16_problem(source: str, name: str, detail: str) -> Problem:
    return Problem(
        f"is {name} ({detail}); re-save as UTF-8",
        where=source,
        fix=f"re-save the file as UTF-8 (for example: iconv -f {name} -t UTF-8 IN > OUT)",
    )


def _encoding_problem(data: bytes, start: int, end: int, source: str, *, hint: bool = False) -> Problem:
    line = data.count(b"\n", 0, start) + 1
    line_start = data.rfind(b"\n", 0, start) + 1
    column = start - line_start + 1
    bad = data[start:end]
    excerpt = data[max(line_start, start - 30) : end + 30].split(b"\n")[0].decode("utf-8", "backslashreplace")
    bad_lines = sum(1 for chunk in data.split(b"\n") if not _is_utf8(chunk))
    what = (
        f"not valid UTF-8: byte {_hex(bad)} at byte offset {start} (line {line}, byte {column} of the line)"
        f"{_cp1252_guess(bad)}; near: '{excerpt}'; "
        f"{bad_lines} line{'s' if bad_lines != 1 else ''} in the file {_have(bad_lines)} invalid bytes"
    )
    return Problem(what, where=f"{source} line {line}", fix=_with_hint(_ICONV_FIX) if hint else _ICONV_FIX)


def _bad_lines(data: bytes) -> dict[int, tuple[str, str]]:
    bad: dict[int, tuple[str, str]] = {}
    for n, chunk in enumerate(data.split(b"\n"), 1):
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            what = f"not valid UTF-8: byte {_hex(chunk[e.start : e.end])} at byte {e.start + 1} of the line"
            what += _cp1252_guess(chunk[e.start : e.end])
            bad[n] = (what, _clip(chunk.decode("utf-8", "backslashreplace")))
    return bad


def _hex(bad: bytes) -> str:
    return " ".join(f"0x{b:02X}" for b in bad)


def _cp1252_guess(bad: bytes) -> str:
    try:
        return f"; as Windows-1252 it would read {bad.decode('cp1252')!r}"
    except UnicodeDecodeError:
        return ""


def _too_big(parts: list[str]) -> int | None:
    """The UTF-8 size of a row's text when it is over :data:`MAX_ROW_BYTES`, else None."""
    # A character is at most 4 bytes, so most rows are cleared without encoding them.
    if sum(map(len, parts)) * 4 <= MAX_ROW_BYTES:
        return None
    size = sum(len(part.encode("utf-8", "replace")) for part in parts)
    return size if size > MAX_ROW_BYTES else None


def _too_big_what(subject: str, size: int) -> str:
    shown = f"{size / 2**20:.1f} MiB"
    if round(size / 2**20, 1) * 2**20 <= MAX_ROW_BYTES:
        # Just over the limit rounds to "16.0 MiB", which would read as allowed.
        shown += f" ({size:,} bytes)"
    return f"{subject} is {shown}; rows over {MAX_ROW_BYTES // 2**20} MiB are refused"


def _is_utf8(chunk: bytes) -> bool:
    try:
        chunk.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _json_type(value: Any) -> str:
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
    return _short(repr(value[:80] if isinstance(value, str) else value))


_DUPLICATE_FIX = "keep one of them"
# Besides malformed text, the parser refuses what Python cannot hold: nesting past the recursion limit
# (RecursionError) and integers of more than 4,300 digits (ValueError). Both are the file's fault, not a crash.
_JSON_ERRORS = (ValueError, RecursionError)


def _loads(text: str) -> tuple[Any, _DuplicateKeys]:
    keys = _DuplicateKeys()
    return json.JSONDecoder(object_pairs_hook=keys).decode(text), keys


def _read_jsonl(
    decoded: _Text, source: str, problems: list[Problem], rejects: list[Rejected] | None = None
) -> list[Row] | None:
    text = decoded.text
    if re.match(r"\s*\[", text):
        # A whole JSON array of objects saved as .jsonl: unambiguous, and reading it beats reporting every line as
        # broken. (A lone line such as [1, 2] is a bad line, not a document.)
        try:
            value, keys = _loads(text)
        except _JSON_ERRORS:
            pass
        else:
            if isinstance(value, list) and any(isinstance(item, dict) for item in value):
                return _whole_document(value, keys, decoded, source, problems, rejects)

    rows: list[Row] = []
    invalid = _Capped(problems, source, "lines", rejects)
    not_object = _Capped(problems, source, "lines", rejects)
    duplicate = _Capped(problems, source, "lines", rejects)
    too_big = _Capped(problems, source, "lines", rejects)
    keys = _DuplicateKeys()
    decoder = json.JSONDecoder(object_pairs_hook=keys)
    first = True
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            # Blank lines (often a trailing newline or two) carry no data; they are separators, not rows.
            continue
        where = f"{source} line {n}"
        was_first, first = first, False
        if n in decoded.bad_lines:
            reason, raw = decoded.bad_lines[n]
            rejects.append(Rejected(where, reason, raw))  # bad_lines is only filled in skip mode
            continue
        size = _too_big([line])
        if size is not None:
            too_big.add(
                Problem(
                    _too_big_what(f"line {n}", size),
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
            value = decoder.decode(body)
        except _JSON_ERRORS as e:
            if was_first:
                whole = _try_whole_document(text)
                if whole is not None:
                    # A pretty-printed JSON document saved as .jsonl.
                    return _whole_document(whole[0], whole[1], decoded, source, problems, rejects)
            invalid.add(
                Problem(f"not valid JSON: {_json_error(e, body)}", where=where, fix=_JSONL_FIX),
                raw=line,
            )
            continue
        if not isinstance(value, dict):
            not_object.add(
                Problem(f"line holds a JSON {_json_type(value)}, not an object", where=where, fix=_JSONL_FIX), raw=line
            )
            continue
        dup = keys.of(value)
        if dup is not None:
            duplicate.add(Problem(dup, where=where, fix=_DUPLICATE_FIX), raw=line)
            continue
        rows.append(Row(fields=value, where=where, index=len(rows)))
    for capped in (invalid, not_object, duplicate, too_big):
        capped.close()
    return rows


def _whole_document(
    value: Any,
    keys: _DuplicateKeys,
    decoded: _Text,
    source: str,
    problems: list[Problem],
    rejects: list[Rejected] | None,
) -> list[Row] | None:
    if decoded.problem is not None:
        # Rows of a whole document have no line of their own to reject, so bad bytes stop the file.
        problems.append(decoded.problem)
    return _rows_from_json(value, source, problems, rejects, keys)


def _try_whole_document(text: str) -> tuple[Any, _DuplicateKeys] | None:
    try:
        value, keys = _loads(text)
    except _JSON_ERRORS:
        return None
    return (value, keys) if isinstance(value, (list, dict)) else None


def _json_error(e: Exception, line: str) -> str:
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


def _read_json(
    decoded: _Text, source: str, problems: list[Problem], rejects: list[Rejected] | None = None
) -> list[Row] | None:
    try:
        value, keys = _loads(decoded.text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            # Several top-level values one per line: JSON Lines saved as .json (common, and what `datasets`
            # accepts too). Read it as JSON Lines if every line is an object; otherwise report the real error.
            trial: list[Problem] = []
            trial_rejects: list[Rejected] = []
            rows = _read_jsonl(decoded, source, trial, trial_rejects)
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
            f'({{"input": [...], "target": [...]}}), or SQuAD ({_SQUAD_SHAPE})',
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
                else f"a{'n' if _json_type(v)[0] in 'aeiou' else ''} {_json_type(v)}"
            )
            parts.append(f"'{key}' ({kind})")
        more = f" and {len(value) - 8} more" if len(value) > 8 else ""
        return "a JSON object with keys " + ", ".join(parts) + more
    kind = _json_type(value)
    return f"a single JSON {kind}"


def _rows_from_list(
    items: list,
    source: str,
    problems: list[Problem],
    rejects: list[Rejected] | None = None,
    keys: _DuplicateKeys | None = None,
) -> list[Row]:
    rows: list[Row] = []
    not_object = _Capped(problems, source, "items", rejects)
    duplicate = _Capped(problems, source, "items", rejects)
    for i, item in enumerate(items, 1):
        where = f"{source} item {i}"
        if not isinstance(item, dict):
            not_object.add(
                Problem(
                    f"item is a JSON {_json_type(item)}, not an object",
                    where=where,
                    fix='make every item of the list an object, e.g. {"input": "...", "target": "..."}',
                ),
                raw=_raw_json(item),
            )
            continue
        dup = keys.of(item) if keys is not None else None
        if dup is not None:
            duplicate.add(Problem(dup, where=where, fix=_DUPLICATE_FIX), raw=_raw_json(item))
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


def flatten_squad(
    obj: dict, source: str, problems: list[Problem], *, rejects: list[Rejected] | None = None
) -> list[Row]:
    """Turn a SQuAD-format object into one row per answerable question.

    Each row has ``input`` (``"{context}\\n\\nQuestion: {question}"``), ``target`` (the first answer's text),
    ``answers`` (every distinct answer text, in order, for scoring), ``id``, ``context`` and ``question``.

    Args:
        obj: the parsed file, ``{"data": [{"paragraphs": [{"context": ..., "qas": [...]}]}]}``.
        source: the file's path as shown in messages.
        problems: unanswerable questions (SQuAD v2) and malformed entries are appended here.
        rejects: when a list (``--on_bad_rows skip``), those questions and entries are appended here instead.

    Returns:
        The rows of the well-formed, answerable questions.
    """
    rows: list[Row] = []
    unanswerable = _Capped(problems, source, "questions", rejects)
    malformed = _Capped(problems, source, "entries", rejects)
    shape_fix = f"SQuAD files need {_SQUAD_SHAPE}; fix or remove this entry"
    for a, article in enumerate(obj.get("data") or [], 1):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            malformed.add(
                Problem("'paragraphs' is not a list", where=f"{source} (article {a})", fix=shape_fix),
                raw=_raw_json(article),
            )
            continue
        for p, paragraph in enumerate(paragraphs, 1):
            place = f"article {a}, paragraph {p}"
            if not isinstance(paragraph, dict):
                malformed.add(
                    Problem("paragraph is not an object", where=f"{source} ({place})", fix=shape_fix),
                    raw=_raw_json(paragraph),
                )
                continue
            context = paragraph.get("context")
            qas = paragraph.get("qas")
            if not isinstance(context, str) or not isinstance(qas, list):
                malformed.add(
                    Problem(
                        "paragraph needs a string 'context' and a list 'qas'",
                        where=f"{source} ({place})",
                        fix=shape_fix,
                    ),
                    raw=_raw_json(paragraph),
                )
                continue
            for q, qa in enumerate(qas, 1):
                row = _squad_row(qa, context, source, place, f"{a}.{p}.{q}", len(rows), unanswerable, malformed)
                if row is not None:
                    rows.append(row)
    unanswerable.close()
    malformed.close()
    return rows


def _squad_row(
    qa: Any,
    context: str,
    source: str,
    place: str,
    fallback_id: str,
    index: int,
    unanswerable: _Capped,
    malformed: _Capped,
) -> Row | None:
    shape_fix = f"SQuAD files need {_SQUAD_SHAPE}; fix or remove this question"
    if not isinstance(qa, dict):
        malformed.add(
            Problem("question entry is not an object", where=f"{source} ({place})", fix=shape_fix), raw=_raw_json(qa)
        )
        return None
    # An id is only a label for reports; a file without ids still trains, so number the question instead.
    qid = qa.get("id", fallback_id)
    where = f"{source} question id {qid} ({place})"
    question = qa.get("question")
    answers = qa.get("answers")
    if not isinstance(question, str) or not isinstance(answers, list):
        malformed.add(
            Problem("question needs a string 'question' and a list 'answers'", where=where, fix=shape_fix),
            raw=_raw_json(qa),
        )
        return None
    texts: list[str] = []
    for answer in answers:
        text = answer.get("text") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            malformed.add(Problem("an answer has no string 'text'", where=where, fix=shape_fix), raw=_raw_json(qa))
            return None
        if text not in texts:
            texts.append(text)
    if not texts or qa.get("is_impossible") is True:
        unanswerable.add(
            Problem(
                f"question {qid} has no answer (SQuAD v2 unanswerable): {question!r}",
                where=where,
                fix="remove unanswerable questions (or pre-filter: keep questions whose 'answers' list is non-empty)",
            ),
            raw=_raw_json(qa),
        )
        return None
    fields = {
        "input": f"{context}\n\nQuestion: {question}",
        "target": texts[0],
        "answers": texts,
        "id": qid,
        "context": context,
        "question": question,
    }
    return Row(fields=fields, where=where, index=index)


# --- CSV / TSV ----------------------------------------------------------------------------------------------------


def _read_delimited(
    decoded: _Text, source: str, delimiter: str, problems: list[Problem], rejects: list[Rejected] | None = None
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
            if rejects is not None:
                rejects.extend(unquoted_rejects)
            return plain
    problems.extend(trial)
    if rejects is not None:
        rejects.extend(trial_rejects)
    return rows


def _parse_delimited(
    decoded: _Text,
    source: str,
    delimiter: str,
    quoting: int,
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
    wrong_count = _Capped(problems, source, "lines", rejects)
    too_big = _Capped(problems, source, "lines", rejects)
    lines: list[str] = []

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
                            fix=_ICONV_FIX,
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
                    raw_line = _clip(raw(first_line, last_line))
                rejects.append(Rejected(where, reason, raw_line))  # bad_lines is only filled in skip mode
                encoding_rejects += 1
                continue
            size = _too_big(record)
            if size is not None:
                too_big.add(
                    Problem(
                        _too_big_what(f"the record at line {first_line}", size),
                        where=where,
                        fix="split the text into smaller rows, or remove the record",
                    ),
                    raw=_clip(raw(first_line, last_line)),
                )
                continue
            if len(record) != len(header):
                wrong_count.add(
                    Problem(
                        f"expected {len(header)} cells (as in the header) but got {len(record)}",
                        where=where,
                        fix=_cell_fix(kind),
                    ),
                    raw=_clip(raw(first_line, last_line)),
                )
                continue
            rows.append(Row(fields=dict(zip(header, record, strict=True)), where=where, index=len(rows)))
    except csv.Error as e:
        problems.append(
            Problem(
                f"malformed {kind}: {e} (reading stopped here)",
                where=f"{source} line {reader.line_num}",
                fix=_cell_fix(kind),
            )
        )
    finally:
        csv.field_size_limit(old_limit)
    wrong_count.close()
    too_big.close()
    # In skip mode the row complaints went to rejects; they still mean this way of parsing fits the file less well.
    issues = len(problems) - before + (wrong_count.count + too_big.count if rejects is not None else 0)
    return rows, issues


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
    long_names = [name for name in names if len(name) > _MAX_HEADER_NAME]
    if long_names:
        problems.append(
            Problem(
                f"the first line looks like data, not a header: a column would be named {_short(long_names[0])!r}",
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


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cell_fix(kind: str) -> str:
    if kind == "TSV":
        return "every line needs one cell per header column; a tab or line break inside a cell must be quoted"
    return (
        "every line needs one cell per header column; quote cells holding commas, quotes or line breaks "
        '("...", with inner quotes doubled ""), e.g. write the file with pandas.to_csv or Python\'s csv module'
    )


# --- Parquet and datasets folders ---------------------------------------------------------------------------------


def _read_parquet(source: str, problems: list[Problem]) -> list[Row] | None:
    import pyarrow.parquet as pq  # deferred: pyarrow is only needed for this format

    try:
        records = pq.read_table(source).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several unrelated types for a damaged file
        problems.append(
            Problem(
                f"cannot read {source} as Parquet: {e}", fix="check the file is a complete Parquet file (re-export it)"
            )
        )
        return None
    return [Row(fields=r, where=f"{source} row {i}", index=i - 1) for i, r in enumerate(records, 1)]


def _read_dataset_folder(source: str, problems: list[Problem]) -> list[Row] | None:
    import datasets  # deferred: importing datasets costs about a second

    try:
        ds = datasets.load_from_disk(source)
    except Exception as e:  # noqa: BLE001 - load_from_disk surfaces arrow, json and file errors alike
        problems.append(
            Problem(
                f"cannot load the saved `datasets` folder {source}: {e}",
                fix="re-save it with Dataset.save_to_disk, or export it to JSONL/Parquet",
            )
        )
        return None
    if isinstance(ds, datasets.DatasetDict):
        problems.append(
            Problem(
                f"{source} holds several splits ({', '.join(ds)}); say which one to read",
                fix=f"point --data at one split, e.g. {Path(source) / next(iter(ds), 'train')}",
            )
        )
        return None
    return [Row(fields=r, where=f"{source} row {i}", index=i - 1) for i, r in enumerate(ds.to_list(), 1)]


# --- field checks -------------------------------------------------------------------------------------------------


def check_text_fields(
    rows: list[Row],
    fields: list[tuple[str, str]],
    problems: list[Problem],
    source: str,
    *,
    rejects: list[Rejected] | None = None,
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
    for field, flag in fields:
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
            elif value is None or _is_nan(value):
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
            notes.append(
                f"{_count(len(numeric))} had a numeric '{field}'; converted to text "
                f"(e.g. {first_row.where}: {first_value!r} -> {str(first_value)!r})"
            )
        if rejects is not None:
            for position, reason in why + [(position, f"no '{field}' field") for position in missing_at]:
                reasons.setdefault(position, []).append(reason)
            continue
        if missing:
            problems.append(
                Problem(
                    f"{len(missing)} of {len(rows)} rows {_have(len(missing))} no '{field}' field: {_wheres(missing, source)}",
                    where=source,
                    fix=_with_hint(f"add '{field}' to these rows or remove them"),
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
                    f"{_count(len(listed))} {_have(len(listed))} a null or empty '{field}' ({', '.join(parts)}): {_wheres(listed, source)}",
                    where=source,
                    fix=_with_hint("fill in or remove these rows"),
                )
            )
        for type_name, wrong_rows in wrong.items():
            problems.append(
                Problem(
                    f"{_count(len(wrong_rows))} {_have(len(wrong_rows))} a {type_name} as '{field}', not text: {_wheres(wrong_rows, source)}",
                    where=source,
                    fix=_with_hint(
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
            rejects.append(Rejected(row.where, "; ".join(reasons[position]), _raw_json(row.fields)))
        if rows and not kept and not explained:
            first = earlier[0] if earlier else rejects[-len(reasons)]
            problems.append(_all_rejected_problem(source, len(earlier) + len(rows), first))
    return kept, notes


def field_not_found(field: str, flag: str, present: list[str], source: str) -> Problem:
    listed = ", ".join(repr(_short(name)) for name in present) if present else "(none)"
    lowered = {name.lower(): name for name in present}
    guess = lowered.get(field.lower())
    if guess is None:
        close = difflib.get_close_matches(field, present, n=1, cutoff=0.6)
        guess = close[0] if close else None
    fix = f"pass {flag} NAME with one of: {listed}"
    if guess is not None:
        fix = f"did you mean '{guess}'? " + fix
    return Problem(f"field '{field}' not found in {source} (its fields: {listed})", where=flag, fix=fix)


def _is_nan(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isnan(value)


def _value_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


def _count(n: int) -> str:
    return f"{n} row{'s' if n != 1 else ''}"


def _have(n: int) -> str:
    return "has" if n == 1 else "have"


def _wheres(rows: list[Row], source: str) -> str:
    # The problem's `where` already names the source, so each location drops it: "line 3" not "data.csv line 3".
    prefix = f"{source} "
    shown = [r.where[len(prefix) :] if r.where.startswith(prefix) else r.where for r in rows[:MAX_WHERES]]
    more = f" and {len(rows) - MAX_WHERES} more" if len(rows) > MAX_WHERES else ""
    return ", ".join(shown) + more


def read_splits(data: str, val_data: str | None, limit: int | None, problems: list[Problem],
                rejects: list[Rejected] | None, notes: list[str]) -> dict[str, list[Row]]:
    """``{"train": rows, "validation": rows}`` (validation only when a file is given), each cut to ``limit`` rows.

    A cut is noted in ``notes`` (never silent); every problem of both files goes to ``problems``.
    """
    loaded: dict[str, list[Row]] = {}
    for name, path in (("train", data), ("validation", val_data)):
        if path is None:
            continue
        rows = read_rows(path, problems, rejects=rejects)
        if limit is not None and len(rows) > limit:
            notes.append(f"--limit {limit}: using the first {limit} of {len(rows)} rows of {path}")
            rows = rows[:limit]
        loaded[name] = rows
    return loaded


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
