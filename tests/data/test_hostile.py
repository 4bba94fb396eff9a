"""Hostile input files: each loads correctly or stops with a problem naming the file and line, in both modes.

``error`` mode (``rejects=None``) turns every bad row into a :class:`Problem`; ``skip`` mode (``rejects=[]``) turns it
into one :class:`Rejected` and keeps the good rows. File-level damage is a problem in both modes. The fuzz tests at the
end generate files mixing good and hostile records and check that nothing escapes as a traceback and that every
record is either returned, rejected, or covered by a file-level problem.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from surefit.data.readers import MAX_ROW_BYTES, Rejected, check_text_fields, read_rows
from surefit.data.rows import Row
from surefit.errors import Problem, SurefitError

FIELDS = [("input", "--input_field"), ("target", "--target_field")]
SKIP_HINT = "--on_bad_rows skip"


def _load(path: Path, skip: bool) -> tuple[list[Row], list[Problem], list[Rejected] | None]:
    """What a task's load_data does: read, then check the text fields, in one mode."""
    problems: list[Problem] = []
    rejects: list[Rejected] | None = [] if skip else None
    rows = read_rows(path, problems, rejects=rejects)
    if rows:
        rows, _ = check_text_fields(rows, FIELDS, problems, str(path), rejects=rejects)
    return rows, problems, rejects


def _lines(*objs: object) -> bytes:
    return b"".join((o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n" for o in objs)


def _good(i: int) -> dict:
    return {"input": f"q{i}", "target": f"a{i}"}


def _rejected(rejects: list[Rejected]) -> list[tuple[str, str]]:
    return [(r.where, r.reason) for r in rejects]


# --- Rejected ------------------------------------------------------------------------------------------------------


def test_rejected_to_json_and_raw_is_cut_to_2000_chars(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(_good(1), b"[" + b"1, " * 3000 + b"1]"))
    rows, problems, rejects = _load(path, skip=True)
    assert problems == [] and len(rows) == 1
    assert len(rejects) == 1 and len(rejects[0].raw) == 2000 and rejects[0].raw.startswith("[1, 1, ")
    assert rejects[0].to_json() == {"where": f"{path} line 2", "reason": rejects[0].reason, "raw": rejects[0].raw}


# --- truncated JSONL and wrong top-level types ------------------------------------------------------------------------


def test_truncated_jsonl_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(_good(1), b'{"input": "q2", "tar', _good(3)))
    rows, problems, rejects = _load(path, skip=True)
    assert [r.where for r in rows] == [f"{path} line 1", f"{path} line 3"]
    assert problems == []
    assert [r.where for r in rejects] == [f"{path} line 2"]
    assert rejects[0].reason.startswith("not valid JSON: Unterminated string")
    assert rejects[0].raw == '{"input": "q2", "tar'

    rows, problems, _ = _load(path, skip=False)
    assert [(p.where, p.what[:15]) for p in problems] == [(f"{path} line 2", "not valid JSON:")]
    assert SKIP_HINT in problems[0].fix


def test_wrong_top_level_types_are_row_level(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(_good(1), 3, [1, 2], "text", None, True, _good(7)))
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ["q1", "q7"] and problems == []
    assert _rejected(rejects) == [
        (f"{path} line 2", "line holds a JSON number, not an object"),
        (f"{path} line 3", "line holds a JSON array, not an object"),
        (f"{path} line 4", "line holds a JSON string, not an object"),
        (f"{path} line 5", "line holds a JSON null, not an object"),
        (f"{path} line 6", "line holds a JSON boolean, not an object"),
    ]
    assert [r.raw for r in rejects] == ["3", "[1, 2]", '"text"', "null", "true"]

    _, problems, _ = _load(path, skip=False)
    assert [p.where for p in problems] == [f"{path} line {n}" for n in range(2, 7)]
    assert all(SKIP_HINT in p.fix for p in problems)


def test_json_list_items_that_are_not_objects_are_rejected_in_skip_mode(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([_good(1), "oops", _good(3)]))
    rows, problems, rejects = _load(path, skip=True)
    assert [r.where for r in rows] == [f"{path} item 1", f"{path} item 3"] and problems == []
    assert _rejected(rejects) == [(f"{path} item 2", "item is a JSON string, not an object")]


def test_rejects_are_not_capped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(_good(1)) + b"not json\n" * 25)
    rows, problems, rejects = _load(path, skip=True)
    assert len(rows) == 1 and problems == []
    assert [r.where for r in rejects] == [f"{path} line {n}" for n in range(2, 27)]

    _, problems, _ = _load(path, skip=False)
    assert len(problems) == 21 and problems[20].what == "... and 5 more lines with the same problem"
    assert SKIP_HINT in problems[20].fix


