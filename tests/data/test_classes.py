"""Tests for surefit.data.classes: field detection, label typing, problem types, label2id and every label problem."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from surefit.data.classes import LABEL_CANDIDATES, TEXT_CANDIDATES, Fields, LabelSpec, build_label_spec, detect_fields
from surefit.data.readers import read_rows
from surefit.data.rows import Row
from surefit.errors import DataError, Problem

_NO_FIELD = object()  # marks a row that lacks the label field entirely


def _rows(source: str, labels: list, field: str = "label", **columns: list) -> list[Row]:
    """Rows like a reader makes them: ``where`` is "SOURCE line N" (line 1 is a header), ``index`` 0-based."""
    rows = []
    for i, label in enumerate(labels):
        fields = {"sentence": f"text {i}"} if not columns else {name: values[i] for name, values in columns.items()}
        if label is not _NO_FIELD:
            fields[field] = label
        rows.append(Row(fields, f"{source} line {i + 2}", i))
    return rows


def _spec(
    labels: list, problem_type: str = "auto", val: list | None = None, val_source: str = "dev.jsonl"
) -> tuple[LabelSpec | None, list[Problem]]:
    problems: list[Problem] = []
    splits = [("train.tsv", _rows("train.tsv", labels))]
    if val is not None:
        splits.append((val_source, _rows(val_source, val)))
    return build_label_spec(splits, "label", problem_type, problems), problems


def _detect(columns: dict[str, list], **flags: str) -> tuple[Fields | None, list[Problem]]:
    problems: list[Problem] = []
    n = len(next(iter(columns.values())))
    rows = [Row({name: values[i] for name, values in columns.items()}, f"train.tsv line {i + 2}", i) for i in range(n)]
    return detect_fields(rows, "train.tsv", problems, **flags), problems


# --- field detection ------------------------------------------------------------------------------------------------


def test_candidate_lists_are_in_the_documented_priority_order():
    assert TEXT_CANDIDATES[:3] == [("sentence", None), ("text", None), ("sentence1", "sentence2")]
    assert ("premise", "hypothesis") in TEXT_CANDIDATES and TEXT_CANDIDATES[-1] == ("document", None)
    assert LABEL_CANDIDATES == ["label", "labels", "class", "category", "target", "sentiment"]


def test_detects_glue_sentence_and_label_and_ignores_idx():
    fields, problems = _detect({"sentence": ["a", "b"], "label": ["0", "1"], "idx": ["0", "1"]})
    assert problems == []
    assert (fields.text, fields.pair, fields.label) == ("sentence", None, "label")
    assert fields.notes == [
        "detected text field 'sentence' and label field 'label' (override with --text_field / --label_field)"
    ]


def test_detects_text_and_label():
    fields, problems = _detect({"text": ["great film"], "label": [1]})
    assert problems == [] and (fields.text, fields.pair, fields.label) == ("text", None, "label")


def test_detects_a_sentence_pair():
    fields, problems = _detect({"sentence1": ["a"], "sentence2": ["b"], "label": [1], "idx": [0]})
    assert problems == []
    assert (fields.text, fields.pair, fields.label) == ("sentence1", "sentence2", "label")
    assert fields.notes[0] == (
        "detected text fields 'sentence1' + 'sentence2' (a text pair) and label field 'label' "
        "(override with --text_field / --text_pair_field / --label_field)"
    )


def test_a_full_pair_beats_a_single_text_field():
    # QNLI has question + sentence: taking 'sentence' alone (first in priority) would drop the question.
    fields, problems = _detect({"question": ["q"], "sentence": ["s"], "label": ["entailment"]})
    assert problems == [] and (fields.text, fields.pair) == ("question", "sentence")


def test_detection_matches_capitalised_csv_headers():
    fields, problems = _detect({"Text": ["a"], "Label": ["pos"]})
    assert problems == [] and (fields.text, fields.label) == ("Text", "Label")


def test_explicit_fields_are_used_without_detection_notes():
    fields, problems = _detect({"body": ["a"], "stars": [5], "sentence": ["x"]}, text_field="body", label_field="stars")
    assert problems == []
    assert (fields.text, fields.pair, fields.label, fields.notes) == ("body", None, "stars", [])


def test_explicit_text_field_suggests_its_pair_partner_without_adding_it():
    fields, problems = _detect({"sentence1": ["a"], "sentence2": ["b"], "label": [0]}, text_field="sentence1")
    assert problems == [] and fields.pair is None
    assert fields.notes == [
        "detected label field 'label' (override with --label_field)",
        "'sentence2' looks like the second text of a pair with 'sentence1'; pass --text_pair_field sentence2 to use it",
    ]


def test_missing_explicit_label_field_says_did_you_mean():
    fields, problems = _detect({"sentence": ["a"], "label": [0]}, label_field="lable")
    assert fields is None
    assert problems == [
        Problem(
            "field 'lable' not found in train.tsv (its fields: 'label', 'sentence')",
            where="--label_field",
            fix="did you mean 'label'? pass --label_field NAME with one of: 'label', 'sentence'",
        )
    ]


def test_no_candidate_fields_lists_the_fields_present():
    fields, problems = _detect({"body": ["a"], "stars": [5]})
    assert fields is None
    assert [p.where for p in problems] == ["--text_field", "--label_field"]
    text, label = problems
    assert text.what.startswith(
        "no text field found in train.tsv: none of 'sentence', 'text', 'sentence1' + 'sentence2'"
    )
    assert text.what.endswith("(its fields: 'body', 'stars')")
    assert text.fix == "pass --text_field NAME (and --text_pair_field NAME for text pairs) with one of: 'body', 'stars'"
    assert label.what == (
        "no label field found in train.tsv: none of 'label', 'labels', 'class', 'category', 'target', 'sentiment' "
        "(its fields: 'body', 'stars')"
    )
    assert label.fix == "pass --label_field NAME with one of: 'body', 'stars'"


def test_no_label_candidate_but_a_near_miss_is_suggested():
    _, problems = _detect({"text": ["a"], "lable": [1]})
    assert problems[0].fix == "did you mean 'lable'? pass --label_field NAME with one of: 'lable'"


def test_same_field_for_text_and_label_is_a_problem():
    fields, problems = _detect({"text": ["a"], "label": [1]}, text_field="text", label_field="text")
    assert fields is None
    assert problems[0].what == "the same field 'text' is given for --text_field and --label_field"


def test_no_rows_is_reported_once_even_after_the_reader_said_so():
    problems = [Problem("no rows in train.tsv", fix="check the file: it holds no data rows")]
    assert detect_fields([], "train.tsv", problems) is None
    assert build_label_spec([("train.tsv", [])], "label", "auto", problems) is None
    assert len(problems) == 1


# --- typing and problem type ----------------------------------------------------------------------------------------


def test_tsv_string_integers_are_single_label_int_classes():
    spec, problems = _spec(["0", "1", " 1 ", "0", "+1"])
    assert problems == []
    assert (spec.problem_type, spec.kind, spec.names, spec.num_labels) == ("single", "int", ["0", "1"], 2)
    assert spec.how == "single-label (integer labels 0, 1); inferred — pass --problem_type to override"
    assert spec.counts == {"0": 2, "1": 3}


def test_json_ints_sort_numerically_and_encode_every_raw_form_alike():
    spec, problems = _spec([10, 2, 1, 2])
    assert problems == [] and spec.names == ["1", "2", "10"]  # numeric, not "1", "10", "2"
    assert spec.encode("2") == spec.encode(2) == spec.encode(2.0) == spec.encode(" 2 ") == 1
    assert spec.encode("1") == spec.encode(1) == 0


def test_text_labels_sort_alphabetically_case_sensitive():
    spec, problems = _spec(["positive", "negative", "Neutral", "positive"])
    assert problems == []
    assert (spec.kind, spec.names) == ("str", ["Neutral", "negative", "positive"])
    assert spec.how == (
        "single-label (text labels 'Neutral', 'negative', 'positive'); inferred — pass --problem_type to override"
    )
    assert spec.encode("negative") == 1
    with pytest.raises(ValueError, match="not one of the training labels"):
        spec.encode("unknown")


def test_float_labels_are_regression_when_auto():
    spec, problems = _spec(["3.8", "0.5", "5.000", "2"])  # STS-B: whole numbers beside fractions are still scores
    assert problems == []
    assert (spec.problem_type, spec.kind, spec.names, spec.num_labels) == ("regression", "float", [], 1)
    assert (
        spec.how
        == "regression (non-integer numeric labels, e.g. line 2: 3.8); inferred — pass --problem_type to override"
    )
    assert spec.encode("3.8") == 3.8 and spec.encode(2) == 2.0
    assert spec.summary() == "labels (regression on 'label'): 4 rows, min 0.5, max 5, mean 2.825"


def test_integer_valued_floats_are_integer_classes():
    spec, problems = _spec([1.0, 0.0, 1.0, "0.0"])
    assert problems == [] and (spec.problem_type, spec.kind, spec.names) == ("single", "int", ["0", "1"])
    assert spec.encode(1.0) == spec.encode("1") == 1


def test_list_labels_are_multi_label_with_multi_hot_encoding():
    spec, problems = _spec([["sports", "politics"], ["tech"], [], ("sports",)])
    assert problems == []
    assert (spec.problem_type, spec.kind, spec.names) == ("multi", "list", ["politics", "sports", "tech"])
    assert spec.encode(["tech", "sports"]) == [0.0, 1.0, 1.0]
    assert spec.encode([]) == [0.0, 0.0, 0.0]
    assert spec.summary() == (
        "labels (multi-label, 3 labels): 0 -> 'politics' (1 row), 1 -> 'sports' (2 rows), 2 -> 'tech' (1 row); "
        "1 row has no labels"
    )


def test_list_items_normalise_like_scalar_labels():
    spec, problems = _spec([[0, 2], ["1"], [2.0, " 10 "]])
    assert problems == [] and spec.names == ["0", "1", "2", "10"]
    assert spec.encode(["2", 0]) == spec.encode([2.0, "0"]) == [1.0, 0.0, 1.0, 0.0]


def test_multi_hot_vectors_are_reported_not_read_as_label_ids():
    _, problems = _spec([[0, 1, 0, 1], [1, 0, 0, 0]])
    assert len(problems) == 1
    assert problems[0].what.startswith(
        "2 rows have a 'label' that looks like a multi-hot vector (e.g. line 2: [0, 1, 0, 1])"
    )
    assert "[1, 3]" in problems[0].fix


def test_missing_labels_are_one_problem_with_rows_and_count():
    labels = ["1", None, math.nan, "", "  ", _NO_FIELD, "0"] + [None] * 10
    spec, problems = _spec(labels)
    assert spec is None and len(problems) == 1
    assert problems[0] == Problem(
        "15 of 17 rows have no label in 'label' (1 without the field, 14 null, NaN or empty): "
        "line 3, line 4, line 5, line 6, line 7, line 9, line 10, line 11, line 12, line 13 and 5 more",
        where="train.tsv",
        fix="fill in the label or remove these rows",
    )


def test_mixed_kinds_in_one_file_are_one_problem_with_examples():
    _, problems = _spec(["0", "1", "pos", "1", "0", "neg", ["a"]])
    assert problems == [
        Problem(
            "'label' mixes kinds of labels: 4 integer (e.g. line 2: 0, line 3: 1, line 5: 1); "
            "2 text (e.g. line 4: 'pos', line 7: 'neg'); 1 list (e.g. line 8: ['a'])",
            where="train.tsv",
            fix="make every label the same kind: class names, integer ids, numbers (regression) or lists (multi-label); "
            "for multi-label write a single label as a one-item list, e.g. ['sports']",
        )
    ]


def test_ints_beside_fractional_floats_are_regression_not_mixed():
    spec, problems = _spec([1, 2.5, 3, 0.25])
    assert problems == [] and (spec.problem_type, spec.kind) == ("regression", "float")


def test_text_in_train_but_numbers_in_validation():
    spec, problems = _spec(["positive", "negative"], val=[1, 0])
    assert spec is None
    assert problems == [
        Problem(
            "train.tsv has text labels (e.g. line 2: 'positive') but dev.jsonl has integer labels (e.g. line 2: 1)",
            where="dev.jsonl",
            fix="use the same kind of label in both files (map dev.jsonl's labels to train.tsv's, or the reverse)",
        )
    ]


def test_regression_validation_with_whole_numbers_is_fine():
    spec, problems = _spec([0.5, 4.2], val=[1, 3])
    assert problems == [] and spec.problem_type == "regression"


def test_validation_labels_unseen_in_training():
    spec, problems = _spec(["pos", "neg", "pos"], val=["pos", "neutral", "Pos", "neutral"])
    assert spec is None
    assert problems == [
        Problem(
            "2 labels in dev.jsonl never appear in training (train.tsv): 'neutral', 'Pos' "
            "(differ only in case: 'Pos' vs 'pos'); in 3 rows: line 3, line 4, line 5; training labels: 'neg', 'pos'",
            where="dev.jsonl",
            fix="add training rows with these labels or remove them from validation",
        )
    ]


def test_multi_label_validation_items_unseen_in_training():
    _, problems = _spec([["a", "b"], ["b"]], val=[["a"], ["c", "b"]])
    assert problems[0].what == (
        "1 label in dev.jsonl never appears in training (train.tsv): 'c'; in 1 row: line 3; training labels: 'a', 'b'"
    )


def test_validation_without_the_label_field():
    problems: list[Problem] = []
    splits = [("train.tsv", _rows("train.tsv", [0, 1])), ("dev.tsv", _rows("dev.tsv", [0, 1], field="gold"))]
    assert build_label_spec(splits, "label", "auto", problems) is None
    assert problems[0].what == "field 'label' not found in dev.tsv (its fields: 'gold', 'sentence')"


@pytest.mark.parametrize(
    ("labels", "problem_type", "fix_start"),
    [
        ([["a"], ["b"]], "single", "use --problem_type multi (or auto)"),
        ([0.5, 1.5], "single", "use --problem_type regression (or auto)"),
        (["pos", "neg"], "regression", "use --problem_type single (or auto)"),
        ([["a"], ["b"]], "regression", "use --problem_type multi (or auto)"),
        ([0.5, 1.5], "multi", "use --problem_type regression (or auto)"),
    ],
)
def test_explicit_problem_type_conflicts(labels, problem_type, fix_start):
    spec, problems = _spec(labels, problem_type)
    assert spec is None and len(problems) == 1
    assert problems[0].where == "--problem_type"
    assert problems[0].what.startswith(f"--problem_type {problem_type}, but the labels in train.tsv are ")
    assert problems[0].fix.startswith(fix_start)


def test_explicit_regression_accepts_integer_labels_as_numbers():
    spec, problems = _spec(["1", "5", "3"], "regression")
    assert problems == []
    assert (spec.problem_type, spec.kind, spec.num_labels) == ("regression", "int", 1)
    assert spec.how == "regression (--problem_type regression; integer labels used as numbers)"
    assert spec.encode("5") == 5.0


def test_explicit_multi_accepts_one_scalar_label_per_row():
    spec, problems = _spec(["sports", "tech", "sports"], "multi")
    assert problems == []
    assert (spec.problem_type, spec.names) == ("multi", ["sports", "tech"])
    assert spec.how == "multi-label (--problem_type multi; each row has exactly one label)"
    assert spec.encode("tech") == [0.0, 1.0]


def test_fewer_than_two_classes():
    spec, problems = _spec(["1", "1", 1])
    assert spec is None
    assert problems[0].what == "a classifier needs at least 2 classes; found only '1' in 3 rows of train.tsv"


def test_booleans_and_objects_are_problems():
    _, problems = _spec([True, False, 1, 0, {"id": 1}])
    assert [p.what for p in problems] == [
        "2 rows have a true/false value as 'label': line 2 (True), line 3 (False)",
        "1 row has an object (dict) as 'label': line 6 ({'id': 1})",
    ]
    assert "use 0/1 or class names" in problems[0].fix


def test_unknown_problem_type():
    _, problems = _spec([0, 1], "multi_label")
    assert problems == [
        Problem(
            "unknown problem type 'multi_label'",
            where="--problem_type",
            fix="did you mean 'multi'? use one of: auto, single, multi, regression",
        )
    ]


# --- label2id and summary -------------------------------------------------------------------------------------------


def test_label2id_and_id2label_round_trip():
    spec, _ = _spec(["b", "c", "a"])
    assert spec.label2id == {"a": 0, "b": 1, "c": 2}
    assert spec.id2label == {0: "a", 1: "b", 2: "c"}
    assert {spec.label2id[name]: name for name in spec.names} == spec.id2label
    assert all(spec.id2label[spec.encode(name)] == name for name in spec.names)


def test_summary_counts_rows_with_thousands_separators():
    spec, _ = _spec(["0"] * 1905 + ["1"] * 2095)
    assert spec.summary() == "labels (single-label, 2 classes): 0 -> '0' (1,905 rows), 1 -> '1' (2,095 rows)"


def test_summary_truncates_after_20_classes():
    spec, _ = _spec(list(range(25)))
    text = spec.summary()
    assert text.startswith("labels (single-label, 25 classes): 0 -> '0' (1 row), 1 -> '1' (1 row)")
    assert text.endswith("19 -> '19' (1 row), ... and 5 more")
    assert (
        spec.how
        == "single-label (integer labels 0, 1, 2, 3, 4, ... (25 in all)); inferred — pass --problem_type to override"
    )


# --- everything at once, and real files -----------------------------------------------------------------------------


def test_a_bad_setup_reports_every_problem_together():
    problems: list[Problem] = []
    train = _rows("train.tsv", ["pos", "neg", None, True, "1", "pos"])
    dev = _rows("dev.jsonl", [1, 0, ""])
    test = _rows("test.jsonl", [{"x": 1}, "pos"])
    assert (
        build_label_spec([("train.tsv", train), ("dev.jsonl", dev), ("test.jsonl", test)], "label", "auto", problems)
        is None
    )
    # train: missing, boolean, mixed; dev: missing (its kind cannot clash with a mixed train); test: object.
    assert [(p.where, p.what.split(":")[0]) for p in problems] == [
        ("train.tsv", "1 of 6 rows has no label in 'label' (1 null, NaN or empty)"),
        ("train.tsv", "1 row has a true/false value as 'label'"),
        ("train.tsv", "'label' mixes kinds of labels"),
        ("dev.jsonl", "1 of 3 rows has no label in 'label' (1 null, NaN or empty)"),
        ("test.jsonl", "1 row has an object (dict) as 'label'"),
    ]
    assert "data error (5 problems)" in str(DataError(problems))


def test_clean_train_with_bad_validation_reports_all_validation_problems():
    problems: list[Problem] = []
    train = _rows("train.tsv", ["pos", "neg"])
    splits = [("train.tsv", train), ("dev.jsonl", _rows("dev.jsonl", [1, 0])), ("dev2.tsv", _rows("dev2.tsv", ["meh"]))]
    assert build_label_spec(splits, "label", "single", problems) is None
    assert [p.where for p in problems] == ["dev.jsonl", "dev2.tsv"]
    assert problems[1].what.startswith("1 label in dev2.tsv never appears in training (train.tsv): 'meh'")


def test_tsv_train_and_jsonl_dev_read_from_disk_agree(tmp_path: Path):
    (tmp_path / "train.tsv").write_text("sentence\tlabel\nfine\t1\nbad\t0\nok\t1\n", encoding="utf-8")
    (tmp_path / "dev.jsonl").write_text(
        "".join(json.dumps({"sentence": s, "label": y}) + "\n" for s, y in [("good", 1), ("awful", 0)]),
        encoding="utf-8",
    )
    problems: list[Problem] = []
    train, dev = read_rows(tmp_path / "train.tsv", problems), read_rows(tmp_path / "dev.jsonl", problems)
    fields = detect_fields(train, str(tmp_path / "train.tsv"), problems)
    spec = build_label_spec(
        [(str(tmp_path / "train.tsv"), train), (str(tmp_path / "dev.jsonl"), dev)], fields.label, "auto", problems
    )
    assert problems == []
    assert [spec.encode(r.fields["label"]) for r in train] == [1, 0, 1]
    assert [spec.encode(r.fields["label"]) for r in dev] == [1, 0]
