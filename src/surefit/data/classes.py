"""Labels for sequence classification: which columns hold the text and the label, and what the labels mean.

Classification data arrives as CSV/TSV (every value a string) or JSON/JSONL/Parquet (native ints, floats, strings,
lists, nulls). This module finds the text and label columns, types every label the same way whatever the format
(``"1"`` from a TSV and ``1`` from JSONL are the same class), infers single-label, multi-label or regression, and
builds ``label2id`` from the training split. Like the readers, it never raises for a user error: every problem with
the labels of every file is appended to ``problems`` at once, each naming the file, the rows and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Literal, cast

from surefit.data.readers.common import MAX_WHERES, have, n_rows, short, wheres
from surefit.data.readers.fields import field_not_found, is_nan
from surefit.data.rows import Row
from surefit.errors import Problem

# (text, pair) in priority order. GLUE/SuperGLUE and the common Hugging Face classification sets use these names.
TEXT_CANDIDATES: list[tuple[str, str | None]] = [
    ("sentence", None),
    ("text", None),
    ("sentence1", "sentence2"),
    ("question", "sentence"),
    ("question1", "question2"),
    ("premise", "hypothesis"),
    ("content", None),
    ("review", None),
    ("document", None),
]
LABEL_CANDIDATES: list[str] = ["label", "labels", "class", "category", "target", "sentiment"]

PROBLEM_TYPES = ("auto", "single", "multi", "regression")
ProblemType = Literal["single", "multi", "regression"]
LabelKind = Literal["int", "str", "float", "list"]
# A summary or message listing more classes than this is no longer readable; the rest are counted.
MAX_CLASSES_SHOWN = 20
# Example rows shown per kind when one file mixes kinds of labels.
_EXAMPLES_PER_KIND = 3
_INT_RE = re.compile(r"^[+-]?\d+$")
_KIND_WORDS = {"int": "integer", "float": "numeric", "str": "text", "list": "list"}
_PROBLEM_WORDS = {"single": "single-label", "multi": "multi-label", "regression": "regression"}
_OVERRIDE = "inferred — pass --problem_type to override"
_MISSING_FIX = "fill in the label or remove these rows"


# --- field detection ------------------------------------------------------------------------------------------------


@dataclass
class Fields:
    """The columns a classification dataset is read from.

    Attributes:
        text: the column holding the text (the first text of a pair).
        pair: the column holding the second text of a pair, or ``None`` for single texts.
        label: the column holding the label.
        notes: human lines saying what was detected and how to override it.
    """

    text: str
    pair: str | None
    label: str
    notes: list[str] = dataclasses.field(default_factory=list)


def detect_fields(
    rows: list[Row],
    source: str,
    problems: list[Problem],
    *,
    text_field: str | None = None,
    text_pair_field: str | None = None,
    label_field: str | None = None,
) -> Fields | None:
    """Find the text, text-pair and label columns, using the given ones and detecting the rest.

    Given fields are checked to exist in at least one row; a missing one is a problem naming the fields present
    and the closest match. Fields not given are detected from :data:`TEXT_CANDIDATES` and
    :data:`LABEL_CANDIDATES` (exact name first, then a unique case-insensitive match, since CSV headers are often
    capitalised). A full pair (e.g. ``sentence1`` + ``sentence2``, ``question`` + ``sentence``) wins over a single
    text column, so a pair dataset never silently loses its second text.

    Args:
        rows: rows from :func:`surefit.data.readers.read_rows`.
        source: the data source as shown in messages (usually its path).
        problems: every problem found is appended here.
        text_field: ``--text_field``, or ``None`` to detect it.
        text_pair_field: ``--text_pair_field``, or ``None`` to detect it (only detected when ``text_field`` is too).
        label_field: ``--label_field``, or ``None`` to detect it.

    Returns:
        The fields, or ``None`` if any problem was added.
    """
    if not rows:
        _no_rows(source, problems)
        return None
    before = len(problems)
    present = sorted({name for row in rows for name in row.fields})
    given = [(text_field, "--text_field"), (text_pair_field, "--text_pair_field"), (label_field, "--label_field")]
    for name, flag in given:
        if name is not None and name not in present:
            problems.append(field_not_found(name, flag, present, source))
    flags_of: dict[str, list[str]] = {}
    for name, flag in given:
        if name is not None:
            flags_of.setdefault(name, []).append(flag)
    for name, flags in flags_of.items():
        if len(flags) > 1:
            problems.append(
                Problem(
                    f"the same field '{name}' is given for {' and '.join(flags)}",
                    where=flags[-1],
                    fix="give the text, the text pair and the label as different fields",
                )
            )

    notes: list[str] = []
    detected: list[str] = []
    text, pair = text_field, text_pair_field
    if text is None:
        taken = {name for name in (text_pair_field, label_field) if name is not None}
        found = _detect_text(present, taken, text_pair_field)
        if found is None:
            problems.append(_no_text_problem(present, source))
        else:
            text, found_pair, others = found
            if pair is None and found_pair is not None:
                pair = found_pair
                detected.append(f"text fields '{text}' + '{pair}' (a text pair)")
            else:
                detected.append(f"text field '{text}'")
            if others:
                listed = ", ".join(f"'{name}'" for name in others)
                notes.append(f"other text-like fields present and not used: {listed} (pick one with --text_field NAME)")
    elif pair is None:
        # An explicit --text_field is the user's choice; its usual partner is only suggested, never added.
        partner = next((p for t, p in TEXT_CANDIDATES if t == text and p is not None and p in present), None)
        if partner is not None and partner != label_field:
            notes.append(
                f"'{partner}' looks like the second text of a pair with '{text}'; "
                f"pass --text_pair_field {partner} to use it"
            )

    label = label_field
    if label is None:
        taken = {name for name in (text, pair) if name is not None}
        label = _match_any(LABEL_CANDIDATES, present, taken)
        if label is None:
            problems.append(_no_label_problem(present, source, taken))
        else:
            detected.append(f"label field '{label}'")

    if len(problems) > before:
        return None
    assert text is not None and label is not None  # every path that leaves them unset added a problem
    if detected:
        flags = []
        if text_field is None:
            flags.append("--text_field")
            if pair is not None and text_pair_field is None:
                flags.append("--text_pair_field")
        if label_field is None:
            flags.append("--label_field")
        notes.insert(0, f"detected {' and '.join(detected)} (override with {' / '.join(flags)})")
    return Fields(text=text, pair=pair, label=label, notes=notes)


def _match(name: str, present: list[str]) -> str | None:
    if name in present:
        return name
    folded = [p for p in present if p.lower() == name.lower()]
    return folded[0] if len(folded) == 1 else None


def _match_any(names: list[str], present: list[str], taken: set[str]) -> str | None:
    available = [p for p in present if p not in taken]
    for exact in (True, False):
        for name in names:
            if exact and name in available:
                return name
            if not exact and (found := _match(name, available)) is not None:
                return found
    return None


def _detect_text(
    present: list[str], taken: set[str], given_pair: str | None
) -> tuple[str, str | None, list[str]] | None:
    """``(text, pair, other candidate text fields present)`` or ``None``; pairs first, then single texts."""
    available = [p for p in present if p not in taken]
    matches: list[tuple[str, str | None]] = []
    for text, pair in TEXT_CANDIDATES:
        t = _match(text, available)
        if t is None:
            continue
        if given_pair is not None:
            # With --text_pair_field given, a candidate whose pair is that field is the best match.
            matches.append((t, None) if pair is None or _match(pair, [given_pair]) is None else (t, given_pair))
        elif pair is not None:
            p = _match(pair, available)
            if p is not None:
                matches.append((t, p))
        else:
            matches.append((t, None))
    if not matches:
        return None
    best = max(matches, key=lambda m: m[1] is not None)  # max keeps the first of equals: candidate order
    used = {best[0], best[1]}
    others = []
    for t, p in matches:
        for name in (t, p):
            if name is not None and name not in used and name not in others:
                others.append(name)
    return best[0], best[1], others


def _listed(names: list[str]) -> str:
    return ", ".join(repr(short(name)) for name in names) if names else "(none)"


def _closest(candidates: list[str], present: list[str]) -> str | None:
    for name in candidates:
        close = difflib.get_close_matches(name.lower(), [p.lower() for p in present], n=1, cutoff=0.75)
        if close:
            return next(p for p in present if p.lower() == close[0])
    return None


def _no_text_problem(present: list[str], source: str) -> Problem:
    expected = ", ".join(f"'{t}'" + (f" + '{p}'" if p else "") for t, p in TEXT_CANDIDATES)
    fix = f"pass --text_field NAME (and --text_pair_field NAME for text pairs) with one of: {_listed(present)}"
    guess = _closest([name for pair in TEXT_CANDIDATES for name in pair if name], present)
    if guess is not None:
        fix = f"did you mean '{guess}'? " + fix
    return Problem(
        f"no text field found in {source}: none of {expected} (its fields: {_listed(present)})",
        where="--text_field",
        fix=fix,
    )


def _no_label_problem(present: list[str], source: str, taken: set[str]) -> Problem:
    expected = ", ".join(f"'{name}'" for name in LABEL_CANDIDATES)
    others = [p for p in present if p not in taken]
    fix = f"pass --label_field NAME with one of: {_listed(others)}"
    guess = _closest(LABEL_CANDIDATES, others)
    if guess is not None:
        fix = f"did you mean '{guess}'? " + fix
    return Problem(
        f"no label field found in {source}: none of {expected} (its fields: {_listed(present)})",
        where="--label_field",
        fix=fix,
    )


def _no_rows(source: str, problems: list[Problem]) -> None:
    # read_rows already reports an empty file in these exact words; the same problem is not listed twice.
    problem = Problem(f"no rows in {source}", fix="check the file: it holds no data rows")
    if problem not in problems:
        problems.append(problem)


# --- label spec -----------------------------------------------------------------------------------------------------


@dataclass
class LabelSpec:
    """What the labels are and how to turn a raw label into a model target.

    Attributes:
        problem_type: ``"single"`` (one class per row), ``"multi"`` (a set of labels per row) or ``"regression"``.
        field: the label column.
        names: id -> label name as text, in id order; empty for regression.
        kind: what the raw training labels were: ``"int"``, ``"str"``, ``"float"`` or ``"list"``.
        how: one human line saying how the problem type was decided.
        counts: training rows per label name (for multi-label: rows carrying that label); shown by :meth:`summary`.
        stats: extra training figures for :meth:`summary`: ``rows`` and ``empty`` (rows with no labels) for
            multi-label; ``rows``, ``min``, ``max`` and ``mean`` for regression.
    """

    problem_type: ProblemType
    field: str
    names: list[str]
    kind: LabelKind
    how: str
    # dataclasses.field: the ``field`` attribute above shadows the bare name in this class body.
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    stats: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def num_labels(self) -> int:
        """Output size of the classifier head: the number of classes, or 1 for regression."""
        return 1 if self.problem_type == "regression" else len(self.names)

    @property
    def label2id(self) -> dict[str, int]:
        """Label name -> id."""
        return {name: i for i, name in enumerate(self.names)}

    @property
    def id2label(self) -> dict[int, str]:
        """Id -> label name."""
        return dict(enumerate(self.names))

    def _ids(self) -> dict[str, int]:
        # encode() runs once per row: the lookup is built once and rebuilt only if `names` changes. It lives outside
        # the dataclass fields so asdict() and == see only the spec itself.
        key = tuple(self.names)
        cached = self.__dict__.get("_ids_cache")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_ids_cache"] = (key, self.label2id)
        return cached[1]

    def encode(self, value: Any) -> int | float | list[float]:
        """Turn one raw label, as a row holds it, into the model target.

        Accepts every raw form the readers produce: ``"1"`` (CSV/TSV), ``1`` and ``1.0`` (JSON) are the same class.

        Args:
            value: the row's label value.

        Returns:
            The class id (single-label), a multi-hot list of floats (multi-label) or a float (regression).

        Raises:
            ValueError: the value is not a label of this spec (validated rows never raise).
        """
        if self.problem_type == "regression":
            tag, v = _normalise(value)
            if tag not in ("int", "float"):
                raise ValueError(f"regression label {value!r} is not a number")
            return float(v)
        ids = self._ids()
        if self.problem_type == "multi":
            tag, v = _normalise(value)
            if tag == "list":
                keys = v
            else:
                key = _class_name(value)
                if key is None:
                    raise ValueError(f"multi-label value {value!r} is neither a list of labels nor one label")
                keys = [key]
            target = [0.0] * len(self.names)
            for key in keys:
                if key not in ids:
                    raise ValueError(f"label {key!r} is not one of the training labels {self._shown()}")
                target[ids[key]] = 1.0
            return target
        key = _class_name(value)
        if key is None or key not in ids:
            raise ValueError(f"label {value!r} is not one of the training labels {self._shown()}")
        return ids[key]

    def _shown(self) -> str:
        return _names_listed(self.names)

    def summary(self) -> str:
        """One human line describing the labels.

        E.g. ``labels (single-label, 2 classes): 0 -> '0' (1,905 rows), 1 -> '1' (2,095 rows)``; after
        :data:`MAX_CLASSES_SHOWN` classes the rest are counted (``... and N more``).
        """
        if self.problem_type == "regression":
            s = self.stats
            if not s:
                return f"labels (regression on '{self.field}')"
            return (
                f"labels (regression on '{self.field}'): {_rows(int(s['rows']))}, "
                f"min {_num(s['min'])}, max {_num(s['max'])}, mean {_num(s['mean'])}"
            )
        n = len(self.names)
        unit = (
            ("class" if n == 1 else "classes") if self.problem_type == "single" else ("label" if n == 1 else "labels")
        )
        head = f"labels ({_PROBLEM_WORDS[self.problem_type]}, {n} {unit}"
        parts = []
        for i, name in enumerate(self.names[:MAX_CLASSES_SHOWN]):
            count = f" ({_rows(self.counts[name])})" if name in self.counts else ""
            parts.append(f"{i} -> {name!r}{count}")
        if n > MAX_CLASSES_SHOWN:
            parts.append(f"... and {n - MAX_CLASSES_SHOWN} more")
        text = f"{head}): " + ", ".join(parts)
        empty = int(self.stats.get("empty", 0))
        if self.problem_type == "multi" and empty:
            text += f"; {_rows(empty)} {have(empty)} no labels"
        return text


def build_label_spec(
    splits: list[tuple[str, list[Row]]], label_field: str, problem_type: str, problems: list[Problem]
) -> LabelSpec | None:
    """Type the labels of every split, decide the problem type and build the label set from the training split.

    Every problem in every split is reported: missing labels, booleans and objects, kinds mixed within a file,
    kinds that differ between training and validation, a ``--problem_type`` the labels cannot have, fewer than 2
    training classes, and validation labels never seen in training.

    Args:
        splits: ``[(source_name, rows)]``; the first is the training split (the label set comes from it), the
            others are validation splits.
        label_field: the label column.
        problem_type: ``"auto"``, ``"single"``, ``"multi"`` or ``"regression"``.
        problems: every problem found is appended here.

    Returns:
        The label spec, or ``None`` if any problem was added.
    """
    if not splits:
        raise ValueError("build_label_spec needs at least the training split")
    before = len(problems)
    if problem_type not in PROBLEM_TYPES:
        guess = difflib.get_close_matches(str(problem_type), PROBLEM_TYPES, n=1, cutoff=0.5)
        problems.append(
            Problem(
                f"unknown problem type {problem_type!r}",
                where="--problem_type",
                fix=(f"did you mean '{guess[0]}'? " if guess else "") + f"use one of: {', '.join(PROBLEM_TYPES)}",
            )
        )
    scans = [_scan(source, rows, label_field, problems) for source, rows in splits]
    train = scans[0]
    if train.kind is None or problem_type not in PROBLEM_TYPES:
        return None
    resolved = _resolve(train, problem_type, problems)
    if resolved is None:
        return None
    ptype, how = resolved

    names: list[str] = []
    counts: dict[str, int] = {}
    stats: dict[str, float] = {}
    if ptype == "regression":
        values = [float(v) for _, v in train.values]
        stats = {"rows": len(values), "min": min(values), "max": max(values), "mean": sum(values) / len(values)}
        if len(set(values)) < 2 and len(values) > 1:
            problems.append(
                Problem(
                    f"every training target '{label_field}' in {train.source} is {_num(values[0])} "
                    f"({_rows(len(values))}): regression needs targets that vary",
                    where=train.source,
                    fix="check --label_field picks the target column",
                )
            )
    else:
        for _, v in train.values:
            for name in _names_of(v):
                counts[name] = counts.get(name, 0) + 1
        names = _sorted_names(counts)
        if ptype == "multi":
            stats = {"rows": len(train.values), "empty": sum(1 for _, v in train.values if not _names_of(v))}
        if ptype == "single" and len(names) < 2:
            only = f"only {names[0]!r} in {_rows(counts[names[0]])}" if names else "none"
            problems.append(
                Problem(
                    f"a classifier needs at least 2 classes; found {only} of {train.source}",
                    where=train.source,
                    fix=f"check --label_field picks the label column ('{label_field}' now), "
                    "or add rows of other classes",
                )
            )
        elif ptype == "multi" and not names:
            problems.append(
                Problem(
                    f"every label list in {train.source} is empty: a multi-label classifier needs at least 1 label",
                    where=train.source,
                    fix=f"check --label_field picks the label column ('{label_field}' now)",
                )
            )

    for val in scans[1:]:
        if val.kind is None:
            continue
        if not _compatible(train.kind, val.kind, ptype):
            problems.append(_kind_clash(train, val, ptype))
        elif ptype != "regression":
            _check_unseen(train, val, set(names), names, problems)

    if len(problems) > before:
        return None
    return LabelSpec(
        problem_type=ptype, field=label_field, names=names, kind=train.kind, how=how, counts=counts, stats=stats
    )


# --- typing one file ----------------------------------------------------------------------------------------------


@dataclass
class _Scan:
    """The labels of one file, typed: ``values`` holds (row, normalised value) for every usable row."""

    source: str
    field: str
    values: list[tuple[Row, Any]]
    kind: LabelKind | None  # None: no usable labels, or kinds mixed (already reported)

    def example(self, i: int = 0) -> str:
        """``"line 2: 'pos'"``: where the i-th usable label is and what it is."""
        row, v = self.values[i]
        return f"{_loc(row, self.source)}: {_shown_value(row, v, self.field)}"


def _normalise(value: Any) -> tuple[str, Any]:
    """``(tag, value)`` for one raw label; tag is missing, bool, int, float, str, list, badlist or bad."""
    if value is None or is_nan(value):
        return "missing", None
    if isinstance(value, bool):
        return "bool", value
    if isinstance(value, numbers.Integral):
        return "int", int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return ("float", v) if math.isfinite(v) else ("bad", "an infinite number")
    if isinstance(value, str):
        s = value.strip()
        if not s:
            return "missing", None
        if _INT_RE.match(s):
            return "int", int(s)
        try:
            f = float(s)
        except ValueError:
            return "str", s
        # "nan"/"inf" parse as floats but are words here; a text class called "nan" is then visible to the user.
        return ("float", f) if math.isfinite(f) else ("str", s)
    if isinstance(value, (list, tuple)):
        names = [_element_name(item) for item in value]
        if any(name is None for name in names):
            return "badlist", list(value)
        return "list", names
    if isinstance(value, dict):
        return "bad", "an object (dict)"
    return "bad", f"a {type(value).__name__}"


def _element_name(item: Any) -> str | None:
    """The label name of one item of a multi-label list, or ``None`` if it cannot be one."""
    if isinstance(item, bool) or item is None or is_nan(item):
        return None
    if isinstance(item, numbers.Integral):
        return str(int(item))
    if isinstance(item, numbers.Real):
        return str(int(float(item))) if math.isfinite(item) and float(item).is_integer() else None
    if isinstance(item, str):
        s = item.strip()
        if not s:
            return None
        return str(int(s)) if _INT_RE.match(s) else s
    return None


def _class_name(value: Any) -> str | None:
    """The class name a scalar raw label stands for: ``"1"``, ``1`` and ``1.0`` are all ``"1"``."""
    tag, v = _normalise(value)
    if tag == "int":
        return str(v)
    if tag == "float":
        return str(int(v)) if v.is_integer() else None
    if tag == "str":
        return v
    return None


def _names_of(v: Any) -> list[str]:
    """Label names one normalised value carries (a list's duplicates count once)."""
    if isinstance(v, list):
        return list(dict.fromkeys(v))
    return [str(v)]


def _scan(source: str, rows: list[Row], field_name: str, problems: list[Problem]) -> _Scan:
    if not rows:
        _no_rows(source, problems)
        return _Scan(source, field_name, [], None)
    if all(field_name not in row.fields for row in rows):
        present = sorted({name for row in rows for name in row.fields})
        problems.append(field_not_found(field_name, "--label_field", present, source))
        return _Scan(source, field_name, [], None)

    no_field: list[Row] = []
    null: list[Row] = []
    entries: list[tuple[Row, str, Any]] = []
    bad: dict[str, list[tuple[Row, Any]]] = {}
    for row in rows:
        if field_name not in row.fields:
            no_field.append(row)
            continue
        raw = row.fields[field_name]
        tag, v = _normalise(raw)
        if tag == "missing":
            null.append(row)
        elif tag == "bool":
            bad.setdefault("a true/false value", []).append((row, raw))
        elif tag == "bad":
            bad.setdefault(v, []).append((row, raw))
        elif tag == "badlist":
            bad.setdefault("a list with items that are not label names or integer ids", []).append((row, raw))
        else:
            entries.append((row, tag, v))

    # Integer-valued floats are class ids only when the whole file is: 1.0 beside 2.5 is a regression target.
    floats = [v for _, tag, v in entries if tag == "float"]
    to = "int" if floats and all(v.is_integer() for v in floats) else "float" if floats else None
    if to is not None:
        entries = [
            (row, to, int(v) if to == "int" else float(v)) if tag in ("int", "float") else (row, tag, v)
            for row, tag, v in entries
        ]

    n = len(rows)
    if no_field or null:
        missing = sorted(no_field + null, key=lambda r: r.index)
        parts = []
        if no_field:
            parts.append(f"{len(no_field)} without the field")
        if null:
            parts.append(f"{len(null)} null, NaN or empty")
        problems.append(
            Problem(
                f"{len(missing)} of {n} rows {have(len(missing))} no label in '{field_name}' ({', '.join(parts)}): "
                f"{wheres(missing, source)}",
                where=source,
                fix=_MISSING_FIX,
            )
        )
    for what, items in bad.items():
        problems.append(_bad_problem(what, items, field_name, source))
    multi_hot = [(row, v) for row, tag, v in entries if tag == "list" and _looks_multi_hot(v)]
    if multi_hot:
        problems.append(_multi_hot_problem(multi_hot, field_name, source))

    by_kind: dict[str, list[tuple[Row, Any]]] = {}
    for row, tag, v in entries:
        by_kind.setdefault(tag, []).append((row, v))
    if len(by_kind) > 1:
        problems.append(_mixed_problem(by_kind, field_name, source))
        return _Scan(source, field_name, [], None)
    if not by_kind:
        return _Scan(source, field_name, [], None)
    kind = next(iter(by_kind))
    # entries hold only the four label kinds: the other tags were sorted into ``bad`` and ``null`` above.
    return _Scan(source, field_name, by_kind[kind], cast(LabelKind, kind))


def _looks_multi_hot(names: list[str]) -> bool:
    # [0, 1, 0, 1] is a multi-hot vector, not the label set {0, 1}: a list of label ids never repeats an id.
    return len(names) > len(set(names)) and set(names) <= {"0", "1"}


def _loc(row: Row, source: str) -> str:
    prefix = f"{source} "
    return row.where[len(prefix) :] if row.where.startswith(prefix) else row.where


def _value(v: Any) -> str:
    if isinstance(v, float):
        return _num(v)
    if isinstance(v, str):
        return repr(short(v, 40))
    return short(repr(v), 60)


def _shown_value(row: Row, v: Any, field_name: str) -> str:
    # Lists are shown as the file holds them ([0, 2], not the normalised ['0', '2']); scalars as typed, so a TSV's
    # "1" reads as the integer it was taken for.
    return short(repr(row.fields[field_name]), 60) if isinstance(v, list) else _value(v)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else f"{v:.6g}"


def _rows(n: int) -> str:
    return f"{n:,} row{'s' if n != 1 else ''}"


def _bad_problem(what: str, items: list[tuple[Row, Any]], field_name: str, source: str) -> Problem:
    shown = ", ".join(f"{_loc(row, source)} ({short(repr(raw), 40)})" for row, raw in items[:MAX_WHERES])
    more = f" and {len(items) - MAX_WHERES} more" if len(items) > MAX_WHERES else ""
    if what == "a true/false value":
        fix = "use 0/1 or class names (e.g. 'yes'/'no') instead of true/false: which class is true is ambiguous"
    elif what.startswith("a list"):
        fix = "make each list item a label name (text) or an integer id"
    else:
        fix = "make the label a class name, an integer id, a number (regression) or a list of names (multi-label)"
    return Problem(
        f"{n_rows(len(items))} {have(len(items))} {what} as '{field_name}': {shown}{more}", where=source, fix=fix
    )


def _multi_hot_problem(items: list[tuple[Row, Any]], field_name: str, source: str) -> Problem:
    row, v = items[0]
    ids = [i for i, name in enumerate(v) if name == "1"]
    return Problem(
        f"{n_rows(len(items))} {have(len(items))} a '{field_name}' that looks like a multi-hot vector "
        f"(e.g. {_loc(row, source)}: [{', '.join(v)}]), but a multi-label label is the list of the row's labels: "
        f"{wheres([r for r, _ in items], source)}",
        where=source,
        fix=f"write the labels each row has, e.g. {ids} for that row (the positions of the 1s), or their names",
    )


def _mixed_problem(by_kind: dict[str, list[tuple[Row, Any]]], field_name: str, source: str) -> Problem:
    parts = []
    for kind, items in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        examples = ", ".join(
            f"{_loc(row, source)}: {_shown_value(row, v, field_name)}" for row, v in items[:_EXAMPLES_PER_KIND]
        )
        parts.append(f"{len(items)} {_KIND_WORDS[kind]} (e.g. {examples})")
    fix = "make every label the same kind: class names, integer ids, numbers (regression) or lists (multi-label)"
    if "list" in by_kind:
        fix += "; for multi-label write a single label as a one-item list, e.g. ['sports']"
    return Problem(f"'{field_name}' mixes kinds of labels: {'; '.join(parts)}", where=source, fix=fix)


# --- problem type and validation checks -----------------------------------------------------------------------------


def _resolve(train: _Scan, requested: str, problems: list[Problem]) -> tuple[ProblemType, str] | None:
    """``(problem_type, how)`` from the training labels' kind and ``--problem_type``, or ``None`` after a problem."""
    kind = train.kind
    assert kind is not None  # the caller stops at unusable labels
    at = f"e.g. {train.example()}"
    if requested == "auto":
        if kind == "list":
            return "multi", f"multi-label (labels are lists, {at}); {_OVERRIDE}"
        if kind == "float":
            return "regression", f"regression (non-integer numeric labels, {at}); {_OVERRIDE}"
        distinct = _sorted_names({name: 0 for _, v in train.values for name in _names_of(v)})
        shown = _names_listed(distinct, limit=5, quote=kind == "str")
        return "single", f"single-label ({_KIND_WORDS[kind]} labels {shown}); {_OVERRIDE}"

    conflict: tuple[str, str] | None = None
    if requested == "single":
        if kind == "list":
            conflict = ("lists", "use --problem_type multi (or auto) for list labels, or give each row one class")
        elif kind == "float":
            conflict = (
                "non-integer numbers",
                "use --problem_type regression (or auto) for numeric targets, or use integer ids or class names",
            )
    elif requested == "regression":
        if kind == "str":
            conflict = ("text", "use --problem_type single (or auto) for class names, or make the labels numbers")
        elif kind == "list":
            conflict = ("lists", "use --problem_type multi (or auto) for list labels")
    elif requested == "multi" and kind == "float":
        conflict = ("non-integer numbers", "use --problem_type regression (or auto) for numeric targets")
    if conflict is not None:
        problems.append(
            Problem(
                f"--problem_type {requested}, but the labels in {train.source} are {conflict[0]} ({at})",
                where="--problem_type",
                fix=conflict[1],
            )
        )
        return None
    how = f"{_PROBLEM_WORDS[requested]} (--problem_type {requested}"
    if requested == "multi" and kind != "list":
        how += "; each row has exactly one label"
    elif requested == "regression" and kind == "int":
        how += "; integer labels used as numbers"
    return cast(ProblemType, requested), how + ")"  # requested is one of PROBLEM_TYPES (checked by the caller)


def _compatible(train_kind: str, val_kind: str, ptype: str) -> bool:
    # A regression dev set whose targets happen to be whole numbers is still numbers.
    return train_kind == val_kind or (ptype == "regression" and {train_kind, val_kind} <= {"int", "float"})


def _kind_clash(train: _Scan, val: _Scan, ptype: str) -> Problem:
    fix = f"use the same kind of label in both files (map {val.source}'s labels to {train.source}'s, or the reverse)"
    if ptype == "single" and val.kind == "float":
        fix += "; for numeric targets pass --problem_type regression"
    return Problem(
        f"{train.source} has {_KIND_WORDS[train.kind or '']} labels (e.g. {train.example()}) but {val.source} has "
        f"{_KIND_WORDS[val.kind or '']} labels (e.g. {val.example()})",
        where=val.source,
        fix=fix,
    )


def _check_unseen(train: _Scan, val: _Scan, known: set[str], names: list[str], problems: list[Problem]) -> None:
    unseen: dict[str, int] = {}
    rows: list[Row] = []
    for row, v in val.values:
        new = [name for name in _names_of(v) if name not in known]
        if new:
            rows.append(row)
            for name in new:
                unseen[name] = unseen.get(name, 0) + 1
    if not unseen:
        return
    values = list(unseen)
    shown = ", ".join(repr(short(name, 40)) for name in values[:MAX_WHERES])
    if len(values) > MAX_WHERES:
        shown += f" and {len(values) - MAX_WHERES} more"
    folded = {name.lower(): name for name in names}
    hints = [f"{name!r} vs {folded[name.lower()]!r}" for name in values if name.lower() in folded][:3]
    hint = f" (differ only in case: {', '.join(hints)})" if hints else ""
    labels = "1 label" if len(values) == 1 else f"{len(values)} labels"
    appear = "appears" if len(values) == 1 else "appear"
    problems.append(
        Problem(
            f"{labels} in {val.source} never {appear} in training "
            f"({train.source}): {shown}{hint}; in {n_rows(len(rows))}: {wheres(rows, val.source)}; "
            f"training labels: {_names_listed(names)}",
            where=val.source,
            fix="add training rows with these labels or remove them from validation",
        )
    )


def _sorted_names(names: dict[str, Any] | list[str]) -> list[str]:
    """Integer names numerically, any other set alphabetically (case-sensitive)."""
    unique = list(dict.fromkeys(names))
    if all(_INT_RE.match(name) for name in unique):
        return sorted(unique, key=int)
    return sorted(unique)


def _names_listed(names: list[str], limit: int = MAX_CLASSES_SHOWN, quote: bool = True) -> str:
    shown = ", ".join((repr(short(name, 40)) if quote else name) for name in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
