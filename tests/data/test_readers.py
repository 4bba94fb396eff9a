"""Tests for surefit.data.readers: every format, every user error, and the text-field checks."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from surefit.data.readers import SUPPORTED_FORMATS, check_text_fields, flatten_squad, read_rows
from surefit.data.rows import Row
from surefit.errors import Problem

REPO = Path(__file__).resolve().parents[2]
# The project's shared data sits beside the checkout in CI and on developer machines, but a clone made elsewhere (the
# clean-clone check) has none: those tests skip there, saying why, and the repo's own SQuAD sample is always tested.
_SHARED_CANDIDATES = [REPO.parent / "shared" / "data", Path("/work/shared/data")]
SHARED = next((p for p in _SHARED_CANDIDATES if p.is_dir()), None)
needs_shared = pytest.mark.skipif(SHARED is None, reason=f"shared data not found in {_SHARED_CANDIDATES}")
FIELDS = [("input", "--input_field"), ("target", "--target_field")]


def _read(path: Path) -> tuple[list[Row], list[Problem]]:
    problems: list[Problem] = []
    rows = read_rows(path, problems)
    return rows, problems


def _write_jsonl(path: Path, objs: list) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


def _squad(questions: list[dict]) -> dict:
    return {
        "version": "1.1",
        "data": [{"title": "t", "paragraphs": [{"context": "Paris is in France.", "qas": questions}]}],
    }


# --- formats -------------------------------------------------------------------------------------------------------


def test_jsonl_rows_where_and_index(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"input": "a", "target": "b"}, {"input": "c", "target": "d"}])
    rows, problems = _read(path)
    assert problems == []
    assert [r.fields for r in rows] == [{"input": "a", "target": "b"}, {"input": "c", "target": "d"}]
    assert [r.where for r in rows] == [f"{path} line 1", f"{path} line 2"]
    assert [r.index for r in rows] == [0, 1]


def test_jsonl_blank_lines_skipped_but_counted_in_line_numbers(tmp_path):
    path = tmp_path / "d.JSONL"  # extension matching is case-insensitive
    path.write_text('{"input": "a"}\n\n   \n{"input": "b"}\n\n', encoding="utf-8")
    rows, problems = _read(path)
    assert problems == []
    assert [r.where for r in rows] == [f"{path} line 1", f"{path} line 4"]
    assert [r.index for r in rows] == [0, 1]


def test_ndjson_extension_is_jsonl(tmp_path):
    rows, problems = _read(_write_jsonl(tmp_path / "d.ndjson", [{"x": 1}]))
    assert problems == [] and rows[0].fields == {"x": 1}


def test_json_list_of_objects(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"input": "a", "target": "b"}, {"input": "c", "target": "d"}], indent=2))
    rows, problems = _read(path)
    assert problems == []
    assert [r.fields["target"] for r in rows] == ["b", "d"]
    assert [r.where for r in rows] == [f"{path} item 1", f"{path} item 2"]


def test_json_dict_of_parallel_lists(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"input": ["a", "c", "e"], "target": ["b", "d", "f"]}))
    rows, problems = _read(path)
    assert problems == []
    assert [r.fields for r in rows] == [
        {"input": "a", "target": "b"},
        {"input": "c", "target": "d"},
        {"input": "e", "target": "f"},
    ]
    assert rows[2].where == f"{path} item 3" and rows[2].index == 2


def test_json_dict_of_lists_with_different_lengths_is_a_problem(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"input": ["a", "b", "c"], "target": ["x"]}))
    rows, problems = _read(path)
    assert rows == []
    assert len(problems) == 1
    assert "'input' has 3, 'target' has 1" in problems[0].what
    assert str(path) in problems[0].what


def test_json_other_shape_describes_top_level(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"version": "2", "rows": [{"input": "a"}]}))
    rows, problems = _read(path)
    assert rows == []
    assert len(problems) == 1
    what = problems[0].what
    assert "a JSON object with keys 'version' (a string), 'rows' (a list of 1)" in what
    assert "a list of objects" in what and "SQuAD" in what


def test_json_list_items_that_are_not_objects(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"input": "a"}, "oops", [1]]))
    rows, problems = _read(path)
    assert [r.fields for r in rows] == [{"input": "a"}]
    assert [(p.where, p.what) for p in problems] == [
        (f"{path} item 2", "item is a JSON string, not an object"),
        (f"{path} item 3", "item is a JSON array, not an object"),
    ]


def test_json_file_holding_json_lines_is_read_as_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "d.json", [{"input": "a"}, {"input": "b"}])
    rows, problems = _read(path)
    assert problems == []
    assert [r.where for r in rows] == [f"{path} line 1", f"{path} line 2"]


def test_jsonl_file_holding_a_json_array_is_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps([{"input": "a"}, {"input": "b"}], indent=2))
    rows, problems = _read(path)
    assert problems == []
    assert [r.fields["input"] for r in rows] == ["a", "b"]


def test_invalid_json_reports_line_and_column(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n  {"input": "a"},\n  {"input": "b",}\n]\n')
    rows, problems = _read(path)
    assert rows == []
    assert len(problems) == 1
    assert problems[0].where == f"{path} line 3"
    assert problems[0].what == "not valid JSON: Expecting property name enclosed in double quotes (line 3, column 17)"


def test_csv_with_quoted_multiline_field_uses_first_line_of_record(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('input,target\n"line one\nline two, with comma",yes\nplain,"say ""hi"""\n', encoding="utf-8")
    rows, problems = _read(path)
    assert problems == []
    assert [r.fields for r in rows] == [
        {"input": "line one\nline two, with comma", "target": "yes"},
        {"input": "plain", "target": 'say "hi"'},
    ]
    assert [r.where for r in rows] == [f"{path} line 2", f"{path} line 4"]


