"""An encoded row holds its token ids as pointers to int objects shared by all rows (issue 35: RSS per row)."""

from __future__ import annotations

from surefit.data.encode import Example
from surefit.data.rows import Row


def test_examples_share_their_token_int_objects_and_keep_their_values():
    row = Row(fields={"input": "x", "target": "y"}, where="t.jsonl line 1", index=0)
    # int("...") makes a fresh object per value, as a tokenizer's output does for every id above 256.
    a = Example(input_ids=[int("1000"), int("40000"), 5], labels=[-100, int("40000"), 5], prompt_len=1, row=row)
    b = Example(input_ids=[int("40000"), int("1000")], labels=[-100, int("1000")], prompt_len=1, row=row)
    assert a.input_ids == [1000, 40000, 5] and a.labels == [-100, 40000, 5]
    assert b.input_ids == [40000, 1000] and b.labels == [-100, 1000]
    assert a.input_ids[0] is b.input_ids[1] is b.labels[1]
    assert a.input_ids[1] is a.labels[1] is b.input_ids[0]
    assert a.features() == {"input_ids": [1000, 40000, 5], "labels": [-100, 40000, 5]}
    huge = int("1" * 30)  # any value keeps its value (no table sized by the largest id)
    assert Example(input_ids=[huge], labels=[-100], prompt_len=0, row=row).input_ids == [huge]
