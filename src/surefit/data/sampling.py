"""Length-grouped batches: each optimizer step gets examples of similar length, so little compute goes to padding.

Every example appears exactly once per epoch (the last batch may be smaller: nothing is dropped). The order depends
only on (seed, epoch), so a resumed run sees the same batches. With several processes the steps are the same (the
batch size is the global one) and :func:`deal` splits each step among the processes, so a run of N processes is the
same run as one process.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def step_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, group_factor: int = 16) -> list[list[int]]:
    """Indices for each optimizer step of one epoch.

    Shuffle, cut into groups of ``batch_size * group_factor``, sort each group by length, cut into batches, and
    shuffle the batch order. Grouping inside shuffled windows (rather than sorting the whole set) keeps batches
    random across epochs while padding stays low.

    Args:
        lengths: token length of each example.
        batch_size: examples per optimizer step.
        seed: run seed; epoch: 0-based epoch number.
        group_factor: window size in batches.
    """
    rng = random.Random(f"{seed}/{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch_size * group_factor
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        group = sorted(order[start : start + window], key=lambda i: -lengths[i])
        batches.extend(group[j : j + batch_size] for j in range(0, len(group), batch_size))
    rng.shuffle(batches)
    return batches


def micro_batches(step: list[int], micro_batch_size: int, lengths: Sequence[int]) -> list[list[int]]:
    """Split one step's indices into micro-batches of similar length (the step's examples, each exactly once)."""
    ordered = sorted(step, key=lambda i: -lengths[i])
    return [ordered[j : j + micro_batch_size] for j in range(0, len(ordered), micro_batch_size)]


def deal(step: list[int], lengths: Sequence[int], processes: int) -> list[list[int]]:
    """Deal one step's examples to ``processes`` processes: each example to exactly one, the counts differing by at
    most one (the first ``len(step) % processes`` processes take one more), the tokens as even as a greedy deal gets.

    Longest first, each example goes to the process with the fewest tokens so far among those below their count
    (ties: the lower process index). The deal depends only on the step and the lengths, so every process computes
    the same one without talking to the others. A step with fewer examples than processes leaves some empty.
    """
    n = len(step)
    quota = [n // processes + (1 if r < n % processes else 0) for r in range(processes)]
    shares: list[list[int]] = [[] for _ in range(processes)]
    tokens = [0] * processes
    for i in sorted(step, key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(processes) if len(shares[r]) < quota[r]), key=lambda r: (tokens[r], r))
        shares[r].append(i)
        tokens[r] += lengths[i]
    return shares