# --- field values ----------------------------------------------------------------------------------------------------


def test_null_empty_missing_and_non_text_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    rows_in = [
        _good(1),
        {"input": "q2", "target": None},
        {"input": "q3", "target": "  "},
        {"input": "q4"},
        {"input": "q5", "target": ["a", "b"]},
        {"input": "q6", "target": 1912},
        {"input": None, "target": False},
        {"input": "q8", "target": float("nan")},
    ]
    path.write_bytes(_lines(*rows_in))
    rows, problems, rejects = _load(path, skip=True)
    assert [(r.fields["input"], r.fields["target"]) for r in rows] == [("q1", "a1"), ("q6", "1912")]
    assert problems == []
    assert _rejected(rejects) == [
        (f"{path} line 2", "'target' is null"),
        (f"{path} line 3", "'target' is empty or whitespace-only"),
        (f"{path} line 4", "no 'target' field"),
        (f"{path} line 5", "'target' is a list, not text"),
        (f"{path} line 7", "'input' is null; 'target' is a boolean, not text"),  # one entry per row, every reason
        (f"{path} line 8", "'target' is null"),
    ]
    assert json.loads(rejects[3].raw) == {"input": "q5", "target": ["a", "b"]}

    rows, problems, _ = _load(path, skip=False)
    assert all(p.where == str(path) and SKIP_HINT in p.fix for p in problems)
    assert "line 2, line 3, line 8" in " ".join(p.what for p in problems)


def test_field_missing_from_every_row_stays_a_problem_in_skip_mode(tmp_path):
    # A wrong --target_field is the user's flag, not the rows: rejecting every row would hide the real fix.
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines({"input": "a", "answer": "x"}, {"input": "b", "answer": "y"}))
    rows, problems, rejects = _load(path, skip=True)
    assert rows == [] and rejects == []
    assert [p.where for p in problems] == ["--target_field"]
    assert "one of: 'answer', 'input'" in problems[0].fix


def test_squad_unanswerable_question_is_rejected_in_skip_mode(tmp_path):
    qas = [
        {"id": "q1", "question": "Where?", "answers": [{"text": "France"}]},
        {"id": "q2", "question": "Who?", "answers": [], "is_impossible": True},
        "not a question",
    ]
    path = tmp_path / "squad.json"
    path.write_text(json.dumps({"data": [{"paragraphs": [{"context": "Paris is in France.", "qas": qas}]}]}))
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["id"] for r in rows] == ["q1"] and problems == []
    assert [r.where for r in rejects] == [
        f"{path} question id q2 (article 1, paragraph 1)",
        f"{path} (article 1, paragraph 1)",
    ]
    assert "q2 has no answer" in rejects[0].reason and json.loads(rejects[0].raw)["id"] == "q2"
    assert rejects[1].reason == "question entry is not an object"

    _, problems, _ = _load(path, skip=False)
    assert len(problems) == 2 and all(SKIP_HINT in p.fix for p in problems)


# --- every row rejected ------------------------------------------------------------------------------------------------


