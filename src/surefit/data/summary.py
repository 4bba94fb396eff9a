"""What happened to a run's data, as a task's ``prepare`` found it: the record saved as ``data_report.json``, with
the facts later steps act on (the row format, the split sizes, the rejected rows, the encoding counts) as typed
attributes rather than keys read back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from surefit.data.readers import Rejected


@dataclass
class DataSummary:
    """Counts and choices of one run's data.

    Attributes:
        notes: lines printed while reading (conversions, duplicates, the split, augmentation, labels).
        rejected: rows dropped under ``--on_bad_rows skip``, each with where and why (listed in
            ``rejected_rows.jsonl``; the report saves their number). ``None``: the task does not reject rows.
        format: the row shape read (``input_target``, ``messages`` ...); format_conversational: rows are
            conversations (rendered with a chat template).
        train_rows, val_rows: rows in each split after augmentation.
        encoding: per split, what encoding did (rows, encoded, tokens, truncated, excluded ...).
        details: the task's other facts, saved as they are (field table, augmentation, labels, template ...).
    """

    notes: list[str] | None = None
    rejected: list[Rejected] | None = None
    format: str | None = None
    format_conversational: bool | None = None
    train_rows: int | None = None
    val_rows: int | None = None
    encoding: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def rejected_rows(self) -> int:
        return len(self.rejected or [])

    @property
    def validation_examples(self) -> int | None:
        """Validation examples the evaluation scores: those encoded, else the split's rows."""
        encoded = ((self.encoding or {}).get("validation") or {}).get("encoded")
        return encoded if isinstance(encoded, int) else self.val_rows

    def to_json(self) -> dict[str, Any]:
        """The record saved as ``data_report.json`` (what the task set, and nothing it left unset)."""
        out: dict[str, Any] = {}
        if self.notes is not None:
            out["notes"] = self.notes
        if self.rejected is not None:
            out["rejected_rows"] = self.rejected_rows
        typed = {"format": self.format, "format_conversational": self.format_conversational,
                 "train_rows": self.train_rows, "val_rows": self.val_rows, "encoding": self.encoding}
        out |= {k: v for k, v in typed.items() if v is not None}
        return out | self.details
