"""Read a data source (JSONL, JSON, SQuAD, CSV, TSV, Parquet, a saved ``datasets`` folder) into :class:`Row` s.

Readers never raise for something the user can fix: they append :class:`Problem` s, each naming the file and line
(or item, row, question id) and the fix, so one run reports everything wrong with a file. Every row keeps where it
came from, so later stages can point at the exact line.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import math
import numbers
import os
import sys
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

_JSONL_EXTS = {".jsonl", ".ndjson"}
_DATA_EXTS = _JSONL_EXTS | {".json", ".csv", ".tsv", ".parquet"}
_UTF8_BOM = b"\xef\xbb\xbf"
_ICONV_FIX = "re-save the file as UTF-8 (for example: iconv -f latin1 -t utf-8 IN > OUT)"
_JSONL_FIX = 'make every line one JSON object, e.g. {"input": "...", "target": "..."} (write each line with json.dumps)'
# Column names longer than this are sentences: the file has no header line.
_MAX_HEADER_NAME = 64
_SQUAD_SHAPE = "data[].paragraphs[].{context, qas[].{id, question, answers[].text}}"


class _Capped:
    """Collects problems of one kind for one file, keeping the first few and counting the rest."""

    def __init__(self, problems: list[Problem], source: str, unit: str):
        self.problems = problems
        self.source = source
        self.unit = unit
        self.count = 0
        self.fix = ""

    def add(self, problem: Problem) -> None:
        self.count += 1
        self.fix = problem.fix
        if self.count <= MAX_PROBLEMS_PER_KIND:
            self.problems.append(problem)

    def close(self) -> None:
        extra = self.count - MAX_PROBLEMS_PER_KIND
        if extra > 0:
            self.problems.append(
                Problem(f"... and {extra} more {self.unit} with the same problem", where=self.source, fix=self.fix)
            )


def read_rows(path: str | os.PathLike, problems: list[Problem]) -> list[Row]:
    """Read every row of one data source.

    The format comes from the extension (case-insensitive): ``.jsonl``/``.ndjson``, ``.json`` (a list of objects,
    a dict of equal-length lists, or SQuAD), ``.csv``, ``.tsv``, ``.parquet``, or a folder written by
    ``datasets.Dataset.save_to_disk``.

    Args:
        path: the file or folder, as the user gave it (it is quoted as given in every message).
        problems: every problem found is appended here; user errors never raise.

    Returns:
        The rows that could be read, possibly empty. ``Row.index`` is the 0-based position among these rows.
    """
    source = os.fspath(path)
    p = Path(source)
    before = len(problems)
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
        text = _read_text(p, source, problems)
        if text is None:
            return []
        if ext in _JSONL_EXTS:
            rows = _read_jsonl(text, source, problems)
        elif ext == ".json":
            rows = _read_json(text, source, problems)
        else:
            rows = _read_delimited(text, source, "," if ext == ".csv" else "\t", problems)
    if rows is None:
        return []
    # "No rows" only when nothing else explains it: a file whose every line is broken already says why.
    if not rows and len(problems) == before:
        problems.append(Problem(f"no rows in {source}", fix="check the file: it holds no data rows"))
    return rows


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
    except (OSError, ValueError, AttributeError):
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


def _read_text(p: Path, source: str, problems: list[Problem]) -> str | None:
    try:
        data = p.read_bytes()
    except OSError as e:
        problems.append(Problem(f"cannot read {source}: {e.strerror or e}", fix="check the file's permissions"))
        return None
    bom = len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        problems.append(_encoding_problem(data, bom + e.start, bom + e.end, source))
        # Keep reading with the bad bytes replaced, so the same report also lists the file's other problems; the
        # encoding problem above already stops the run, so the replaced text never reaches training.
        return data[bom:].decode("utf-8", errors="replace")


def _encoding_problem(data: bytes, start: int, end: int, source: str) -> Problem:
    line = data.count(b"\n", 0, start) + 1
    line_start = data.rfind(b"\n", 0, start) + 1
    column = start - line_start + 1
    bad = data[start:end]
    bad_hex = " ".join(f"0x{b:02X}" for b in bad)
    excerpt = data[max(line_start, start - 30) : end + 30].split(b"\n")[0].decode("utf-8", "backslashreplace")
    bad_lines = sum(1 for chunk in data.split(b"\n") if not _is_utf8(chunk))
    guess = ""
    try:
        guess = f"; as Windows-1252 it would read {bad.decode('cp1252')!r}"
    except UnicodeDecodeError:
        pass
    what = (
        f"not valid UTF-8: byte {bad_hex} at byte offset {start} (line {line}, byte {column} of the line){guess}; "
        f"near: '{excerpt}'; {bad_lines} line{'s' if bad_lines != 1 else ''} in the file {_have(bad_lines)} invalid bytes"
    )
    return Problem(what, where=f"{source} line {line}", fix=_ICONV_FIX)


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


def _read_jsonl(text: str, source: str, problems: list[Problem]) -> list[Row] | None:
    stripped = text.lstrip()
    if stripped.startswith("["):
        # A whole JSON array saved as .jsonl: unambiguous, and reading it beats reporting every line as broken.
        try:
            return _rows_from_json(json.loads(text), source, problems)
        except json.JSONDecodeError:
            pass

    rows: list[Row] = []
    invalid = _Capped(problems, source, "lines")
    not_object = _Capped(problems, source, "lines")
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            # Blank lines (often a trailing newline or two) carry no data; they are separators, not rows.
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            if not rows and invalid.count == 0 and not_object.count == 0:
                whole = _try_whole_document(text)
                if whole is not None:
                    # A pretty-printed JSON document saved as .jsonl.
                    return _rows_from_json(whole, source, problems)
            invalid.add(Problem(f"not valid JSON: {_json_error(e, line)}", where=f"{source} line {n}", fix=_JSONL_FIX))
            continue
        if not isinstance(value, dict):
            not_object.add(
                Problem(
                    f"line holds a JSON {_json_type(value)}, not an object", where=f"{source} line {n}", fix=_JSONL_FIX
                )
            )
            continue
        rows.append(Row(fields=value, where=f"{source} line {n}", index=len(rows)))
    invalid.close()
    not_object.close()
    return rows


def _try_whole_document(text: str) -> Any | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, (list, dict)) else None


def _json_error(e: json.JSONDecodeError, line: str) -> str:
    detail = f"{e.msg} (column {e.colno})"
    if e.msg.startswith("Expecting property name enclosed in double quotes") and "'" in line:
        detail += "; it looks like a Python dict (single quotes): write it with json.dumps, not str()"
    elif e.msg.startswith("Unterminated string") or (e.msg.startswith("Expecting") and e.pos >= len(line.rstrip())):
        detail += "; the line ends early (truncated, or a string with a raw line break inside)"
    return detail


# --- JSON ---------------------------------------------------------------------------------------------------------


def _read_json(text: str, source: str, problems: list[Problem]) -> list[Row] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            # Several top-level values one per line: JSON Lines saved as .json (common, and what `datasets`
            # accepts too). Read it as JSON Lines if every line is an object; otherwise report the real error.
            trial: list[Problem] = []
            rows = _read_jsonl(text, source, trial)
            if rows and not trial:
                return rows
        problems.append(
            Problem(
                f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                where=f"{source} line {e.lineno}",
                fix="fix the JSON at that position (a JSON validator or `python -m json.tool FILE` shows it)",
            )
        )
        return None
    return _rows_from_json(value, source, problems)


def _rows_from_json(value: Any, source: str, problems: list[Problem]) -> list[Row] | None:
    if isinstance(value, list):
        return _rows_from_list(value, source, problems)
    if isinstance(value, dict):
        data = value.get("data")
        if isinstance(data, list) and data and any(isinstance(a, dict) and "paragraphs" in a for a in data):
            return flatten_squad(value, source, problems)
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


def _rows_from_list(items: list, source: str, problems: list[Problem]) -> list[Row]:
    rows: list[Row] = []
    not_object = _Capped(problems, source, "items")
    for i, item in enumerate(items, 1):
        where = f"{source} item {i}"
        if isinstance(item, dict):
            rows.append(Row(fields=item, where=where, index=len(rows)))
        else:
            not_object.add(
                Problem(
                    f"item is a JSON {_json_type(item)}, not an object",
                    where=where,
                    fix='make every item of the list an object, e.g. {"input": "...", "target": "..."}',
                )
            )
    not_object.close()
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


def flatten_squad(obj: dict, source: str, problems: list[Problem]) -> list[Row]:
    """Turn a SQuAD-format object into one row per answerable question.

    Each row has ``input`` (``"{context}\\n\\nQuestion: {question}"``), ``target`` (the first answer's text),
    ``answers`` (every distinct answer text, in order, for scoring), ``id``, ``context`` and ``question``.

    Args:
        obj: the parsed file, ``{"data": [{"paragraphs": [{"context": ..., "qas": [...]}]}]}``.
        source: the file's path as shown in messages.
        problems: unanswerable questions (SQuAD v2) and malformed entries are appended here.

    Returns:
        The rows of the well-formed, answerable questions.
    """
    rows: list[Row] = []
    unanswerable = _Capped(problems, source, "questions")
    malformed = _Capped(problems, source, "entries")
    shape_fix = f"SQuAD files need {_SQUAD_SHAPE}; fix or remove this entry"
    for a, article in enumerate(obj.get("data") or [], 1):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            malformed.add(Problem("'paragraphs' is not a list", where=f"{source} (article {a})", fix=shape_fix))
            continue
        for p, paragraph in enumerate(paragraphs, 1):
            place = f"article {a}, paragraph {p}"
            if not isinstance(paragraph, dict):
                malformed.add(Problem("paragraph is not an object", where=f"{source} ({place})", fix=shape_fix))
                continue
            context = paragraph.get("context")
            qas = paragraph.get("qas")
            if not isinstance(context, str) or not isinstance(qas, list):
                malformed.add(
                    Problem(
                        "paragraph needs a string 'context' and a list 'qas'",
                        where=f"{source} ({place})",
                        fix=shape_fix,
                    )
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
        malformed.add(Problem("question entry is not an object", where=f"{source} ({place})", fix=shape_fix))
        return None
    # An id is only a label for reports; a file without ids still trains, so number the question instead.
    qid = qa.get("id", fallback_id)
    where = f"{source} question id {qid} ({place})"
    question = qa.get("question")
    answers = qa.get("answers")
    if not isinstance(question, str) or not isinstance(answers, list):
        malformed.add(Problem("question needs a string 'question' and a list 'answers'", where=where, fix=shape_fix))
        return None
    texts: list[str] = []
    for answer in answers:
        text = answer.get("text") if isinstance(answer, dict) else None
        if not isinstance(text, str):
            malformed.add(Problem("an answer has no string 'text'", where=where, fix=shape_fix))
            return None
        if text not in texts:
            texts.append(text)
    if not texts or qa.get("is_impossible") is True:
        unanswerable.add(
            Problem(
                f"question {qid} has no answer (SQuAD v2 unanswerable): {question!r}",
                where=where,
                fix="remove unanswerable questions (or pre-filter: keep questions whose 'answers' list is non-empty)",
            )
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


def _read_delimited(text: str, source: str, delimiter: str, problems: list[Problem]) -> list[Row] | None:
    trial: list[Problem] = []
    rows = _parse_delimited(text, source, delimiter, csv.QUOTE_MINIMAL, trial)
    if trial and delimiter == "\t":
        # Many TSVs (GLUE among them) never quote, and a sentence opening with '"' is text, not a quoted field.
        # If the file only parses as unquoted, it was written unquoted.
        unquoted: list[Problem] = []
        plain = _parse_delimited(text, source, delimiter, csv.QUOTE_NONE, unquoted)
        if not unquoted:
            return plain
    problems.extend(trial)
    return rows


def _parse_delimited(text: str, source: str, delimiter: str, quoting: int, problems: list[Problem]) -> list[Row] | None:
    # strict=True: an unclosed quote otherwise silently swallows the rest of the file into one cell.
    # newline="\n": physical lines split on '\n' only, so line numbers agree with editors and the UTF-8 check.
    reader = csv.reader(
        io.StringIO(text, newline="\n"), delimiter=delimiter, quoting=quoting, strict=quoting != csv.QUOTE_NONE
    )
    kind = "CSV" if delimiter == "," else "TSV"
    # Long documents in one cell are normal for fine-tuning data; the csv default of 128 KiB per cell is not.
    old_limit = csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    rows: list[Row] = []
    wrong_count = _Capped(problems, source, "lines")
    try:
        header: list[str] | None = None
        last_line = 0
        for record in reader:
            first_line, last_line = last_line + 1, reader.line_num
            if not record or (len(record) == 1 and not record[0].strip()):
                continue
            if header is None:
                header = _header(record, source, first_line, kind, problems)
                if header is None:
                    return None
                continue
            if len(record) != len(header):
                wrong_count.add(
                    Problem(
                        f"expected {len(header)} cells (as in the header) but got {len(record)}",
                        where=f"{source} line {first_line}",
                        fix=_cell_fix(kind),
                    )
                )
                continue
            rows.append(
                Row(fields=dict(zip(header, record, strict=True)), where=f"{source} line {first_line}", index=len(rows))
            )
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
    return rows


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
    rows: list[Row], fields: list[tuple[str, str]], problems: list[Problem], source: str
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

    Returns:
        ``(rows, notes)``: the rows with no problem in any checked field, numeric values converted to strings, and
        one human note per field that had numbers converted.
    """
    notes: list[str] = []
    bad: set[int] = set()
    converted: dict[int, dict[str, str]] = {}
    present: list[str] | None = None
    for field, flag in fields:
        missing: list[Row] = []
        null: list[Row] = []
        empty: list[Row] = []
        wrong: dict[str, list[Row]] = {}
        numeric: list[tuple[Row, Any]] = []
        for position, row in enumerate(rows):
            if field not in row.fields:
                missing.append(row)
                bad.add(position)
                continue
            value = row.fields[field]
            if isinstance(value, str):
                if not value.strip():
                    empty.append(row)
                    bad.add(position)
            elif value is None or _is_nan(value):
                # NaN is how pandas writes a missing cell; str() would turn it into the text "nan".
                null.append(row)
                bad.add(position)
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                numeric.append((row, value))
                converted.setdefault(position, {})[field] = str(value)
            else:
                wrong.setdefault(_value_type(value), []).append(row)
                bad.add(position)

        if rows and len(missing) == len(rows):
            if present is None:
                present = sorted({name for row in rows for name in row.fields})
            problems.append(_field_not_found(field, flag, present, source))
            continue
        if missing:
            problems.append(
                Problem(
                    f"{len(missing)} of {len(rows)} rows {_have(len(missing))} no '{field}' field: {_wheres(missing, source)}",
                    where=source,
                    fix=f"add '{field}' to these rows or remove them",
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
                    fix="fill in or remove these rows",
                )
            )
        for type_name, wrong_rows in wrong.items():
            problems.append(
                Problem(
                    f"{_count(len(wrong_rows))} {_have(len(wrong_rows))} a {type_name} as '{field}', not text: {_wheres(wrong_rows, source)}",
                    where=source,
                    fix=f"make '{field}' a single string in every row (pick or join list items; json.dumps objects), "
                    f"or pass {flag} NAME to use another field",
                )
            )
        if numeric:
            first_row, first_value = numeric[0]
            notes.append(
                f"{_count(len(numeric))} had a numeric '{field}'; converted to text "
                f"(e.g. {first_row.where}: {first_value!r} -> {str(first_value)!r})"
            )

    kept: list[Row] = []
    for position, row in enumerate(rows):
        if position in bad:
            continue
        updates = converted.get(position)
        kept.append(row.with_fields(**updates) if updates else row)
    return kept, notes


def _field_not_found(field: str, flag: str, present: list[str], source: str) -> Problem:
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