def test_file_whose_every_row_is_rejected_is_a_file_level_problem(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"nope\n[1]\n")
    rows, problems, rejects = _load(path, skip=True)
    assert rows == [] and len(rejects) == 2
    assert [p.what for p in problems] == [f"no usable rows in {path}: all 2 rows rejected (see rejected_rows.jsonl)"]
    assert f"the first: {path} line 1: not valid JSON" in problems[0].fix


def test_all_rejected_counts_rows_rejected_while_reading_and_while_checking(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(b"nope", {"input": "a", "target": ""}, {"input": "b", "target": None}))
    rows, problems, rejects = _load(path, skip=True)
    assert rows == [] and [r.where for r in rejects] == [f"{path} line {n}" for n in (1, 2, 3)]
    assert [p.what for p in problems] == [f"no usable rows in {path}: all 3 rows rejected (see rejected_rows.jsonl)"]


def test_all_rejected_in_check_text_fields_alone():
    rows = [Row(fields={"input": "a", "target": ""}, where="d.jsonl line 1", index=0)]
    problems: list[Problem] = []
    rejects: list[Rejected] = []
    kept, _ = check_text_fields(rows, FIELDS, problems, "d.jsonl", rejects=rejects)
    assert kept == [] and len(rejects) == 1
    assert [p.what for p in problems] == ["no usable rows in d.jsonl: all 1 row rejected (see rejected_rows.jsonl)"]


# --- CSV ---------------------------------------------------------------------------------------------------------------


def test_csv_wrong_cell_count_is_rejected_in_skip_mode(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("input,target\na,b\nc,d,e\nf\ng,h\n")
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ["a", "g"] and problems == []
    assert _rejected(rejects) == [
        (f"{path} line 3", "expected 2 cells (as in the header) but got 3"),
        (f"{path} line 4", "expected 2 cells (as in the header) but got 1"),
    ]
    assert [r.raw for r in rejects] == ["c,d,e", "f"]


def test_csv_unclosed_quote_is_file_level_in_both_modes(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('input,target\na,b\nc,"never closed\nd,e\n')
    for skip in (True, False):
        rows, problems, rejects = _load(path, skip)
        assert [r.fields["input"] for r in rows] == ["a"]
        assert len(problems) == 1 and problems[0].what.startswith("malformed CSV: unexpected end of data")
        assert SKIP_HINT not in problems[0].fix
        assert rejects in ([], None)


def test_tsv_read_unquoted_in_both_modes(tmp_path):
    # The quoted-vs-unquoted choice must not depend on the mode: a line rejected for its bytes is rejected either way.
    path = tmp_path / "d.tsv"
    path.write_bytes(b'input\ttarget\n"great" he said\t1\nok\t0\nb\xe9d\t1\n')
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ['"great" he said', "ok"] and problems == []
    assert [r.where for r in rejects] == [f"{path} line 4"]
    rows, problems, _ = _load(path, skip=False)
    assert [r.fields["input"] for r in rows][:2] == ['"great" he said', "ok"]
    assert [(p.where, p.what[:15]) for p in problems] == [(f"{path} line 4", "not valid UTF-8")]


# --- encodings -----------------------------------------------------------------------------------------------------------


def test_non_utf8_lines_skip_mode_rejects_only_those_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'{"input": "ok", "target": "1"}\n{"input": "caf\xe9", "target": "2"}\n{"input": "x", "target": "3"}\n'
    )
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["target"] for r in rows] == ["1", "3"] and problems == []
    assert [r.where for r in rejects] == [f"{path} line 2"]
    assert rejects[0].reason == "not valid UTF-8: byte 0xE9 at byte 15 of the line; as Windows-1252 it would read 'é'"
    assert rejects[0].raw == '{"input": "caf\\xe9", "target": "2"}'

    _, problems, _ = _load(path, skip=False)
    assert len(problems) == 1 and problems[0].where == f"{path} line 2"
    assert "1 line in the file has invalid bytes" in problems[0].what
    assert problems[0].fix.startswith("re-save the file as UTF-8") and SKIP_HINT in problems[0].fix


