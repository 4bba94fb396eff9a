"""Classify's examples in the encoded-data cache (``data/encoded_store.py``): the key, the arrays written, the
examples read back by position, and the record that lets a hit say and know what the encoding run did.

A classify example is its tokens (``input_ids``, plus the tokenizer's other outputs the model takes, stored per
token) and one label stored per example: a class id (int64), a multi-hot row (uint8, one value a class) or a
regression target (float64, the value ``LabelSpec.encode`` gave, bit for bit). The store's per-token ``labels``
column is empty: nothing is supervised per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, overload

import numpy as np

import surefit.startup.cache as startup_cache
from surefit.config.task_configs import ClassifyConfig
from surefit.data import encoded_store
from surefit.data.classes import Fields, LabelSpec
from surefit.data.encoded_store import EncodedSplit, ExtraColumns, SplitArrays, StoreUse
from surefit.data.rows import Row
from surefit.data.summary import ClassifyFacts, DataSummary, checked_fields
from surefit.errors import raise_if

Say = Callable[[str], None]
LABEL = "label"  # the per-example array holding the target
# Settings that do not change what is read and encoded (training, the model's weights, the head's code): every other
# setting is part of the key, so a setting added later misses rather than reads the wrong examples. The model counts
# through its tokenizer and config.json, the head through whether there is one (its forward's arguments).
NOT_IN_STORE_KEY = startup_cache.NOT_IN_KEY | {
    "preset", "model", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "lora_variant", "quantize", "precision",
    "gradient_checkpointing", "sharding", "gpu_memory_gb", "batch_size", "grad_accum", "eval_batch_size", "head",
    "head_args"}


def store_key(cfg: ClassifyConfig, data_key: Any, path: str, tokenizer: Any) -> Any | None:
    """The store's key: the data files' content, the tokenizer (files and behaviour), the model's config.json (its
    positions cap the length, its class decides which tokenizer outputs the forward takes), the transformers version
    (which defines those forwards), every reading and encoding setting, whether a head is used, and surefit's code;
    ``None`` when the model is not a local folder."""
    import transformers

    files = encoded_store.tokenizer_files(path)
    if files is None:
        return None
    return {"task": "classify", "data": data_key, "tokenizer_files": files,
            "tokenizer": startup_cache.tokenizer_identity(tokenizer),
            "model_config": startup_cache.files_identity(f"{path}/config.json"),
            "transformers": transformers.__version__, "head": cfg.head is not None,
            "settings": {k: v for k, v in asdict(cfg).items() if k not in NOT_IN_STORE_KEY},
            "code": encoded_store.code_digest()}


def label_array(spec: LabelSpec, labels: Sequence[Any]) -> np.ndarray:
    """The encoded labels of a chunk as one array (see the module's docstring for the dtypes)."""
    if spec.problem_type == "single":
        return np.array(labels, dtype=np.int64).reshape(len(labels))
    if spec.problem_type == "regression":
        return np.array(labels, dtype=np.float64).reshape(len(labels))
    return np.array(labels, dtype=np.uint8).reshape(len(labels), len(spec.names))


def arrays_of(feats: Sequence[dict[str, Any]], rows: Sequence[Row], spec: LabelSpec, keys: Sequence[str]) -> SplitArrays:
    """One chunk of encoded examples (``train_classify.encode``'s features) as the store's arrays."""
    lengths = np.array([len(f["input_ids"]) for f in feats], dtype=np.int64)
    flat = lambda k: np.fromiter((t for f in feats for t in f[k]), dtype=np.int32,  # noqa: E731
                                 count=int(lengths.sum()))
    return SplitArrays(input_ids=flat("input_ids"), labels=np.zeros(0, dtype=np.int32), lengths=lengths,
                       prompt_len=lengths.astype(np.int32), supervised=np.ones(len(feats), dtype=np.int32),
                       source=np.array([r.index for r in rows], dtype=np.int64), where=[r.where for r in rows],
                       per_example={LABEL: label_array(spec, [f["labels"] for f in feats])},
                       per_token={k: flat(k) for k in keys if k != "input_ids"})


def merge_truncation(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One truncation report (``train_classify.tokenize``'s) from those of consecutive chunks."""
    out = dict(reports[0])
    for rep in reports[1:]:
        out["rows"] += rep["rows"]
        out["truncated"] += rep["truncated"]
        out["longest_tokens"] = max(out["longest_tokens"], rep["longest_tokens"])
        out["truncated_rows"] = (out["truncated_rows"] + rep["truncated_rows"])[:10]
    return out


class StoredExamples(Sequence[dict[str, Any]]):
    """One split's classify examples read from the store: ``examples[i]`` is the feature dict encoding made
    (token lists, and ``labels`` as ``LabelSpec.encode`` returned it), read from disk when asked."""

    def __init__(self, split: EncodedSplit, extras: ExtraColumns, keys: Sequence[str], problem_type: str) -> None:
        self.split, self.extras, self.keys, self.problem_type = split, extras, list(keys), problem_type

    def __len__(self) -> int:
        return len(self.split)

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"example {i} of {len(self)}")
        out: dict[str, Any] = {k: self.extras.tokens(k, i).tolist() for k in self.keys}
        label = self.extras.example(LABEL, i)
        out["labels"] = (int(label) if self.problem_type == "single" else float(label)
                         if self.problem_type == "regression" else [float(x) for x in label])
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        """Close the files (reads reopen them)."""
        self.split.close()
        self.extras.close()


@dataclass
class Record:
    """What the encoding run found and said, saved in the store's header so that a hit knows and says the same.

    Attributes:
        summary: the data summary (``encoded_store.summary_record``); lines: what reading printed; encode_lines:
            what encoding printed (truncations); spec: the labels (``LabelSpec``'s fields); fields: the columns read;
            columns: the data's columns in order (the kept / dropped table); validation_rows: the validation rows
            (``encoded_store.rows_record``: evaluation shows their text and gold label); max_len, keys: the length
            and the tokenizer outputs encoding used (checked against the model's on a hit).
    """

    summary: dict[str, Any]
    lines: list[str]
    encode_lines: list[str]
    spec: dict[str, Any]
    fields: dict[str, Any]
    columns: list[str]
    validation_rows: list[dict[str, Any]]
    max_len: int
    keys: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any, where: str) -> Record:
        """The record of a store's header (``where``: the header file), every value checked (the label spec and
        the columns read against their dataclasses' types): a hand-edited header is named by file and key."""
        saved = encoded_store.checked_record(value, where, {
            "summary": dict, "lines": list, "encode_lines": list, "spec": dict, "fields": dict, "columns": list,
            "validation_rows": list, "max_len": int, "keys": list},
            {"validation_rows": encoded_store.ROW_SHAPE}, dict.fromkeys(("lines", "encode_lines", "columns", "keys"), str))
        for key, kind in (("spec", LabelSpec), ("fields", Fields)):
            nested = saved.inner(key)
            if nested is not None:
                checked_fields(kind, nested)
        raise_if(saved.problems)
        return cls(**{f.name: value[f.name] for f in dataclasses.fields(cls)})

    def label_spec(self) -> LabelSpec:
        return LabelSpec(**self.spec)

    def fields_read(self) -> Fields:
        return Fields(**self.fields)

    def data_summary(self, where: str) -> DataSummary:
        return encoded_store.summary_of(self.summary, where, ClassifyFacts)


def say_store(use: StoreUse, n: int, summary: DataSummary, say: Say) -> None:
    """One line on what the encoded-data cache did, also saved in ``data_report.json`` (``encoded_store``)."""
    say(use.line(n))
    summary.facts_as(ClassifyFacts).encoded_store = use.to_json()
