"""SQuAD and classification metrics against hand-computed values."""

from __future__ import annotations

import pytest

from surefit.eval.classification import accuracy, confusion_matrix, macro_f1, per_class_f1
from surefit.eval.metrics import exact_match, normalize_answer, squad_scores, token_f1


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The  Cat!", "cat"),
        ("a", ""),
        ("An apple, the pear", "apple pear"),
        ("  Hello\tWORLD \n", "hello world"),
        ("theatre", "theatre"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("don't", "dont"),
    ],
)
def test_normalize_answer_matches_squad(raw, expected):
    assert normalize_answer(raw) == expected


def test_exact_match_after_normalisation():
    assert exact_match("The  Cat!", "cat") == 1.0
    assert exact_match("cats", "cat") == 0.0
    assert exact_match("a", "the") == 1.0  # both normalise to empty


def test_token_f1_partial_overlap_hand_computed():
    # pred tokens: big red dog (3); gold: red dog barked (3); overlap 2 -> P = R = 2/3 -> F1 = 2/3
    assert token_f1("the big red dog", "red dog barked") == pytest.approx(2 / 3)
    # pred: red (1); gold: red dog barked (3): P = 1, R = 1/3 -> F1 = 2 * (1/3) / (4/3) = 1/2
    assert token_f1("red", "red dog barked") == pytest.approx(0.5)


def test_token_f1_counts_duplicate_tokens_once_per_gold_occurrence():
    # pred: dog dog dog (3); gold: dog cat (2); Counter overlap = 1 -> P = 1/3, R = 1/2 -> F1 = 2/5
    assert token_f1("dog dog dog", "dog cat") == pytest.approx(0.4)
    # gold has two dogs: overlap 2 -> P = 2/3, R = 1 -> F1 = 0.8
    assert token_f1("dog dog dog", "dog dog") == pytest.approx(0.8)


def test_token_f1_empty_conventions():
    assert token_f1("", "") == 1.0
    assert token_f1("the", "a") == 1.0
    assert token_f1("", "cat") == 0.0
    assert token_f1("cat", "the") == 0.0
    assert token_f1("cat", "dog") == 0.0


def test_squad_scores_takes_max_over_golds_and_averages():
    predictions = ["red dog", "Paris", "nothing"]
    golds = [["the big red dog", "red dog"], ["paris, france", "Paris."], ["something else"]]
    scores = squad_scores(predictions, golds)
    # ex 0: max(F1 2*(1)*(2/3)/(5/3)=0.8, 1.0) = 1, EM 1; ex 1: F1 1, EM 1; ex 2: 0, 0
    assert scores["em"] == pytest.approx(2 / 3)
    assert scores["f1"] == pytest.approx(2 / 3)
    assert set(scores) == {"f1", "em"}


def test_squad_scores_partial_mean():
    scores = squad_scores(["the big red dog", "x"], [["red dog barked"], ["x"]])
    assert scores["f1"] == pytest.approx((2 / 3 + 1) / 2)
    assert scores["em"] == pytest.approx(0.5)


def test_squad_scores_rejects_bad_input():
    with pytest.raises(ValueError, match="no examples"):
        squad_scores([], [])
    with pytest.raises(ValueError, match="example 1 has no gold"):
        squad_scores(["a", "b"], [["a"], []])
    with pytest.raises(ValueError, match="2 predictions but 1"):
        squad_scores(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="string"):
        squad_scores(["a"], ["a"])


# 3-class example, written out by hand:
#   label: 0 0 0 1 1 2 2 2
#   pred:  0 0 1 1 2 2 2 0
LABELS = [0, 0, 0, 1, 1, 2, 2, 2]
PREDS = [0, 0, 1, 1, 2, 2, 2, 0]


def test_accuracy_hand_example():
    assert accuracy(PREDS, LABELS) == pytest.approx(5 / 8)


def test_confusion_matrix_rows_are_true_labels():
    assert confusion_matrix(PREDS, LABELS, 3) == [
        [2, 1, 0],
        [0, 1, 1],
        [1, 0, 2],
    ]


def test_per_class_and_macro_f1_hand_example():
    # class 0: TP 2, FP 1, FN 1 -> 4/6; class 1: TP 1, FP 1, FN 1 -> 2/4; class 2: TP 2, FP 1, FN 1 -> 4/6
    assert per_class_f1(PREDS, LABELS, 3) == pytest.approx([2 / 3, 1 / 2, 2 / 3])
    assert macro_f1(PREDS, LABELS, 3) == pytest.approx((2 / 3 + 1 / 2 + 2 / 3) / 3)


def test_absent_class_scores_zero_and_counts_in_macro():
    # class 2 never appears as label or prediction
    assert per_class_f1([0, 1], [0, 1], 3) == [1.0, 1.0, 0.0]
    assert macro_f1([0, 1], [0, 1], 3) == pytest.approx(2 / 3)


def test_classification_metrics_reject_bad_input():
    with pytest.raises(ValueError):
        accuracy([], [])
    with pytest.raises(ValueError):
        accuracy([0], [0, 1])
    with pytest.raises(ValueError, match="outside"):
        confusion_matrix([3], [0], 3)
    with pytest.raises(ValueError, match="outside"):
        macro_f1([0], [-1], 3)
