"""Seeded augmentation of training rows with transforms that cannot change the right answer.

Only the input field is rewritten, and only in ways that keep every word of it: a neutral lead-in is added in
front, whitespace is re-laid out, or a trailing question is moved in front of its passage. The target and every
other field are untouched, so a variant's target is as true as its source's. Run this on the training side of
the split only (see :mod:`surefit.data.split`); variants carry ``variant_of`` so leaks can be detected.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace

from surefit.data.rows import Row
from surefit.errors import DataError, Problem

TRANSFORMS: dict[str, str] = {
    "lead_in": "prepend a neutral instruction such as 'Answer using the text below.' and a blank line",
    "reflow": "change line breaks only (join lines, merge paragraphs, or one sentence per line); words untouched",
    "question_first": "move a final question paragraph ('...?' or 'Question: ...') in front of the passage",
}

# Transforms compose in this order: question_first needs the original paragraph breaks, and lead_in goes last so
# reflow never merges it into the passage.
_APPLY_ORDER = ("question_first", "reflow", "lead_in")

# Task-neutral on purpose: they must not hint at an answer or suit only one kind of task.
LEAD_INS: tuple[str, ...] = (
    "Answer using the text below.",
    "Read the following and respond.",
    "Read the input carefully, then answer.",
    "Respond to the following.",
    "Here is the input.",
    "Consider the text below.",
    "Use the information below to respond.",
    "Input:",
)

_MAX_RETRIES = 10
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_LINE_BREAK = re.compile(r"[ \t\r\f\v]*\n[ \t\r\f\v]*")
_SENTENCE_GAP = re.compile(r"(?<=[.!?])[ \t]+(?=\S)")


@dataclass
class AugmentStats:
    """What :func:`augment_rows` did, for the run log.

    Attributes:
        rows_before: training rows given.
        rows_after: rows returned (originals plus variants).
        per_transform: how many variants used each transform (a variant can use several).
        identical: variants that came out equal to their source or to an earlier variant of the same row even
            after retries; they are kept, so the row count is exactly ``rows_before * factor``.
    """

    rows_before: int
    rows_after: int
    per_transform: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TRANSFORMS, 0))
    identical: int = 0

    def add(self, other: AugmentStats) -> None:
        """Count ``other`` (the next chunk's stats) in, as one call over both chunks' rows would have."""
        self.rows_before += other.rows_before
        self.rows_after += other.rows_after
        for name, count in other.per_transform.items():
            self.per_transform[name] += count
        self.identical += other.identical

    def summary(self) -> str:
        """One line, e.g. ``augmentation x3: 180 -> 540 training rows (lead_in 240, ...); all variants distinct``."""
        if self.rows_before == self.rows_after:
            return f"augmentation off (x1): {self.rows_before} training rows"
        factor = self.rows_after // self.rows_before if self.rows_before else 0
        used = ", ".join(f"{name} {count}" for name, count in self.per_transform.items())
        tail = (
            f"{self.identical} variants identical to their source or a sibling (kept)"
            if self.identical
            else "all variants distinct"
        )
        return f"augmentation x{factor}: {self.rows_before} -> {self.rows_after} training rows ({used}); {tail}"


def _paragraphs(text: str) -> list[str]:
    return [p for p in _PARAGRAPH_BREAK.split(text.strip()) if p.strip()]


def _question_first_applies(text: str) -> bool:
    paras = _paragraphs(text)
    if len(paras) < 2:
        return False
    last = paras[-1].strip()
    return last.endswith("?") or last.startswith("Question:")


def _question_first(text: str) -> str:
    paras = _paragraphs(text)
    return "\n\n".join([paras[-1], *paras[:-1]])


def _join_lines(text: str) -> str:
    # Split keeping the paragraph breaks so only line breaks inside a paragraph are joined.
    parts = re.split(f"({_PARAGRAPH_BREAK.pattern})", text)
    return "".join(part if i % 2 else _LINE_BREAK.sub(" ", part) for i, part in enumerate(parts))


def _reflow_options(text: str) -> list[str]:
    """Every distinct whitespace re-layout of ``text`` that differs from it."""
    candidates = [
        _join_lines(text),  # soft-wrapped lines within a paragraph become one line
        _PARAGRAPH_BREAK.sub("\n", text),  # blank-line paragraph breaks become single newlines
        _SENTENCE_GAP.sub("\n", text),  # one sentence per line
    ]
    out: list[str] = []
    for c in candidates:
        if c != text and c not in out:
            out.append(c)
    return out


def _applicable(text: str) -> list[str]:
    names = ["lead_in"]
    if _reflow_options(text):
        names.append("reflow")
    if _question_first_applies(text):
        names.append("question_first")
    return names


def _apply(text: str, names: tuple[str, ...], rng: random.Random) -> str:
    for name in names:
        if name == "question_first":
            text = _question_first(text)
        elif name == "reflow":
            options = _reflow_options(text)
            if options:
                text = rng.choice(options)
        elif name == "lead_in":
            text = f"{rng.choice(LEAD_INS)}\n\n{text}"
    return text


def _choose(applicable: list[str], rng: random.Random) -> tuple[str, ...]:
    # Each transform in or out with probability 1/2, redrawn if empty: uniform over non-empty subsets.
    while True:
        chosen = {name for name in applicable if rng.random() < 0.5}
        if chosen:
            return tuple(name for name in _APPLY_ORDER if name in chosen)


def augment_rows(rows: list[Row], factor: int, seed: int, input_field: str,
                 rng: random.Random | None = None) -> tuple[list[Row], AugmentStats]:
    """Expand training rows ``factor``-fold with target-preserving variants of their input.

    Each variant applies a random non-empty subset of the transforms applicable to the row, in the fixed order
    question_first, reflow, lead_in. A variant equal to its source or to an earlier variant of the same row is
    redrawn up to 10 times, then kept and counted in ``AugmentStats.identical``.

    Variants keep the original's ``index`` and fields except ``input_field``, and get ``variant_of=row.index``,
    ``transforms`` (names applied) and ``where=f"{row.where} (variant {k})"`` with ``k`` from 1.

    Args:
        rows: training rows (never validation rows).
        factor: output size multiplier; 1 returns the rows unchanged.
        seed: augmentation seed; output depends only on ``(rows, factor, seed)``.
        input_field: name of the field holding the input text.
        rng: the generator to draw from instead of a new one seeded with ``seed``: rows augmented chunk by chunk
            with one generator carried across the chunks in row order get the variants of one call over all rows.

    Returns:
        ``(rows_out, stats)``; ``rows_out`` has each original followed by its ``factor - 1`` variants.

    Raises:
        ValueError: ``factor < 1``.
        DataError: rows whose input field is missing or not a string (all listed).
    """
    if factor < 1:
        raise ValueError(f"augmentation factor must be >= 1, got {factor}")
    stats = AugmentStats(rows_before=len(rows), rows_after=len(rows) * factor)
    if factor == 1:
        return list(rows), stats

    problems = [
        Problem(f"field '{input_field}' is missing or not text, so it cannot be augmented", where=row.where)
        for row in rows
        if not isinstance(row.fields.get(input_field), str)
    ]
    if problems:
        raise DataError(problems)

    rng = random.Random(seed) if rng is None else rng
    out: list[Row] = []
    for row in rows:
        source: str = row.fields[input_field]
        applicable = _applicable(source)
        seen = {source}
        out.append(row)
        for k in range(1, factor):
            for _ in range(1 + _MAX_RETRIES):
                names = _choose(applicable, rng)
                text = _apply(source, names, rng)
                if text not in seen:
                    break
            else:
                stats.identical += 1
            seen.add(text)
            for name in names:
                stats.per_transform[name] += 1
            variant = replace(row, variant_of=row.index, transforms=names, where=f"{row.where} (variant {k})")
            out.append(variant.with_fields(**{input_field: text}))
    return out, stats


def augment_conversations(rows: list[Row], factor: int, seed: int,
                          rng: random.Random | None = None) -> tuple[list[Row], AugmentStats]:
    """Augment a conversation's last user turn only: assistant text (what is trained) is never changed (``rng``:
    as :func:`augment_rows`)."""
    field_name = "\u2063user"

    def last_user(r: Row) -> int:
        return max(i for i, m in enumerate(r.fields["messages"]) if m["role"] == "user")

    if factor == 1:  # nothing to augment: no staged and rebuilt copy of every conversation (a peak-RSS doubling)
        return augment_rows(rows, factor, seed, field_name)
    staged = [r.with_fields(**{field_name: r.fields["messages"][last_user(r)]["content"]}) for r in rows]
    out, stats = augment_rows(staged, factor, seed, field_name, rng)
    rebuilt = []
    for r in out:
        messages = [dict(m) for m in r.fields["messages"]]
        messages[last_user(r)]["content"] = r.fields[field_name]
        fields = {k: v for k, v in r.fields.items() if k != field_name}
        rebuilt.append(replace(r, fields={**fields, "messages": messages}))
    return rebuilt, stats
