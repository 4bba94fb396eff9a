"""One data source, whatever its kind, into rows: the kind from the extension (or a folder), every problem listed."""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

from surefit.data.readers.common import (
    DATA_EXTS,
    JSONL_EXTS,
    KIND_OF_EXT,
    SUPPORTED_FORMATS,
    Rejected,
    all_rejected_problem,
)
from surefit.data.readers.delimited import read_delimited
from surefit.data.readers.json_rows import read_json, read_jsonl
from surefit.data.readers.tabular import read_dataset_folder, read_parquet
from surefit.data.readers.text import not_a_regular_file, read_text
from surefit.data.rows import Row
from surefit.errors import Problem


def read_rows(path: str | os.PathLike, problems: list[Problem], *, rejects: list[Rejected] | None = None,
              limit: int | None = None) -> list[Row]:
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
        limit: stop after this many rows: a JSONL, CSV or TSV file is then read no further (a .json document or
            Parquet file is read whole).

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
    irregular = not_a_regular_file(p, source)
    if irregular is not None:
        problems.append(irregular)
        return []

    ext = p.suffix.lower()
    if ext not in DATA_EXTS:
        problems.append(_unknown_extension_problem(p, source, ext))
        return []

    try:
        rows = _read_file(p, source, ext, problems, rejects, limit)
    except MemoryError:
        # The size check before reading leaves this to memory taken by others meanwhile, or a format that grows
        # in memory far past its size (Parquet); a named problem, not a traceback.
        problems.append(Problem(f"ran out of memory reading {source} ({os.path.getsize(source) / 2**20:,.0f} MiB)",
                                fix="pass a part of it (--limit N reads only the first N rows of a JSONL, CSV or "
                                    "TSV file), split the file, or free memory"))
        return []
    if rows is None:
        return []
    # "No rows" only when nothing else explains it: a file whose every line is broken already says why.
    if not rows and len(problems) == before:
        rejected = rejects[rejected_before:] if rejects is not None else []
        if rejected:
            # Skipping bad rows must not turn a wholly broken file into an empty, silently "successful" run.
            problems.append(all_rejected_problem(source, len(rejected), rejected[0]))
        else:
            problems.append(Problem(f"no rows in {source}", fix="check the file: it holds no data rows"))
    return rows


def _read_file(p: Path, source: str, ext: str, problems: list[Problem], rejects: list[Rejected] | None,
               limit: int | None) -> list[Row] | None:
    if ext == ".parquet":
        return read_parquet(source, problems)
    # A .json document has no lines to drop one by one; the other text formats do.
    by_line = ext != ".json"
    decoded = read_text(p, source, KIND_OF_EXT[ext], problems, by_line=by_line, skip=rejects is not None,
                         bounded=limit is not None)
    if decoded is None:
        return None
    at = len(problems)
    if ext in JSONL_EXTS:
        rows = read_jsonl(decoded, source, problems, rejects, limit)
    elif ext == ".json":
        rows = read_json(decoded, source, problems, rejects)
    else:
        rows = read_delimited(decoded, source, "," if ext == ".csv" else "\t", problems, rejects, limit)
    decoded.finish(problems, at)
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
        return read_dataset_folder(source, problems)

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
            found.extend(str(here / f) for f in sorted(files) if Path(f).suffix.lower() in DATA_EXTS)
        if len(found) >= limit or visited > 10_000:
            break
    return found[:limit]
