"""Length-grouped batches: each optimizer step gets examples of similar length, so little compute goes to padding.

Every example appears exactly once per epoch (the last batch may be smaller: nothing is dropped). The order depends
only on (seed, epoch), so a resumed run sees the same batches. With several processes the steps are the same (the
batch size is the global one) and :func:`deal` splits each step among the processes, so a run of N processes is the
same run as one process.

Two samplers, versioned (a checkpoint records which one its run uses, and a resumed run keeps it):

- version 2 (:class:`EpochSteps`, every new run): the epoch's order is a keyed bijection of the example indices
  (:class:`IndexShuffle`), computed for the window a step needs when the step is asked for. Nothing is held per
  example and nothing is built up front, so the memory and the start-up do not grow with the examples.
- version 1 (:func:`step_batches`): ``random.Random`` shuffles of Python lists (about 50 bytes an example, 10-28 s at
  2M examples), kept so that a run started with it resumes with its own order.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import overload

import numpy as np

SAMPLER_VERSION = 2  # what a new run uses; checkpoints record it (training/loop.py's Progress.sampler)
SAMPLERS = (1, 2)
_ROUNDS = 6
_U64 = np.uint64


def as_int_array(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """``values`` as a numpy int array: itself if it is one, a store column's array (``__array__``) without a copy,
    else a copy of the list."""
    if isinstance(values, np.ndarray):
        return values
    if hasattr(values, "__array__"):
        return np.asarray(values)
    return np.fromiter(values, dtype=np.int64, count=len(values))


def longest_first(values: Sequence[int] | np.ndarray, k: int, slice_size: int = 1 << 20) -> list[int]:
    """The indices of the ``k`` largest values, largest first, ties by index: ``sorted(range(n), key=lambda i:
    -values[i])[:k]`` without a Python list of every index (the planner's longest examples at 2M examples: seconds
    and about 100 MB that way). Slices of ``slice_size`` bound the memory whatever ``n``."""
    arr = as_int_array(values)
    best = np.empty(0, dtype=np.int64)
    for a in range(0, len(arr), slice_size):
        idx = np.concatenate([best, np.arange(a, min(a + slice_size, len(arr)), dtype=np.int64)])
        best = idx[np.lexsort((idx, -arr[idx].astype(np.int64)))[:k]]
    return best.tolist()


class IndexShuffle:
    """A keyed permutation of ``range(n)`` that maps any index without building the whole order.

    Rounds of add-a-key, multiply-by-an-odd-key and xorshift on ``k``-bit words (each a bijection of ``[0, 2^k)``,
    ``2^k`` the smallest power of two >= n), and cycle-walking: an image outside ``[0, n)`` is mapped again until it
    lands inside, which keeps it a bijection of ``[0, n)`` (fewer than 2 rounds of walking per index on average).
    Integer arithmetic only (numpy's ``uint64``), so the order is the same on every machine and numpy version.

    Args:
        n: the number of indices.
        key: any text; the same key gives the same permutation.
    """

    def __init__(self, n: int, key: str) -> None:
        self.n = n
        self.bits = max(1, (n - 1).bit_length())
        self.mask = _U64((1 << self.bits) - 1)
        self.shift = _U64((self.bits + 1) // 2)
        words = np.frombuffer(b"".join(hashlib.sha256(f"{key}/{r}".encode()).digest() for r in range(_ROUNDS)),
                              dtype="<u8").reshape(_ROUNDS, 4)
        self.adds = words[:, 0] & self.mask
        self.mults = (words[:, 1] | _U64(1)) & self.mask  # odd: a bijection mod 2^k
        if self.bits == 1:
            self.mults[:] = 1

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        for r in range(_ROUNDS):
            x = (x + self.adds[r]) & self.mask
            x = (x * self.mults[r]) & self.mask  # wraps mod 2^64; the low k bits are the product mod 2^k
            x ^= x >> self.shift
        return x

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        """The images of ``indices`` (each in ``[0, n)``), as int64."""
        x = self._round_trip(np.asarray(indices, dtype=_U64))
        out = x >= _U64(self.n)
        while out.any():
            x[out] = self._round_trip(x[out])
            out = x >= _U64(self.n)
        return x.astype(np.int64)


class EpochSteps(Sequence[list[int]]):
    """Version 2 of the length-grouped steps of one epoch; ``steps[k]`` is step ``k``'s example indices.

    The same recipe as :func:`step_batches`: the examples in a shuffled order, cut into windows of
    ``batch_size * group_factor``, each window sorted by length (longest first) and cut into batches, and the batches
    in a shuffled order. Both shuffles are :class:`IndexShuffle` permutations keyed by ``(seed, epoch)``, so step
    ``k`` is computed from its own window alone: memory and set-up time do not depend on the number of examples.

    Args:
        lengths: each example's token length (a numpy array, or what :func:`as_int_array` takes).
        batch_size: examples per optimizer step; seed: run seed; epoch: the epoch's number.
        group_factor: the window in batches.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, batch_size: int, seed: int, epoch: int,
                 group_factor: int = 16) -> None:
        self.lengths = as_int_array(lengths)
        self.n, self.batch_size, self.group_factor = len(self.lengths), batch_size, group_factor
        self.window = batch_size * group_factor
        self.total = -(-self.n // batch_size)
        self.order = IndexShuffle(self.n, f"surefit-sampler-2/{seed}/{epoch}/order")
        self.batch_order = IndexShuffle(self.total, f"surefit-sampler-2/{seed}/{epoch}/batches")

    def __len__(self) -> int:
        return self.total

    def step(self, k: int) -> list[int]:
        """Step ``k``'s example indices, longest first."""
        if not 0 <= k < self.total:
            raise IndexError(f"step {k} of {self.total}")
        batch = int(self.batch_order(np.array([k]))[0])
        window, j = divmod(batch, self.group_factor)
        lo = window * self.window
        members = self.order(np.arange(lo, min(lo + self.window, self.n)))
        ordered = members[np.argsort(-self.lengths[members], kind="stable")]
        return ordered[j * self.batch_size : (j + 1) * self.batch_size].tolist()

    @overload
    def __getitem__(self, k: int) -> list[int]: ...
    @overload
    def __getitem__(self, k: slice) -> list[list[int]]: ...
    def __getitem__(self, k: int | slice) -> list[int] | list[list[int]]:
        if isinstance(k, slice):
            return [self.step(i) for i in range(*k.indices(self.total))]
        return self.step(k + self.total if k < 0 else k)


def epoch_steps(lengths: Sequence[int] | np.ndarray, batch_size: int, seed: int, epoch: int,
                version: int = SAMPLER_VERSION, group_factor: int = 16) -> Sequence[list[int]]:
    """The length-grouped steps of one epoch with the sampler ``version`` a run uses (see the module's docstring).

    Raises:
        ValueError: an unknown version (a checkpoint written by a newer surefit).
    """
    if version == 1:
        return step_batches(lengths.tolist() if isinstance(lengths, np.ndarray) else lengths, batch_size, seed, epoch,
                            group_factor)
    if version == 2:
        return EpochSteps(lengths, batch_size, seed, epoch, group_factor)
    raise ValueError(f"sampler version {version!r}; this surefit has versions {', '.join(map(str, SAMPLERS))}")


def step_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, group_factor: int = 16) -> list[list[int]]:
    """Version 1 of the indices for each optimizer step of one epoch (runs started with it resume with it).

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
