"""Leak-proof split and target-preserving augmentation."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from surefit.data.augment import TRANSFORMS, augment_rows
from surefit.data.rows import Row
from surefit.data.split import leaked, normalize_key, split_rows
from surefit.errors import ConfigError, DataError


def _rows(texts: list[str], source: str = "train.jsonl") -> list[Row]:
    return [
        Row(fields={"input": t, "target": f"target {i}", "id": str(i)}, where=f"{source} line {i + 1}", index=i)
        for i, t in enumerate(texts)
    ]


def _key(row: Row) -> str:
    return normalize_key(row.fields["input"])


def _indexes(rows: list[Row]) -> list[int]:
    return [r.index for r in rows]


# ---------------------------------------------------------------- split


def test_normalize_key_case_and_whitespace():
    assert normalize_key("  The\tCat\n\nsat ") == "the cat sat"


def test_split_is_deterministic_per_seed():
    rows = _rows([f"question {i}" for i in range(200)])
    train_a, val_a, _ = split_rows(rows, 0.1, seed=0, key=_key)
    train_b, val_b, _ = split_rows(rows, 0.1, seed=0, key=_key)
    _, val_c, _ = split_rows(rows, 0.1, seed=1, key=_key)
    assert _indexes(val_a) == _indexes(val_b)
    assert _indexes(train_a) == _indexes(train_b)
    assert _indexes(val_a) != _indexes(val_c)


def test_split_sizes_order_and_note():
    rows = _rows([f"question {i}" for i in range(200)])
    train, val, notes = split_rows(rows, 0.1, seed=0, key=_key)
    assert (len(train), len(val)) == (180, 20)
    assert sorted(_indexes(train) + _indexes(val)) == list(range(200))
    assert _indexes(val) == sorted(_indexes(val))
    assert _indexes(train) == sorted(_indexes(train))
    assert notes == ["split 200 rows -> 180 train / 20 validation (val_fraction 0.1, seed 0)"]


def test_split_takes_at_least_one_validation_row():
    train, val, _ = split_rows(_rows(["a", "b", "c"]), 0.01, seed=0, key=_key)
    assert (len(train), len(val)) == (2, 1)


def test_split_keeps_duplicates_on_one_side():
    texts = [f"distinct {i}" for i in range(7)] + ["Same input", "same   INPUT", " same input\n"]
    rows = _rows(texts)
    dup = {7, 8, 9}
    for seed in range(30):
        train, val, notes = split_rows(rows, 0.3, seed=seed, key=_key)
        in_val = dup & set(_indexes(val))
        assert in_val in (set(), dup)
        assert not leaked(train, val, _key)
        assert "3 rows share their input with another row; kept on the same side of the split" in notes


def test_split_val_fraction_zero_returns_all_rows():
    rows = _rows(["a", "b"])
    train, val, notes = split_rows(rows, 0.0, seed=0, key=_key)
    assert train == rows and val == [] and notes


def test_split_needs_two_distinct_inputs():
    with pytest.raises(DataError) as info:
        split_rows(_rows(["x", "X ", "x"]), 0.2, seed=0, key=_key)
    problem = info.value.problems[0]
    assert "2 distinct inputs" in problem.what
    assert "--val_data" in problem.fix


def test_split_rejects_bad_fraction():
    with pytest.raises(ConfigError):
        split_rows(_rows(["a", "b"]), 1.0, seed=0, key=_key)


def test_leaked_finds_planted_key_leak():
    rows = _rows([f"q {i}" for i in range(10)])
    train, val, _ = split_rows(rows, 0.2, seed=0, key=_key)
    planted = replace(train[0], fields={**train[0].fields, "input": "  " + val[0].fields["input"].upper()})
    pairs = leaked([planted, *train[1:]], val, _key)
    assert pairs == [(planted, val[0])]


def test_leaked_finds_augmented_variant_of_val_row():
    rows = _rows([f"Passage {i}.\n\nWhat is {i}?" for i in range(10)])
    train, val, _ = split_rows(rows, 0.2, seed=0, key=_key)
    # The bug this guards against: augmenting before splitting (or augmenting val rows).
    augmented, _ = augment_rows(train + val[:1], factor=2, seed=0, input_field="input")
    pairs = leaked(augmented, val, _key)
    assert pairs  # the original val[0] (same key) and its variant (variant_of)
    assert all(v is val[0] for _, v in pairs)
    assert any(t.variant_of == val[0].index for t, _ in pairs)


def test_leaked_clean_after_augmenting_train_only():
    rows = _rows([f"Passage {i}.\n\nWhat is {i}?" for i in range(20)])
    train, val, _ = split_rows(rows, 0.25, seed=3, key=_key)
    augmented, _ = augment_rows(train, factor=3, seed=0, input_field="input")
    assert leaked(augmented, val, _key) == []


def test_leaked_ignores_same_index_from_a_separate_val_file():
    train = _rows([f"train text {i}" for i in range(3)], source="train.jsonl")
    val = _rows([f"val text {i}" for i in range(3)], source="val.jsonl")
    augmented, _ = augment_rows(train, factor=2, seed=0, input_field="input")
    assert leaked(augmented, val, _key) == []


# ---------------------------------------------------------------- augment

QA_TEXTS = [f"Passage number {i}. It has two sentences.\nAnd a wrapped line.\n\nWhat is item {i}?" for i in range(10)]


def test_augment_counts_and_order():
    rows = _rows(QA_TEXTS)
    out, stats = augment_rows(rows, factor=3, seed=0, input_field="input")
    assert len(out) == 30
    assert (stats.rows_before, stats.rows_after) == (10, 30)
    for i, row in enumerate(rows):
        original, v1, v2 = out[3 * i : 3 * i + 3]
        assert original is row
        assert (v1.variant_of, v2.variant_of) == (row.index, row.index)
        assert v1.index == v2.index == row.index
        assert v1.where == f"{row.where} (variant 1)"
        assert v2.where == f"{row.where} (variant 2)"
        assert v1.transforms and set(v1.transforms) <= set(TRANSFORMS)
    assert sum(stats.per_transform.values()) == sum(len(r.transforms) for r in out)


def test_augment_changes_only_the_input():
    rows = _rows(QA_TEXTS)
    out, _ = augment_rows(rows, factor=4, seed=1, input_field="input")
    for r in out:
        src = rows[r.index]
        assert {k: v for k, v in r.fields.items() if k != "input"} == {
            k: v for k, v in src.fields.items() if k != "input"
        }
        if r.variant_of is not None:
            assert r.fields["input"] != src.fields["input"]
            # every word of the source is still there
            assert not Counter(src.fields["input"].split()) - Counter(r.fields["input"].split())


def test_reflow_keeps_every_non_whitespace_character():
    rows = _rows(QA_TEXTS + ["One. Two! Three?\nFour\n\n\nFive"])
    out, _ = augment_rows(rows, factor=8, seed=2, input_field="input")
    reflowed = [r for r in out if r.transforms == ("reflow",)]
    assert reflowed
    for r in reflowed:
        src = rows[r.index].fields["input"]
        assert "".join(r.fields["input"].split()) == "".join(src.split())


def test_question_first_only_when_applicable():
    no_question = _rows(["A passage.\n\nA statement.", "Single paragraph ends with a question?"])
    out, stats = augment_rows(no_question, factor=10, seed=0, input_field="input")
    assert stats.per_transform["question_first"] == 0
    assert all("question_first" not in r.transforms for r in out)

    rows = _rows(["Paris is in France.\n\nWhat country is Paris in?", "Some context.\n\nQuestion: name it"])
    out, stats = augment_rows(rows, factor=10, seed=0, input_field="input")
    moved = [r for r in out if r.transforms == ("question_first",)]
    assert moved and stats.per_transform["question_first"] > 0
    for r in moved:
        assert r.fields["input"] in (
            "What country is Paris in?\n\nParis is in France.",
            "Question: name it\n\nSome context.",
        )


def test_augment_is_deterministic_by_seed():
    rows = _rows(QA_TEXTS)
    a, _ = augment_rows(rows, factor=3, seed=7, input_field="input")
    b, _ = augment_rows(rows, factor=3, seed=7, input_field="input")
    c, _ = augment_rows(rows, factor=3, seed=8, input_field="input")
    assert a == b
    assert [r.fields["input"] for r in a] != [r.fields["input"] for r in c]


def test_augment_factor_one_is_identity():
    rows = _rows(QA_TEXTS)
    out, stats = augment_rows(rows, factor=1, seed=0, input_field="input")
    assert out == rows
    assert stats.rows_after == 10
    assert "10" in stats.summary()


def test_augment_rejects_bad_factor_and_missing_input():
    with pytest.raises(ValueError):
        augment_rows(_rows(["a"]), factor=0, seed=0, input_field="input")
    with pytest.raises(DataError):
        augment_rows(_rows(["a"]), factor=2, seed=0, input_field="prompt")


def test_augment_counts_identical_variants_when_choices_run_out():
    # one line, one sentence: only lead_in applies, and there are fewer lead-ins than variants requested
    out, stats = augment_rows(_rows(["hello"]), factor=20, seed=0, input_field="input")
    assert len(out) == 20
    assert stats.identical > 0
    assert f"{stats.identical} variants identical" in stats.summary()


def test_augment_summary_mentions_counts():
    _, stats = augment_rows(_rows(QA_TEXTS), factor=3, seed=0, input_field="input")
    text = stats.summary()
    assert text.startswith("augmentation x3: 10 -> 30 training rows (")
    for name in TRANSFORMS:
        assert f"{name} {stats.per_transform[name]}" in text
    assert stats.identical == 0 and "all variants distinct" in text


def test_the_split_from_key_hashes_alone_is_the_split_of_the_rows():
    """split_hashes (what a file read in chunks is split from: 16 bytes a row) gives split_rows' split and notes."""
    import numpy as np

    from surefit.data.split import KEY_DTYPE, key_hash, split_hashes

    rows = [Row({"input": f"question {i % 700}" + (" again" if i % 7 == 0 else "")}, f"d.jsonl line {i + 1}", i)
            for i in range(3000)]
    key = lambda r: normalize_key(r.fields["input"])  # noqa: E731
    train, val, notes = split_rows(rows, 0.1, 5, key)
    hashes = np.frombuffer(b"".join(key_hash(key(r)) for r in rows), dtype=KEY_DTYPE)
    in_val, notes_h = split_hashes(hashes, 0.1, 5)
    assert [r.index for r in val] == np.flatnonzero(in_val).tolist() and notes_h == notes
    assert len(val) >= 300 and "rows share their input with another row" in notes[1]
    # Rows sharing a key are on one side: no key of validation is in train.
    assert not {key(r) for r in val} & {key(r) for r in train}
    # Another seed, another split; the same seed, the same split.
    assert split_hashes(hashes, 0.1, 6)[0].tolist() != in_val.tolist()
    assert split_hashes(hashes, 0.1, 5)[0].tolist() == in_val.tolist()
