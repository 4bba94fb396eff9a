"""Train/validation split that cannot leak: done before augmentation, with duplicate inputs kept together.

Two classic ways validation scores get inflated are (1) splitting after augmentation, so a variant of a validation
row is trained on, and (2) the same input appearing twice in the data and landing on both sides. Splitting whole
groups of rows that share a key fixes (2); :func:`leaked` is the guard the pipeline runs after augmentation to
prove (1) did not happen.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable

import numpy as np

from surefit.data.rows import Row
from surefit.errors import ConfigError, DataError, Problem

_VARIANT_SUFFIX = re.compile(r"( \(variant \d+\))+$")


def key_hash(text: str) -> bytes:
    """16 bytes standing for a key in the split's and the leakage check's tables: what they hold per row does not
    grow with the length of the rows' text (a collision, 2**-64 at a billion rows, would only keep two rows together).
    """
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def normalize_key(text: str) -> str:
    """Key under which two inputs count as the same: lowercased, whitespace runs collapsed to one space, stripped."""
    return " ".join(text.lower().split())


def split_rows(
    rows: list[Row], val_fraction: float, seed: int, key: Callable[[Row], str]
) -> tuple[list[Row], list[Row], list[str]]:
    """Split rows into train and validation, keeping rows with equal keys on the same side.

    Call this BEFORE augmentation. Rows are grouped by ``key``; the groups are shuffled with
    ``random.Random(seed)`` and taken into validation until it holds ``round(len(rows) * val_fraction)`` rows (at
    least 1), so validation can overshoot by less than one group. At least one group always stays in train. Both
    sides keep the rows' original order, which keeps prediction files readable next to the source.

    Args:
        rows: the rows to split (originals, not augmented variants).
        val_fraction: share of rows for validation, in ``[0, 1)``; 0 means no split.
        seed: split seed; the same rows and seed always give the same split.
        key: maps a row to the string that identifies duplicates, normally ``normalize_key`` of the input text.

    Returns:
        ``(train, val, notes)``; ``notes`` are one-line human messages about what was done.

    Raises:
        ConfigError: ``val_fraction`` outside ``[0, 1)``.
        DataError: ``val_fraction > 0`` but fewer than 2 distinct keys, so no split can keep duplicates together.
    """
    if not 0 <= val_fraction < 1:
        raise ConfigError(
            Problem(
                f"val_fraction must be at least 0 and below 1, got {val_fraction}",
                where="val_fraction",
                fix="use a fraction such as 0.1 (10% of rows for validation), or 0 with --val_data FILE",
            )
        )
    if val_fraction == 0:
        return list(rows), [], [f"no validation split: all {len(rows)} rows train (val_fraction 0)"]

    hashes = np.frombuffer(b"".join(key_hash(key(row)) for row in rows), dtype=KEY_DTYPE)
    in_val, notes = split_hashes(hashes, val_fraction, seed)
    train = [row for row, v in zip(rows, in_val.tolist(), strict=True) if not v]
    val = [row for row, v in zip(rows, in_val.tolist(), strict=True) if v]
    return train, val, notes


# One row's key hash (:func:`key_hash`) as a numpy value: 16 bytes a row, however many rows there are.
KEY_DTYPE = np.dtype([("hi", ">u8"), ("lo", ">u8")])


def split_hashes(hashes: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, list[str]]:
    """The split of :func:`split_rows` from the rows' key hashes alone (``KEY_DTYPE``, in row order): which rows go to
    validation (a boolean array) and the notes. Holds about 40 bytes a row, never the rows: a file read in chunks
    is split from the hashes of a first pass.

    Rows with equal hashes form a group; the groups, in order of first appearance, are shuffled with
    ``random.Random(seed)`` and taken into validation until it holds ``round(n * val_fraction)`` rows (at least 1);
    the last group stays in train.

    Raises:
        DataError: fewer than 2 distinct keys.
    """
    n = len(hashes)
    uniq, first, inverse, sizes = np.unique(hashes, return_index=True, return_inverse=True, return_counts=True)
    del uniq
    if len(first) < 2:
        raise DataError(
            Problem(
                f"cannot make a validation split from {n} row(s) with {len(first)} distinct input(s); "
                "at least 2 distinct inputs are needed because rows with the same input stay on the same side",
                where="val_fraction",
                fix="add rows with different inputs, or pass --val_data FILE with separate validation rows",
            )
        )
    # Groups numbered in order of first appearance, so the shuffle below is the only source of randomness.
    appearance = np.argsort(first, kind="stable")
    rank = np.empty_like(appearance)
    rank[appearance] = np.arange(len(appearance))
    group = rank[inverse.reshape(-1)]
    sizes = sizes[appearance]
    order = np.arange(len(sizes))
    random.Random(seed).shuffle(order)  # type: ignore[arg-type]  # the same draws as shuffling a list of the groups
    target = max(1, round(n * val_fraction))
    # Groups are taken while validation holds fewer than ``target`` rows; never the last group.
    taken = np.cumsum(sizes[order[:-1]])
    k = int(np.searchsorted(taken, target)) + 1 if len(taken) else 0
    chosen = np.zeros(len(sizes), dtype=bool)
    chosen[order[: min(k, len(order) - 1)]] = True
    in_val = chosen[group]
    n_val = int(in_val.sum())
    notes = [f"split {n} rows -> {n - n_val} train / {n_val} validation (val_fraction {val_fraction}, seed {seed})"]
    shared = int(sizes[sizes > 1].sum())
    if shared:
        notes.append(f"{shared} rows share their input with another row; kept on the same side of the split")
        if n_val != target:
            notes.append(
                f"validation has {n_val} rows instead of {target} because duplicate inputs are kept together"
            )
    return in_val, notes


def leaked(train: list[Row], val: list[Row], key: Callable[[Row], str]) -> list[tuple[Row, Row]]:
    """Find training rows that leak validation rows; the pipeline runs this after augmentation as a guard.

    A pair ``(train_row, val_row)`` is a leak when their keys are equal, or when ``train_row`` is an augmented
    variant of ``val_row``: its ``variant_of`` equals ``val_row.index`` and its ``where`` is ``val_row.where`` plus
    the ``" (variant k)"`` suffix that augmentation adds. The ``where`` check matters because indexes are per
    source file: with ``--val_data`` a validation row and a training row can share an index without being related.

    Args:
        train: training rows, possibly augmented.
        val: validation rows.
        key: the same key function given to :func:`split_rows`.

    Returns:
        Every leaking pair, in training-row order; empty for a clean split.
    """
    by_key: dict[bytes, list[Row]] = {}
    by_origin: dict[tuple[int, str], list[Row]] = {}
    for v in val:
        by_key.setdefault(key_hash(key(v)), []).append(v)
        by_origin.setdefault((v.index, v.where), []).append(v)

    pairs: list[tuple[Row, Row]] = []
    for t in train:
        matches = list(by_key.get(key_hash(key(t)), []))
        if t.variant_of is not None:
            origin = (t.variant_of, _VARIANT_SUFFIX.sub("", t.where))
            matches += [v for v in by_origin.get(origin, []) if all(v is not m for m in matches)]
        pairs.extend((t, v) for v in matches)
    return pairs


def split_or_check(train: list[Row], val: list[Row] | None, val_fraction: float, seed: int,
                   key: Callable[[Row], str], what: str = "input") -> tuple[list[Row], list[Row], list[str]]:
    """Hold out validation rows (when no validation file was given) or check the given one for overlap.

    With a validation file the user chose both sets: their rows are not dropped, but an overlap, which inflates the
    validation score, is reported in the notes (the doctor also reports it before training).
    """
    if val is None:
        return split_rows(train, val_fraction, seed, key)
    overlap = leaked(train, val, key)
    notes = [overlap_note(len(overlap), overlap[0][0].where, overlap[0][1].where, what)] if overlap else []
    return train, val, notes


def overlap_note(pairs: int, train_where: str, val_where: str, what: str) -> str:
    """The warning of :func:`split_or_check` for ``pairs`` (training row, validation row) pairs with the same key,
    the first of them at ``train_where`` and ``val_where``."""
    return (f"warning: {pairs} validation rows have the same {what} as a training row "
            f"(e.g. {val_where} = {train_where}); validation scores will be optimistic")
