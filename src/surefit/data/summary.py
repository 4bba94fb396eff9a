"""What happened to a run's data, as a task's ``prepare`` found it: the record saved as ``data_report.json``, with
the facts later steps act on (the row format, the split sizes, the rejected rows, the encoding counts, the task's own
facts) as typed attributes. ``eval``, ``predict`` and ``export`` read it back with :meth:`DataSummary.from_json`,
which checks every value it returns: a run folder is data from anywhere, and a changed file is named, not trusted."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from surefit.data.readers import Rejected
from surefit.errors import Problem, SurefitError, raise_if

# data_report.json's layout: a newer one is refused by name rather than misread (files without a version are 1).
SUMMARY_VERSION = 1


class Saved:
    """The values of one saved JSON object, each checked for the type its reader needs; every wrong one is
    collected as a problem naming the file and the key (``problems``, raised once by the caller)."""

    def __init__(self, value: dict[str, Any], where: str, path: tuple[str, ...] = ()):
        self.value, self.where, self.path = value, where, path
        self.problems: list[Problem] = []

    def fix(self) -> str:
        return (f"{Path(self.where).name} was changed or cut after training; restore it, or delete it (surefit then "
                "uses the run's config.yaml) and check the results")

    def get(self, key: str, *types: type) -> Any:
        """``value[key]`` when it is one of ``types`` (a bool is no int), ``None`` when absent or null."""
        got = self.value.get(key)
        if got is None:
            return None
        if not isinstance(got, types) or (isinstance(got, bool) and bool not in types):
            self.wrong(key, got, " or ".join(t.__name__ for t in types))
            return None
        return got

    def items(self, key: str, item: type) -> list[Any] | None:
        """A list whose items are all ``item``."""
        got = self.get(key, list)
        if got is not None and not all(isinstance(x, item) and not (isinstance(x, bool) and item is int) for x in got):
            self.wrong(key, got, f"a list of {item.__name__}")
            return None
        return got

    def inner(self, key: str) -> Saved | None:
        """A JSON object under ``key``, checked the same way (its problems join this one's)."""
        got = self.get(key, dict)
        if got is None:
            return None
        nested = type(self)(got, self.where, (*self.path, key))  # a subclass keeps its own fix
        nested.problems = self.problems
        return nested

    def wrong(self, key: str, got: Any, expected: str) -> None:
        keys = " ".join(f"'{k}'" for k in (*self.path, key))
        shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
        self.problems.append(Problem(f"'{key}' is {shown} ({type(got).__name__}); expected {expected}",
                                     f"{self.where} {keys}", self.fix()))


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a parsed JSON value is what the annotation ``hint`` holds (a bool is no int; JSON has no tuples)."""
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if hint is type(None) or hint is None:
        return value is None
    if origin in (list, tuple) or hint in (list, tuple):
        item = args[0] if args else Any
        return isinstance(value, list) and all(_conforms(x, item) for x in value)
    if origin is dict or hint is dict:
        item = args[1] if len(args) == 2 else Any
        return isinstance(value, dict) and all(isinstance(k, str) and _conforms(v, item) for k, v in value.items())
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)  # its fields are checked by checked_fields on the way in
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


def checked_fields(cls: type, saved: Saved) -> dict[str, Any] | None:
    """The fields of dataclass ``cls`` from a saved JSON object, each checked against its annotation (nested
    dataclasses too), for ``cls(**fields)``; every wrong or missing one joins ``saved.problems`` (then ``None``).
    One checker for every typed record a file holds, so a hand-edited value is named by file and key, never a
    ``TypeError`` from deep inside a run."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    before = len(saved.problems)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if f.name not in saved.value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                keys = " ".join(f"'{k}'" for k in (*saved.path, f.name))
                saved.problems.append(Problem(f"'{f.name}' is missing", f"{saved.where} {keys}", saved.fix()))
            continue
        got = saved.value[f.name]
        if not _conforms(got, hint):
            saved.wrong(f.name, got, str(hint).replace("typing.", ""))
        elif dataclasses.is_dataclass(hint) and isinstance(hint, type):
            nested = saved.inner(f.name)
            inner = None if nested is None else checked_fields(hint, nested)
            out[f.name] = None if inner is None else hint(**inner)
        else:
            out[f.name] = tuple(got) if typing.get_origin(hint) is tuple or hint is tuple else got
    return out if len(saved.problems) == before else None


def saved_object(value: Any, where: str, what: str = "") -> Saved:
    """``value`` (a parsed JSON file: ``what``, at ``where``) as a :class:`Saved` object; anything but a JSON object
    is refused."""
    if not isinstance(value, dict):
        raise SurefitError(Problem(f"{where}{f' ({what})' if what else ''} holds a {type(value).__name__}, not a JSON "
                                   "object", where, Saved({}, where).fix()))
    return Saved(value, where)


@dataclass
class TextFacts:
    """The text tasks' facts (sft, dpo): how the rows became prompts and answers.

    Attributes:
        field_table: what became of each field of the rows (kept, dropped, and why).
        augmentation: what augmentation did (sft; ``AugmentStats``'s counts).
        system_prompt: a system prompt the template or ``--system_prompt`` adds (sft, when one is added).
        template: the prompt template or chat template chosen, in words.
        stop_ids: the token ids generation stops at (EOS and the template's end-of-turn ids).
        encoded_store: what the encoded-data cache did (hit, miss, off ...; sft).
    """

    field_table: list[dict[str, Any]] | None = None
    augmentation: dict[str, Any] | None = None
    system_prompt: dict[str, Any] | None = None
    template: str | None = None
    stop_ids: list[int] | None = None
    encoded_store: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, saved: Saved) -> TextFacts:
        return cls(field_table=saved.items("field_table", dict), augmentation=saved.get("augmentation", dict),
                   system_prompt=saved.get("system_prompt", dict), template=saved.get("template", str),
                   stop_ids=saved.items("stop_ids", int), encoded_store=saved.get("encoded_store", dict))


