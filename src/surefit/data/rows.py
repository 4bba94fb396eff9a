"""The unit that flows through the data pipeline: one source row with its provenance.

Keeping where a row came from on the row itself is what lets every later stage (field checks, split, augmentation,
encoding, rejected-row reports) name the file and line in its messages without threading positions around.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Row:
    """One example as read from a source, before encoding.

    Attributes:
        fields: the row's columns, e.g. ``{"input": "...", "target": "..."}``. SQuAD rows also carry ``answers``
            (every gold answer, used for scoring), ``id``, ``context`` and ``question``.
        where: human location for messages, e.g. ``"data/train.jsonl line 17"``.
        index: 0-based position of the row in its source, stable across runs (used for splits and reports).
        variant_of: for augmented copies, the ``index`` of the original row; ``None`` for original rows.
        transforms: names of the augmentation transforms that produced this variant (empty for originals).
    """

    fields: dict[str, Any]
    where: str
    index: int
    variant_of: int | None = None
    transforms: tuple[str, ...] = field(default=())

    def with_fields(self, **updates: Any) -> Row:
        """A copy with some fields replaced; provenance is kept."""
        return replace(self, fields={**self.fields, **updates})
