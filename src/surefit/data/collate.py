"""The collator pads. Nothing else: labels were built in encoding.

The seeds' crash (``expected sequence of length 432 at dim 1 (got 512)``) came from a language-model collator that
padded ``input_ids`` but not a pre-built ``labels`` key. Here every sequence key is padded to the same length with
its own pad value, and a per-example length mismatch between keys is reported with the example and key names.

What padding costs decides where batches of rows sorted by length are cut for evaluation and generation
(:func:`length_parts`), so that rule lives beside the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

IGNORE_INDEX = -100


@dataclass
class PadCollator:
    """Pad a list of encoded examples into a batch of tensors.

    ``input_ids`` are padded with ``pad_token_id``, ``attention_mask`` with 0 (and built from the lengths when
    absent), ``labels`` with -100, ``token_type_ids`` with 0. Padding is decided by position, so a pad token equal to
    EOS never masks a real EOS label. Scalar values (e.g. a class label) are stacked.

    >>> collate = PadCollator(pad_token_id=2)
    >>> batch = collate([{"input_ids": [5, 6, 2], "labels": [-100, 6, 2]}, {"input_ids": [7, 2], "labels": [-100, 2]}])
    >>> batch["input_ids"].tolist()
    [[5, 6, 2], [7, 2, 2]]
    >>> batch["attention_mask"].tolist()
    [[1, 1, 1], [1, 1, 0]]
    >>> batch["labels"].tolist()
    [[-100, 6, 2], [-100, 2, -100]]

    Args:
        pad_token_id: the tokenizer's pad id.
        stack_keys: keys whose per-example values have a fixed size and are stacked, not padded (e.g. multi-hot
            ``labels`` of a multi-label classifier).
        pad_to_multiple_of: round the padded length up to a multiple of this (tensor-core friendly); ``None`` = no.
        padding_side: ``"right"`` for training, ``"left"`` for generation.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    padding_side: Literal["right", "left"] = "right"
    stack_keys: tuple[str, ...] = ()

    def pad_values(self) -> dict[str, int]:
        return {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX, "token_type_ids": 0}

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("PadCollator got an empty list of examples")
        pads = self.pad_values()
        keys = list(examples[0].keys())
        for i, ex in enumerate(examples):
            if list(ex.keys()) != keys:
                raise ValueError(f"example {i} has keys {sorted(ex)} but example 0 has {sorted(keys)}")
        seq_keys = [
            k
            for k in keys
            if k not in self.stack_keys
            and isinstance(examples[0][k], (list, tuple, torch.Tensor))
            and _ndim(examples[0][k]) == 1
        ]
        for k in seq_keys:
            if k not in pads:
                raise ValueError(
                    f"batch key {k!r} is a sequence but PadCollator does not know its pad value; "
                    f"known keys: {', '.join(pads)}. Drop the key before collation or pad it in encoding."
                )
        lengths = [len(ex["input_ids"]) for ex in examples] if "input_ids" in seq_keys else None
        for i, ex in enumerate(examples):
            own = {k: len(ex[k]) for k in seq_keys}
            if len(set(own.values())) > 1:
                raise ValueError(
                    f"example {i}: sequence keys have different lengths {own}; labels must be built with one entry per "
                    "input token (use -100 for positions without loss)"
                )
        width = max(len(ex[seq_keys[0]]) for ex in examples) if seq_keys else 0
        if self.pad_to_multiple_of and width % self.pad_to_multiple_of:
            width += self.pad_to_multiple_of - width % self.pad_to_multiple_of
        batch: dict[str, torch.Tensor] = {}
        for k in seq_keys:
            batch[k] = torch.tensor([self._pad(list(ex[k]), width, pads[k]) for ex in examples], dtype=torch.long)
        if lengths is not None and "attention_mask" not in batch:
            batch["attention_mask"] = torch.tensor(
                [self._pad([1] * n, width, 0) for n in lengths], dtype=torch.long
            )
        for k in keys:
            if k not in seq_keys:
                batch[k] = torch.as_tensor([ex[k] for ex in examples])
        return batch

    def _pad(self, seq: list[int], width: int, value: int) -> list[int]:
        fill = [value] * (width - len(seq))
        return seq + fill if self.padding_side == "right" else fill + seq


def _ndim(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.dim()
    return 1 if not value or not isinstance(value[0], (list, tuple)) else 2


# What one more forward costs, in tokens of the same forward: a CPU pays each operation's fixed cost (about 30 ms a
# forward of the embedded model on 2 cores, where a token costs 1.5 ms), a GPU runs a few thousand tokens in about the
# time of one (its small forwards are latency-bound; not measured here).
CPU_PART_COST_TOKENS = 32
GPU_PART_COST_TOKENS = 4096


def part_cost(device: Any) -> int:
    """:data:`CPU_PART_COST_TOKENS` on a CPU, :data:`GPU_PART_COST_TOKENS` elsewhere."""
    return CPU_PART_COST_TOKENS if torch.device(device).type == "cpu" else GPU_PART_COST_TOKENS


def length_parts(lengths: Sequence[int], tails: Sequence[int], limit: int,
                 forward_cost: int) -> list[tuple[int, int]]:
    """The cheapest cut of rows, in their order (longest first), into batches of at most ``limit``: a batch of ``n``
    rows computes ``n x (longest length + longest tail)`` tokens (generation's prompts are left padded to end in one
    column, what follows them right padded: the answers of its loss pass; ``tails`` all 0 for right-padded rows) plus
    ``forward_cost`` for its forward. Returns ``(start, end)`` per batch."""
    rows = len(lengths)
    best = [0.0] + [float("inf")] * rows
    cut = [0] * (rows + 1)
    for end in range(1, rows + 1):
        widest = tail = 0
        for start in range(end - 1, max(end - limit, 0) - 1, -1):
            widest, tail = max(widest, lengths[start]), max(tail, tails[start])
            cost = best[start] + (end - start) * (widest + tail) + forward_cost
            if cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], rows
    while end:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1]