def test_non_utf8_inside_a_multiline_csv_record(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b'input,target\n"two\nlin\xe9s",x\nok,y\n')
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ["ok"] and problems == []
    assert [r.where for r in rejects] == [f"{path} line 2"]
    assert rejects[0].reason.endswith("(line 3, inside this record)")


def test_non_utf8_csv_header_is_file_level_in_skip_mode(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b"inp\xe9ut,target\na,b\n")
    rows, problems, rejects = _load(path, skip=True)
    assert rows == [] and rejects == []
    assert [p.where for p in problems] == [f"{path} line 1"]
    assert problems[0].what.startswith("the header line is not valid UTF-8: byte 0xE9 at byte 4 of the line")


def test_non_utf8_in_a_json_document_is_file_level_in_skip_mode(tmp_path):
    # A .json document has no lines to drop one by one, so its bad bytes stop the file.
    path = tmp_path / "d.json"
    path.write_bytes(b'[{"input": "caf\xe9", "target": "x"}]')
    for skip in (True, False):
        _, problems, rejects = _load(path, skip)
        assert [p.where for p in problems] == [f"{path} line 1"] and not rejects
        assert problems[0].what.startswith("not valid UTF-8") and SKIP_HINT not in problems[0].fix


def test_bom_crlf_and_mixed_line_endings_load_the_same_in_both_modes(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"input": "a", "target": "x"}\r\n{"input": "b", "target": "y"}\n\r\n')
    csv_path = tmp_path / "d.csv"
    csv_path.write_bytes(b'\xef\xbb\xbfinput,target\r\n"x\r\ny",b\nc,d\r\n')
    for skip in (True, False):
        rows, problems, rejects = _load(jsonl, skip)
        assert problems == [] and not rejects
        assert [(r.fields["input"], r.where) for r in rows] == [("a", f"{jsonl} line 1"), ("b", f"{jsonl} line 2")]
        rows, problems, rejects = _load(csv_path, skip)
        assert problems == [] and not rejects
        assert [r.fields for r in rows] == [{"input": "x\r\ny", "target": "b"}, {"input": "c", "target": "d"}]


def test_byte_order_mark_in_the_middle_of_concatenated_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(_good(1)) + b"\xef\xbb\xbf" + _lines(_good(2)))
    rows, problems, _ = _load(path, skip=False)
    assert problems == [] and [r.fields["input"] for r in rows] == ["q1", "q2"]


# --- binary, UTF-16 ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.csv", "d.tsv"])
def test_binary_garbage_is_one_file_level_problem(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b'{"input": "a"}\n' + bytes(range(256)) * 4)
    kind = {"d.jsonl": "JSONL", "d.json": "JSON", "d.csv": "CSV", "d.tsv": "TSV"}[name]
    for skip in (True, False):
        rows, problems, rejects = _load(path, skip)
        assert rows == [] and not rejects
        assert [(p.where, p.what) for p in problems] == [
            (str(path), f"looks like a binary file, not {kind} (NUL byte at offset 15)")
        ]


