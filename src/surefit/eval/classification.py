"""Classification metrics: accuracy, the confusion matrix, per-class and macro F1, over class ids."""

from __future__ import annotations

from collections.abc import Sequence


def _check_labels(preds: Sequence[int], labels: Sequence[int], num_classes: int | None = None) -> None:
    if len(preds) != len(labels):
        raise ValueError(f"{len(preds)} predictions but {len(labels)} labels")
    if not labels:
        raise ValueError("no examples to score")
    if num_classes is not None:
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        for name, values in (("prediction", preds), ("label", labels)):
            for i, v in enumerate(values):
                if not 0 <= v < num_classes:
                    raise ValueError(f"{name} {v} at position {i} is outside 0..{num_classes - 1}")


def accuracy(preds: Sequence[int], labels: Sequence[int]) -> float:
    """Fraction of predictions equal to their label.

    Raises:
        ValueError: empty input or a length mismatch.
    """
    _check_labels(preds, labels)
    return sum(int(p == y) for p, y in zip(preds, labels, strict=True)) / len(labels)


def confusion_matrix(preds: Sequence[int], labels: Sequence[int], num_classes: int) -> list[list[int]]:
    """Counts of (true label, predicted label) pairs.

    Args:
        preds: predicted class ids in ``0..num_classes-1``.
        labels: true class ids in ``0..num_classes-1``.
        num_classes: number of classes.

    Returns:
        ``m`` with ``m[true][predicted]`` = count; rows are true labels, columns predictions.

    Raises:
        ValueError: empty input, a length mismatch, or an id outside ``0..num_classes-1``.
    """
    _check_labels(preds, labels, num_classes)
    matrix = [[0] * num_classes for _ in range(num_classes)]
    for p, y in zip(preds, labels, strict=True):
        matrix[y][p] += 1
    return matrix


def per_class_f1(preds: Sequence[int], labels: Sequence[int], num_classes: int) -> list[float]:
    """F1 of each class, one-vs-rest: ``2 TP / (2 TP + FP + FN)``.

    A class that is never the label and never predicted has no defined F1; it scores 0.0 (scikit-learn's
    ``zero_division=0``), so it pulls :func:`macro_f1` down rather than silently dropping out of the average.

    Returns:
        ``num_classes`` values in [0, 1].

    Raises:
        ValueError: as :func:`confusion_matrix`.
    """
    matrix = confusion_matrix(preds, labels, num_classes)
    scores = []
    for c in range(num_classes):
        tp = matrix[c][c]
        fn = sum(matrix[c]) - tp
        fp = sum(row[c] for row in matrix) - tp
        denom = 2 * tp + fp + fn
        scores.append(2 * tp / denom if denom else 0.0)
    return scores


def macro_f1(preds: Sequence[int], labels: Sequence[int], num_classes: int) -> float:
    """Unweighted mean of :func:`per_class_f1` over all ``num_classes`` classes (absent classes count as 0.0)."""
    scores = per_class_f1(preds, labels, num_classes)
    return sum(scores) / num_classes