def test_csv_values_stay_strings_and_header_is_stripped(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("input, target\nwhat year,1912\n")
    rows, problems = _read(path)
    assert problems == []
    assert rows[0].fields == {"input": "what year", "target": "1912"}


def test_csv_wrong_cell_count_names_line_and_counts(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("input,target\na,b\nc,d,e\nf\ng,h\n")
    rows, problems = _read(path)
    assert [r.fields["input"] for r in rows] == ["a", "g"]
    assert [(p.where, p.what) for p in problems] == [
        (f"{path} line 3", "expected 2 cells (as in the header) but got 3"),
        (f"{path} line 4", "expected 2 cells (as in the header) but got 1"),
    ]
    assert "quote cells" in problems[0].fix


def test_csv_unclosed_quote_is_reported_not_swallowed(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('target,input\nx,"oops\ny,never closed\n')
    rows, problems = _read(path)
    assert rows == []
    assert len(problems) == 1
    assert problems[0].what.startswith("malformed CSV")


def test_csv_empty_header(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text(",\na,b\n")
    rows, problems = _read(path)
    assert rows == []
    assert problems[0].where == f"{path} line 1"
    assert problems[0].what.startswith("empty header")


def test_csv_header_only_has_no_rows(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("input,target\n")
    rows, problems = _read(path)
    assert rows == []
    assert [p.what for p in problems] == [f"no rows in {path}"]


def test_csv_duplicate_header(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("text,text\na,b\n")
    rows, problems = _read(path)
    assert rows == []
    assert problems[0].what == "duplicate column names in the header: 'text'"


def test_tsv_round_trip(tmp_path):
    path = tmp_path / "d.tsv"
    path.write_text("sentence\tlabel\na fine film , with commas\t1\nbad\t0\n")
    rows, problems = _read(path)
    assert problems == []
    assert [r.fields for r in rows] == [
        {"sentence": "a fine film , with commas", "label": "1"},
        {"sentence": "bad", "label": "0"},
    ]
    assert rows[1].where == f"{path} line 3"


def test_tsv_with_unbalanced_quotes_is_read_unquoted(tmp_path):
    # GLUE-style TSVs never quote: a sentence starting with '"' is text.
    path = tmp_path / "d.tsv"
    path.write_text('sentence\tlabel\n"great" he said\t1\nok\t0\n')
    rows, problems = _read(path)
    assert problems == []
    assert rows[0].fields == {"sentence": '"great" he said', "label": "1"}


def test_tsv_without_header_is_a_problem(tmp_path):
    path = tmp_path / "d.tsv"
    sentence = "this movie was a long and winding journey through the worst parts of cinema history"
    path.write_text(f"{sentence}\tneg\nshort\tpos\n")
    rows, problems = _read(path)
    assert rows == []
    assert problems[0].where == f"{path} line 1"
    assert "looks like data, not a header" in problems[0].what
    assert "<TAB>" in problems[0].fix


def test_parquet_round_trip(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input": ["a", "b"], "target": ["x", None], "n": [1, 2]}), path)
    rows, problems = _read(path)
    assert problems == []
    assert [r.fields for r in rows] == [{"input": "a", "target": "x", "n": 1}, {"input": "b", "target": None, "n": 2}]
    assert [r.where for r in rows] == [f"{path} row 1", f"{path} row 2"]


def test_damaged_parquet_is_a_problem(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"not parquet at all")
    rows, problems = _read(path)
    assert rows == []
    assert len(problems) == 1 and problems[0].what.startswith(f"cannot read {path} as Parquet")


def test_datasets_folder_and_dataset_dict_folder(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"input": ["a", "b", "c"], "target": ["x", "y", "z"]})
    folder = tmp_path / "saved"
    ds.save_to_disk(str(folder))
    rows, problems = _read(folder)
    assert problems == []
    assert [r.fields["target"] for r in rows] == ["x", "y", "z"]
    assert rows[2].where == f"{folder} row 3" and rows[2].index == 2

    dd = datasets.DatasetDict({"train": ds, "test": ds})
    dd_folder = tmp_path / "dd"
    dd.save_to_disk(str(dd_folder))
    rows, problems = _read(dd_folder)
    assert rows == []
    assert len(problems) == 1
    assert "holds several splits (train, test)" in problems[0].what
    assert problems[0].fix == f"point --data at one split, e.g. {dd_folder / 'train'}"


def test_squad_flattening(tmp_path):
    obj = _squad(
        [
            {
                "id": "q1",
                "question": "Where is Paris?",
                "answers": [{"text": "France"}, {"text": "in France"}, {"text": "France"}],
            },
            {"id": "q2", "question": "What is Paris?", "answers": [{"text": "a city", "answer_start": 0}]},
        ]
    )
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(obj))
    rows, problems = _read(path)
    assert problems == []
    assert rows[0].fields == {
        "input": "Paris is in France.\n\nQuestion: Where is Paris?",
        "target": "France",
        "answers": ["France", "in France"],
        "id": "q1",
        "context": "Paris is in France.",
        "question": "Where is Paris?",
    }
    assert rows[1].where == f"{path} question id q2 (article 1, paragraph 1)"
    assert [r.index for r in rows] == [0, 1]


def test_squad_unanswerable_question_is_a_problem():
    obj = _squad(
        [
            {"id": "q1", "question": "Where?", "answers": [{"text": "France"}]},
            {"id": "q2", "question": "Who?", "answers": [], "is_impossible": True},
        ]
    )
    problems: list[Problem] = []
    rows = flatten_squad(obj, "s.json", problems)
    assert [r.fields["id"] for r in rows] == ["q1"]
    assert len(problems) == 1
    assert problems[0].where == "s.json question id q2 (article 1, paragraph 1)"
    assert "q2 has no answer" in problems[0].what
    assert "remove unanswerable questions" in problems[0].fix


def test_squad_sample_shipped_in_examples_has_141_questions():
    path = REPO / "examples" / "sft" / "squad-sample.json"
    rows, problems = _read(path)
    assert problems == [] and len(rows) == 141
    assert all(r.fields["answers"] and r.fields["target"] == r.fields["answers"][0] for r in rows)
    assert sum(len(r.fields["answers"]) > 1 for r in rows) > 50  # all gold answers are kept for scoring


@needs_shared
def test_squad_real_file_has_6500_questions():
    path = SHARED / "squad" / "dev-v1.1-part-a.json"
    rows, problems = _read(path)
    assert problems == []
    assert len(rows) == 6500
    first = rows[0]
    assert first.fields["target"] == first.fields["answers"][0]
    assert first.fields["input"].endswith("\n\nQuestion: " + first.fields["question"])
    assert first.where == f"{path} question id {first.fields['id']} (article 1, paragraph 1)"
    kept, notes = check_text_fields(rows, FIELDS, problems, str(path))
    assert len(kept) == 6500 and notes == [] and problems == []


@needs_shared
def test_sst2_real_tsv():
    path = SHARED / "sst2" / "dev.tsv"
    rows, problems = _read(path)
    assert problems == []
    assert len(rows) == 872
    assert rows[0].fields == {"sentence": "it 's a charming and often affecting journey . ", "label": "1"}
    assert rows[0].where == f"{path} line 2"


# --- encodings and line endings -------------------------------------------------------------------------------------


def test_bom_and_crlf_are_accepted(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"input": "a"}\r\n{"input": "b"}\r\n')
    rows, problems = _read(jsonl)
    assert problems == []
    assert [r.fields["input"] for r in rows] == ["a", "b"]

    csv_path = tmp_path / "d.csv"
    csv_path.write_bytes(b'\xef\xbb\xbfinput,target\r\n"x\r\ny",b\r\nc,d\r\n')
    rows, problems = _read(csv_path)
    assert problems == []
    assert list(rows[0].fields) == ["input", "target"]  # the BOM is not glued to the first column name
    assert rows[0].fields["input"] == "x\r\ny"
    assert [r.where for r in rows] == [f"{csv_path} line 2", f"{csv_path} line 4"]


def test_non_utf8_byte_reported_with_line_offset_and_count(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"input": "ok"}\n{"input": "caf\xe9"}\n{"input": "na\xefve"}\n')
    rows, problems = _read(path)
    # Reading goes on (bad bytes replaced) so that the same report can list the file's other problems; the encoding
    # problem itself stops the run.
    assert len(rows) == 3 and "\ufffd" in rows[1].fields["input"]
    assert len(problems) == 1
    p = problems[0]
    assert p.where == f"{path} line 2"
    assert "byte 0xE9 at byte offset 30 (line 2, byte 15 of the line)" in p.what
    assert "'é'" in p.what
    assert "2 lines in the file have invalid bytes" in p.what
    assert p.fix == (
        "re-save the file as UTF-8 (for example: iconv -f latin1 -t utf-8 IN > OUT); "
        "or pass --on_bad_rows skip to drop such rows (they are written to rejected_rows.jsonl)"
    )


# --- JSONL errors ---------------------------------------------------------------------------------------------------


def test_bad_jsonl_lines_reported_each_with_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input": "a"}\n{"input": "b"\n[1, 2]\n{\'input\': \'c\'}\n{"input": "d"}\n')
    rows, problems = _read(path)
    assert [r.fields["input"] for r in rows] == ["a", "d"]
    assert [p.where for p in problems] == [f"{path} line 2", f"{path} line 3", f"{path} line 4"]
    assert problems[0].what.startswith("not valid JSON: Expecting ',' delimiter (column 14)")
    assert "line ends early" in problems[0].what
    assert problems[1].what == "line holds a JSON array, not an object"
    assert "Python dict" in problems[2].what


def test_bad_jsonl_lines_are_capped_with_a_summary(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input": "a"}\n' + "not json\n" * 25)
    rows, problems = _read(path)
    assert len(rows) == 1
    assert len(problems) == 21
    assert problems[19].where == f"{path} line 21"
    assert problems[20].what == "... and 5 more lines with the same problem"
    assert problems[20].where == str(path)


# --- path errors ----------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    (tmp_path / "train.json").write_text("[]")
    rows, problems = _read(tmp_path / "train.jsonl")
    assert rows == []
    assert problems[0].what == f"file not found: {tmp_path / 'train.jsonl'}"
    assert "relative paths are resolved from" in problems[0].fix
    assert f"did you mean {tmp_path / 'train.json'}?" in problems[0].fix


def test_unknown_extension(tmp_path):
    path = tmp_path / "d.xlsx"
    path.write_text("x")
    rows, problems = _read(path)
    assert rows == []
    assert problems[0].what == f"unsupported file type '.xlsx' for {path}; surefit reads {SUPPORTED_FORMATS}"
    assert "convert it" in problems[0].fix and "rename" in problems[0].fix


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json", "empty.csv", "empty.tsv"])
def test_empty_file_has_no_rows(tmp_path, name):
    path = tmp_path / name
    path.write_text("" if name != "empty.json" else "[]")
    rows, problems = _read(path)
    assert rows == []
    assert [p.what for p in problems] == [f"no rows in {path}"]
    assert "check the file" in problems[0].fix


def test_folder_without_data_lists_files_inside(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.jsonl").write_text("{}\n")
    rows, problems = _read(tmp_path)
    assert rows == []
    assert "is a folder" in problems[0].what
    assert str(tmp_path / "sub" / "train.jsonl") in problems[0].fix
    assert "notes.txt" not in problems[0].fix

    empty = tmp_path / "empty"
    empty.mkdir()
    rows, problems = _read(empty)
    assert "no data files were found inside" in problems[0].fix


# --- check_text_fields ----------------------------------------------------------------------------------------------


def _rows(*field_dicts: dict) -> list[Row]:
    return [Row(fields=f, where=f"d.jsonl line {i + 1}", index=i) for i, f in enumerate(field_dicts)]


def test_field_missing_everywhere_suggests_close_match():
    rows = _rows({"input": "q", "answer": "a"}, {"input": "q2", "answer": "b", "extra": 1})
    problems: list[Problem] = []
    kept, notes = check_text_fields(
        rows, [("input", "--input_field"), ("answers", "--target_field")], problems, "d.jsonl"
    )
    assert kept == [] and notes == []
    assert len(problems) == 1
    assert problems[0].what == "field 'answers' not found in d.jsonl (its fields: 'answer', 'extra', 'input')"
    assert problems[0].where == "--target_field"
    assert problems[0].fix == "did you mean 'answer'? pass --target_field NAME with one of: 'answer', 'extra', 'input'"


def test_field_missing_in_some_rows():
    rows = _rows({"input": "a", "target": "x"}, {"input": "b"}, {"input": "c", "target": "z"}, {"input": "d"})
    problems: list[Problem] = []
    kept, _ = check_text_fields(rows, FIELDS, problems, "d.jsonl")
    assert [r.fields["input"] for r in kept] == ["a", "c"]
    assert len(problems) == 1
    assert problems[0].what == "2 of 4 rows have no 'target' field: line 2, line 4"
    assert problems[0].where == "d.jsonl"


def test_null_and_empty_target_list_rows():
    rows = _rows(
        *([{"input": "a", "target": None}] + [{"input": "b", "target": "  "}] * 11 + [{"input": "c", "target": "ok"}])
    )
    problems: list[Problem] = []
    kept, _ = check_text_fields(rows, FIELDS, problems, "d.jsonl")
    assert [r.fields["target"] for r in kept] == ["ok"]
    assert len(problems) == 1
    what = problems[0].what
    assert what.startswith(
        "12 rows have a null or empty 'target' (1 null, 11 empty or whitespace-only): line 1, line 2,"
    )
    assert what.endswith("line 10 and 2 more")
    assert problems[0].fix.startswith("fill in or remove these rows; or pass --on_bad_rows skip")


def test_nan_target_is_null_not_the_text_nan():
    problems: list[Problem] = []
    kept, notes = check_text_fields(_rows({"input": "a", "target": float("nan")}), FIELDS, problems, "d.jsonl")
    assert kept == [] and notes == []
    assert "1 null" in problems[0].what


def test_numeric_values_converted_with_a_note():
    rows = _rows({"input": "year?", "target": 1912}, {"input": "pi?", "target": 3.5}, {"input": "x", "target": "y"})
    problems: list[Problem] = []
    kept, notes = check_text_fields(rows, FIELDS, problems, "d.jsonl")
    assert problems == []
    assert [r.fields["target"] for r in kept] == ["1912", "3.5", "y"]
    assert [r.where for r in kept] == [r.where for r in rows]
    assert rows[0].fields["target"] == 1912  # the input rows are not mutated
    assert notes == ["2 rows had a numeric 'target'; converted to text (e.g. d.jsonl line 1: 1912 -> '1912')"]


def test_list_dict_and_bool_values_are_problems():
    rows = _rows(
        {"input": "a", "target": ["x", "y"]},
        {"input": "b", "target": {"t": 1}},
        {"input": "c", "target": True},
        {"input": "d", "target": "fine"},
    )
    problems: list[Problem] = []
    kept, _ = check_text_fields(rows, FIELDS, problems, "d.jsonl")
    assert [r.fields["input"] for r in kept] == ["d"]
    assert [p.what for p in problems] == [
        "1 row has a list as 'target', not text: line 1",
        "1 row has a dict as 'target', not text: line 2",
        "1 row has a boolean as 'target', not text: line 3",
    ]
    assert "--target_field" in problems[0].fix


def test_check_text_fields_on_no_rows_is_quiet():
    problems: list[Problem] = []
    assert check_text_fields([], FIELDS, problems, "d.jsonl") == ([], [])
    assert problems == []