def test_control_bytes_without_nul_are_binary(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(bytes(range(1, 32)) * 10)
    _, problems, _ = _load(path, skip=True)
    assert len(problems) == 1 and problems[0].what.startswith("looks like a binary file, not JSONL (")
    assert "control bytes" in problems[0].what


def test_text_in_other_scripts_is_not_binary(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines({"input": "Привет, 你好, مرحبا " * 50, "target": "ok\tfine"}))
    rows, problems, _ = _load(path, skip=False)
    assert problems == [] and len(rows) == 1


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_and_utf32_files_say_so(tmp_path, encoding):
    path = tmp_path / "d.jsonl"
    data = _lines(_good(1), _good(2)).decode().encode(encoding)
    if encoding == "utf-16-be":
        data = b"\xfe\xff" + data
    path.write_bytes(data)
    name = "UTF-32" if encoding == "utf-32" else "UTF-16"
    for skip in (True, False):
        rows, problems, _ = _load(path, skip)
        assert rows == [] and len(problems) == 1
        assert problems[0].where == str(path)
        assert f"is {name} (" in problems[0].what and problems[0].what.endswith("re-save as UTF-8")
        assert f"iconv -f {name} -t UTF-8" in problems[0].fix


def test_utf16_without_byte_order_mark(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes("input,target\na,b\n".encode("utf-16-le"))
    _, problems, _ = _load(path, skip=True)
    assert len(problems) == 1 and "is UTF-16 (no byte order mark" in problems[0].what


# --- huge lines ------------------------------------------------------------------------------------------------------------


def test_huge_line_is_refused_as_a_row_level_problem(tmp_path):
    path = tmp_path / "d.jsonl"
    huge = json.dumps({"input": "x" * (MAX_ROW_BYTES + 2**20), "target": "t"})
    path.write_bytes(_lines(_good(1)) + huge.encode() + b"\n" + _lines(_good(3)))
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ["q1", "q3"] and problems == []
    assert _rejected(rejects) == [(f"{path} line 2", "line 2 is 17.0 MiB; rows over 16 MiB are refused")]
    assert len(rejects[0].raw) == 2000

    _, problems, _ = _load(path, skip=False)
    assert [(p.where, p.what) for p in problems] == [
        (f"{path} line 2", "line 2 is 17.0 MiB; rows over 16 MiB are refused")
    ]


def test_one_mib_line_loads_normally(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines({"input": "é" * 2**19, "target": "t"}, _good(2)))
    rows, problems, rejects = _load(path, skip=True)
    assert problems == [] and rejects == [] and len(rows[0].fields["input"]) == 2**19


def test_huge_csv_record_is_refused(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text(f"input,target\n{'x' * (MAX_ROW_BYTES + 1)},t\na,b\n")
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ["a"] and problems == []
    assert _rejected(rejects) == [
        (f"{path} line 2", "the record at line 2 is 16.0 MiB (16,777,219 bytes); rows over 16 MiB are refused")
    ]


def test_json_python_cannot_hold_is_a_problem_not_a_crash(tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000
    long_int = b'{"input": "a", "target": ' + b"1" * 5000 + b"}"
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(_good(1), deep, long_int, _good(4)))
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ["q1", "q4"] and problems == []
    assert [r.where for r in rejects] == [f"{path} line 2", f"{path} line 3"]
    assert rejects[0].reason.startswith("not valid JSON: nested too deeply to read")
    assert "4300 digits" in rejects[1].reason

    doc = tmp_path / "d.json"
    doc.write_bytes(b'[{"input": "a", "target": ' + deep + b"}]")
    for skip in (True, False):
        rows, problems, _ = _load(doc, skip)
        assert rows == [] and [p.what[:30] for p in problems] == [f"cannot read {doc} as JSON"[:30]]


# --- duplicate keys --------------------------------------------------------------------------------------------------------


def test_duplicate_key_in_a_jsonl_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(_good(1), b'{"input": "q2", "target": "a", "target": "b"}', _good(3)))
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ["q1", "q3"] and problems == []
    assert _rejected(rejects) == [(f"{path} line 2", "duplicate key 'target' (values 'a' and 'b')")]
    assert rejects[0].raw == '{"input": "q2", "target": "a", "target": "b"}'

    _, problems, _ = _load(path, skip=False)
    assert [(p.where, p.what) for p in problems] == [(f"{path} line 2", "duplicate key 'target' (values 'a' and 'b')")]
    assert problems[0].fix.startswith("keep one of them") and SKIP_HINT in problems[0].fix


def test_duplicate_key_in_a_json_list_item_and_nested_duplicates_ignored(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(
        '[{"input": "a", "target": "x", "input": "b"}, {"input": "c", "target": "y", "m": {"k": 1, "k": 2}}]'
    )
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ["c"] and problems == []
    assert _rejected(rejects) == [(f"{path} item 1", "duplicate key 'input' (values 'a' and 'b')")]


def test_duplicate_key_in_a_jsonl_file_holding_a_json_array(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('[\n  {"input": "a", "target": "x", "target": "y"},\n  {"input": "c", "target": "z"}\n]\n')
    rows, problems, rejects = _load(path, skip=True)
    assert [r.fields["input"] for r in rows] == ["c"] and problems == []
    assert [r.where for r in rejects] == [f"{path} item 1"]


# --- empty files, folders ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"\n\n  \r\n", b"\xef\xbb\xbf"])
def test_empty_file_is_a_file_level_problem_in_both_modes(tmp_path, content):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    for skip in (True, False):
        rows, problems, rejects = _load(path, skip)
        assert rows == [] and not rejects and [p.what for p in problems] == [f"no rows in {path}"]


def test_folder_where_a_file_was_expected(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(_lines(_good(1)))
    for skip in (True, False):
        rows, problems, rejects = _load(tmp_path, skip)
        assert rows == [] and not rejects and len(problems) == 1
        assert problems[0].what == f"{tmp_path} is a folder, not a data file or a saved `datasets` folder"
        assert str(tmp_path / "train.jsonl") in problems[0].fix


def test_missing_file_and_unknown_format_are_file_level_in_skip_mode(tmp_path):
    (tmp_path / "d.xlsx").write_bytes(b"PK\x03\x04")
    for name in ("nope.jsonl", "d.xlsx"):
        rows, problems, rejects = _load(tmp_path / name, skip=True)
        assert rows == [] and rejects == [] and len(problems) == 1


# --- fuzz ----------------------------------------------------------------------------------------------------------------

# Cell and value text: anything printable, plus the characters that make CSV and JSON quote or escape.
_TEXT = st.text(st.characters(exclude_categories=("Cs", "Cc", "Co")) | st.sampled_from(',"\n\r\t \\'), max_size=12)
# Stands in for an invalid byte inside a value; private-use, so it never occurs in _TEXT.
_MARK = "\ue000"
_BAD_BYTES = st.sampled_from([b"\xe9", b"\xff", b"\x80", b"\xc3(", b"\xed\xa0\x80"])


def _usable(*values: str) -> bool:
    return all(v.strip() for v in values)


def _is_blank(record: bytes) -> bool:
    # The readers' own rule: a line with nothing but whitespace is a separator, not a row.
    return not record.decode("utf-8", "replace").strip()


@st.composite
def _jsonl_record(draw) -> tuple[bytes, bool]:
    """One JSONL line (no newline) and whether it is bad (must be reported in error mode)."""
    kind = draw(st.sampled_from(["good", "good", "good", "truncated", "binary", "non_object", "duplicate", "value",
                                 "bad_utf8", "blank", "unholdable"]))  # fmt: skip
    inp, tgt = draw(_TEXT), draw(_TEXT)
    ascii_only = draw(st.booleans())
    if kind == "good":
        return json.dumps({"input": inp, "target": tgt}, ensure_ascii=ascii_only).encode(), not _usable(inp, tgt)
    if kind == "truncated":
        line = json.dumps({"input": inp, "target": tgt}).encode()
        return line[: draw(st.integers(1, len(line) - 1))], True
    if kind == "binary":
        junk = draw(st.binary(max_size=16)).replace(b"\n", b"")
        at = draw(st.integers(0, len(junk)))
        return junk[:at] + draw(st.sampled_from([b"\x00", b"\x01", b"\xff", b"\x80", b"\x1b\x7f"])) + junk[at:], True
    if kind == "non_object":
        return draw(st.sampled_from([b"3", b"-1.5e3", b"[1, 2]", b"[]", b'"text"', b"null", b"true"])), True
    if kind == "unholdable":  # valid JSON text that Python refuses: deep nesting, a 5,000-digit integer
        return draw(
            st.sampled_from([b"[" * 5000 + b"]" * 5000, b'{"input": "a", "target": ' + b"9" * 5000 + b"}"])
        ), True
    if kind == "duplicate":
        return f'{{"input": {json.dumps(inp)}, "target": {json.dumps(tgt)}, "target": "again"}}'.encode(), True
    if kind == "value":
        value = draw(st.sampled_from([None, "", "  ", [], ["a"], {}, {"t": 1}, False, 7, 2.5, float("nan")]))
        bad = not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or not inp.strip()
        return json.dumps({"input": inp, "target": value}).encode(), bad
    if kind == "bad_utf8":
        line = json.dumps({"input": inp + _MARK, "target": tgt}, ensure_ascii=False).encode()
        return line.replace(_MARK.encode(), draw(_BAD_BYTES)), True
    return draw(st.sampled_from([b"", b"  ", b"\t", b"\r"])), False


@st.composite
def _csv_record(draw) -> tuple[bytes, bool]:
    """One CSV record (with its line ending) and whether it is bad."""
    kind = draw(st.sampled_from(["good", "good", "good", "cells", "bad_utf8", "blank", "nul"]))
    inp, tgt = draw(_TEXT), draw(_TEXT)
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator=ending)
    if kind == "good":
        writer.writerow([inp, tgt])
        return out.getvalue().encode(), not _usable(inp, tgt)
    if kind == "cells":
        writer.writerow(draw(st.sampled_from([[inp, tgt, "extra"], ["one" + inp]])))
        return out.getvalue().encode(), True
    if kind == "bad_utf8":
        writer.writerow([inp + _MARK, tgt])
        return out.getvalue().encode().replace(_MARK.encode(), draw(_BAD_BYTES)), True
    if kind == "nul":
        writer.writerow([inp + "\x00", tgt])  # NUL in the first 8 KiB: the whole file is binary
        return out.getvalue().encode(), True
    return draw(st.sampled_from(["", "  ", "\t"])).encode() + ending.encode(), False


def _check_both_modes(path: Path, records: list[tuple[bytes, bool]], file_bad: bool) -> None:
    written = sum(1 for data, _ in records if not _is_blank(data))
    any_bad = file_bad or any(bad for _, bad in records)
    for skip in (True, False):
        try:
            rows, problems, rejects = _load(path, skip)
        except SurefitError:  # the CLI prints these without a traceback; anything else fails the test
            continue
        for row in rows:
            assert isinstance(row.fields["input"], str) and row.fields["input"].strip()
            assert isinstance(row.fields["target"], str) and row.fields["target"].strip()
        if skip:
            accounted = len(rows) + len(rejects)
            if problems:
                # A file-level problem stops the run, so rows it cut short are reported by it.
                assert accounted <= written, (accounted, written, problems)
            else:
                assert accounted == written, (rows, rejects)
                assert not any_bad or rejects
        elif any_bad:
            assert problems, "a bad record was written but error mode reported nothing"


_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(
    records=st.lists(_jsonl_record(), max_size=12),
    endings=st.lists(st.sampled_from([b"\n", b"\r\n"]), min_size=12, max_size=12),
    bom=st.booleans(),
    final_newline=st.booleans(),
)
def test_fuzz_jsonl(tmp_path_factory, records, endings, bom, final_newline):
    path = tmp_path_factory.getbasetemp() / "fuzz.jsonl"
    body = b"".join(data + end for (data, _), end in zip(records, endings, strict=False))
    if records and not final_newline:
        body = body[: -len(endings[len(records) - 1])]
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + body)
    _check_both_modes(path, records, file_bad=not records)


@_FUZZ
@given(
    records=st.lists(_csv_record(), max_size=12),
    bom=st.booleans(),
    truncate=st.booleans(),
)
def test_fuzz_csv(tmp_path_factory, records, bom, truncate):
    path = tmp_path_factory.getbasetemp() / "fuzz.csv"
    body = b"input,target\r\n" + b"".join(data for data, _ in records)
    if truncate:
        # A download cut short inside a quoted cell: csv stops there, and that must be a problem, not silence.
        records = records + [(b'x,"cut short', True)]
        body += b'x,"cut short'
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + body)
    _check_both_modes(path, records, file_bad=not records)