@dataclass
class ClassifyFacts:
    """The classify task's facts: the labels and the columns training read.

    Attributes:
        problem_type: ``single``, ``multi`` or ``regression``; label2id: class name -> id (``None`` for regression).
        text_field, pair_field, label_field: the columns read (saved as ``fields``; ``None``: runs from before they
            were recorded, whose ``columns.json`` names them).
        encoded_store: what the encoded-data cache did (hit, miss, off ...), as :class:`TextFacts` says it.
    """

    problem_type: Literal["single", "multi", "regression"] | None = None
    label2id: dict[str, int] | None = None
    text_field: str | None = None
    pair_field: str | None = None
    label_field: str | None = None
    encoded_store: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"problem_type": self.problem_type, "label2id": self.label2id}
        if self.text_field is not None:
            out["fields"] = {"text": self.text_field, "pair": self.pair_field, "label": self.label_field}
        if self.encoded_store is not None:
            out["encoded_store"] = self.encoded_store
        return out

    @classmethod
    def from_json(cls, saved: Saved) -> ClassifyFacts:
        label2id = saved.get("label2id", dict)
        if label2id is not None and not all(isinstance(v, int) and not isinstance(v, bool) for v in label2id.values()):
            saved.problems.append(Problem("'label2id' maps labels to something other than class numbers",
                                          f"{saved.where} 'label2id'", saved.fix()))
            label2id = None
        fields = saved.inner("fields")
        problem_type = saved.get("problem_type", str)
        if problem_type not in (None, "single", "multi", "regression"):
            saved.wrong("problem_type", problem_type, "single, multi or regression")
            problem_type = None
        return cls(problem_type=problem_type, label2id=label2id,
                   text_field=fields.get("text", str) if fields else None,
                   pair_field=fields.get("pair", str) if fields else None,
                   label_field=fields.get("label", str) if fields else None,
                   encoded_store=saved.get("encoded_store", dict))


