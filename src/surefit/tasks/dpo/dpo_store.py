"""Dpo's pairs in the encoded-data cache (``data/encoded_store.py``): the key, the arrays written, and the pairs read
back by position.

A pair is two sequences that share their prompt: each side is a split of its own in the store (``train_chosen`` and
``train_rejected``, ``validation_chosen`` and ``validation_rejected``), example ``i`` of both being pair ``i``; the
chosen side also keeps each pair's ``prompt_cut`` (an array per example). No change to the store's layout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any, overload

import numpy as np

import surefit.startup.cache as startup_cache
from surefit.config.dpo_config import DPOConfig
from surefit.data import encoded_store
from surefit.data.encoded_store import EncodedSplit, ExtraColumns, SplitArrays
from surefit.data.pairs import PairExample
from surefit.data.rows import Row
from surefit.tasks.sft.train_sft import NOT_IN_STORE_KEY as SFT_NOT_IN_STORE_KEY

# sft's list, plus the loss's settings: what is read and encoded is sft's (format, template, truncation ...).
NOT_IN_STORE_KEY = SFT_NOT_IN_STORE_KEY | {"loss", "beta", "gamma", "orpo_lambda", "precompute_ref",
                                          "eval_generate_batch_size"}
SIDES = ("chosen", "rejected")


def store_key(cfg: DPOConfig, data_key: Any, path: str, tokenizer: Any) -> Any | None:
    """The store's key: the data files' content, the tokenizer (files and behaviour), every reading and encoding
    setting and surefit's code; ``None`` when the model is not a local folder."""
    files = encoded_store.tokenizer_files(path)
    if files is None:
        return None
    return {"task": "dpo", "data": data_key, "tokenizer_files": files,
            "tokenizer": startup_cache.tokenizer_identity(tokenizer),
            "settings": {k: v for k, v in asdict(cfg).items() if k not in NOT_IN_STORE_KEY},
            "code": encoded_store.code_digest()}


def side_arrays(examples: Sequence[PairExample], side: str) -> SplitArrays:
    """One side (``chosen`` / ``rejected``) of encoded pairs as the store's arrays."""
    ids = [getattr(e, f"{side}_ids") for e in examples]
    labels = [getattr(e, f"{side}_labels") for e in examples]
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    flat = lambda seqs: np.fromiter((t for s in seqs for t in s), dtype=np.int32,  # noqa: E731
                                    count=int(lengths.sum()))
    extra = {"prompt_cut": np.array([e.prompt_cut for e in examples], dtype=np.int64)} if side == "chosen" else {}
    return SplitArrays(input_ids=flat(ids), labels=flat(labels), lengths=lengths,
                       prompt_len=np.array([e.prompt_len for e in examples], dtype=np.int32),
                       supervised=np.array([sum(t != -100 for t in x) for x in labels], dtype=np.int32),
                       source=np.array([e.row.index for e in examples], dtype=np.int64),
                       where=[e.row.where for e in examples], per_example=extra)


class StoredPairs(Sequence[dict[str, Any]]):
    """A split's pairs read from the store: ``pairs[i]`` is the feature dict ``PairExample.features`` makes (plus
    ``reference_logps`` once :attr:`reference` is set), ``pairs.example(i)`` the ``PairExample`` (its row known by
    location and index only)."""

    def __init__(self, chosen: EncodedSplit, rejected: EncodedSplit, extras: ExtraColumns) -> None:
        self.chosen, self.rejected, self.extras = chosen, rejected, extras
        self.reference: list[list[float]] | None = None  # the precomputed reference, one [chosen, rejected] a pair

    def __len__(self) -> int:
        return len(self.chosen)

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        c, r = self.chosen[i], self.rejected[i]
        out: dict[str, Any] = {"chosen_ids": c["input_ids"], "chosen_labels": c["labels"],
                               "rejected_ids": r["input_ids"], "rejected_labels": r["labels"]}
        if self.reference is not None:
            out["reference_logps"] = self.reference[i]
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]

    def example(self, i: int, row: Row | None = None) -> PairExample:
        """Pair ``i`` as encoding made it (``row``: its source row, else one that knows only where it came from)."""
        f = self[i]
        prompt_len = len(self.chosen.prompt_ids(i))
        return PairExample(f["chosen_ids"], f["chosen_labels"], f["rejected_ids"], f["rejected_labels"], prompt_len,
                           row or Row({}, self.chosen.where(i), self.chosen.source(i)),
                           int(self.extras.example("prompt_cut", i)))

    def lengths(self) -> np.ndarray:
        """Both sequences' tokens of every pair (the loop's length of a pair)."""
        return np.asarray(self.chosen.lengths.values, dtype=np.int32) + np.asarray(self.rejected.lengths.values,
                                                                                 dtype=np.int32)

    def close(self) -> None:
        """Close the files (reads reopen them)."""
        self.chosen.close()
        self.rejected.close()
        self.extras.close()


class StoredExamples(Sequence[PairExample]):
    """A split's pairs as ``PairExample`` objects, each read from the store when asked (the doctor's label check reads
    every pair without holding them)."""

    def __init__(self, pairs: StoredPairs) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    @overload
    def __getitem__(self, i: int) -> PairExample: ...
    @overload
    def __getitem__(self, i: slice) -> list[PairExample]: ...
    def __getitem__(self, i: int | slice) -> PairExample | list[PairExample]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.pairs.example(i)

    def __iter__(self) -> Iterator[PairExample]:
        for i in range(len(self)):
            yield self[i]