@dataclass
class ArrayFacts:
    """The custom task's facts: the shape of each array of the dataset (``arrays``)."""

    arrays: dict[str, list[int]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {} if self.arrays is None else {"arrays": self.arrays}

    @classmethod
    def from_json(cls, saved: Saved) -> ArrayFacts:
        arrays = saved.inner("arrays")
        return cls(None if arrays is None else {k: arrays.items(k, int) or [] for k in arrays.value})


TaskFacts = TextFacts | ClassifyFacts | ArrayFacts
F = TypeVar("F", TextFacts, ClassifyFacts, ArrayFacts)
# Which facts each task's report holds (the task is the run's config.yaml 'task').
FACTS_OF_TASK: dict[str, type[TaskFacts]] = {"sft": TextFacts, "dpo": TextFacts, "classify": ClassifyFacts,
                                             "custom": ArrayFacts}


@dataclass
class DataSummary:
    """Counts and choices of one run's data.

    Attributes:
        notes: lines printed while reading (conversions, duplicates, the split, augmentation, labels).
        rejected: rows dropped under ``--on_bad_rows skip``, each with where and why (listed in
            ``rejected_rows.jsonl``; the report saves their number). ``None``: the task does not reject rows.
        rejected_count: that number, as read back from a saved report (which does not hold the rows).
        format: the row shape read (``input_target``, ``messages`` ...); format_conversational: rows are
            conversations (rendered with a chat template).
        train_rows, val_rows: rows in each split after augmentation.
        encoding: per split, what encoding did (rows, encoded, tokens, truncated, excluded ...), as counted.
        facts: the task's own facts (:data:`TaskFacts`).
    """

    notes: list[str] | None = None
    rejected: list[Rejected] | None = None
    rejected_count: int | None = None
    format: str | None = None
    format_conversational: bool | None = None
    train_rows: int | None = None
    val_rows: int | None = None
    encoding: dict[str, dict[str, Any]] | None = None
    facts: TaskFacts | None = None

    @property
    def rejected_rows(self) -> int:
        return len(self.rejected) if self.rejected is not None else self.rejected_count or 0

    def encoded(self, split: str, count: str) -> int | None:
        """One count of what encoding did to ``split`` (``encoded``, ``longest_target`` ...), if recorded."""
        value = (self.encoding or {}).get(split, {}).get(count)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def validation_examples(self) -> int | None:
        """Validation examples the evaluation scores: those encoded, else the split's rows."""
        encoded = self.encoded("validation", "encoded")
        return encoded if encoded is not None else self.val_rows

    def facts_as(self, cls: type[F]) -> F:
        """The task's facts as ``cls``; empty ones are attached when the report has none (a report from before they
        were recorded, or a task filling them in)."""
        if self.facts is None:
            self.facts = cls()
        if not isinstance(self.facts, cls):
            raise TypeError(f"the data summary holds {type(self.facts).__name__}, not {cls.__name__}")
        return self.facts

    def to_json(self) -> dict[str, Any]:
        """The record saved as ``data_report.json`` (what the task set, and nothing it left unset)."""
        out: dict[str, Any] = {"version": SUMMARY_VERSION}
        if self.notes is not None:
            out["notes"] = self.notes
        if self.rejected is not None or self.rejected_count is not None:
            out["rejected_rows"] = self.rejected_rows
        typed = {"format": self.format, "format_conversational": self.format_conversational,
                 "train_rows": self.train_rows, "val_rows": self.val_rows, "encoding": self.encoding}
        out |= {k: v for k, v in typed.items() if v is not None}
        return out | (self.facts.to_json() if self.facts is not None else {})

    @classmethod
    def from_json(cls, value: Any, where: str, facts: type[TaskFacts] | None = None) -> DataSummary:
        """A saved report read back (``where``: its file, for messages), with ``facts`` the task's kind of facts.

        Raises:
            SurefitError: naming the file and key of every value that is not what the report holds (a changed or
                cut file), or a report of a newer layout.
        """
        saved = saved_object(value, where, "what happened to the data")
        version = saved.value.get("version", SUMMARY_VERSION)
        if version != SUMMARY_VERSION:
            raise SurefitError(Problem(f"{where} is version {version!r}; this surefit reads version "
                                       f"{SUMMARY_VERSION}", f"{where} 'version'",
                                       "read the run with the surefit version that wrote it"))
        encoding = saved.inner("encoding")
        splits: dict[str, dict[str, Any]] | None = None
        if encoding is not None:
            splits = {}
            for split in encoding.value:
                counts = encoding.inner(split)
                if counts is not None:
                    for count in ("encoded", "longest_target"):
                        counts.get(count, int)
                    splits[split] = counts.value
        out = cls(notes=saved.items("notes", str), rejected_count=saved.get("rejected_rows", int),
                  format=saved.get("format", str), format_conversational=saved.get("format_conversational", bool),
                  train_rows=saved.get("train_rows", int), val_rows=saved.get("val_rows", int), encoding=splits,
                  facts=facts.from_json(saved) if facts is not None else None)
        raise_if(saved.problems)
        return out
