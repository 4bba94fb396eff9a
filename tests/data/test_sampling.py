import random

import numpy as np
import pytest

from surefit.data.sampling import EpochSteps, IndexShuffle, deal, epoch_steps, micro_batches, step_batches


def test_every_example_exactly_once_per_epoch_last_batch_kept():
    lengths = [random.Random(i).randint(5, 300) for i in range(103)]
    batches = step_batches(lengths, batch_size=8, seed=0, epoch=1)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(103))
    assert sorted(len(b) for b in batches)[0] == 103 % 8  # the remainder is a smaller batch, not dropped


def test_order_depends_only_on_seed_and_epoch():
    lengths = list(range(50))
    assert step_batches(lengths, 4, seed=1, epoch=2) == step_batches(lengths, 4, seed=1, epoch=2)
    assert step_batches(lengths, 4, seed=1, epoch=2) != step_batches(lengths, 4, seed=1, epoch=3)
    assert step_batches(lengths, 4, seed=1, epoch=2) != step_batches(lengths, 4, seed=2, epoch=2)


def test_length_grouping_pads_less_than_random_batches():
    rng = random.Random(0)
    lengths = [rng.randint(10, 500) for _ in range(400)]

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    order = list(range(400))
    rng.shuffle(order)
    random_batches = [order[i : i + 8] for i in range(0, 400, 8)]
    assert padding(step_batches(lengths, 8, seed=0, epoch=1)) < 0.25 * padding(random_batches)


def test_micro_batches_split_a_step_without_loss():
    lengths = [5, 50, 7, 48, 30]
    parts = micro_batches([0, 1, 2, 3, 4], 2, lengths)
    assert parts == [[1, 3], [4, 2], [0]]


def test_deal_gives_every_example_of_a_step_to_exactly_one_process():
    rng = random.Random(0)
    lengths = [rng.randint(5, 300) for _ in range(64)]
    for n in (1, 2, 3, 7, 13, 16):
        step = rng.sample(range(64), n)
        for processes in (1, 2, 3, 4):
            shares = deal(step, lengths, processes)
            assert len(shares) == processes
            assert sorted(i for s in shares for i in s) == sorted(step)
            sizes = [len(s) for s in shares]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert shares == deal(list(step), lengths, processes)  # every process computes the same deal


def test_deal_balances_tokens_and_leaves_processes_empty_only_when_the_step_is_too_small():
    lengths = [100, 90, 80, 70, 60, 50, 40, 30]
    shares = deal(list(range(8)), lengths, 2)
    tokens = [sum(lengths[i] for i in s) for s in shares]
    assert [len(s) for s in shares] == [4, 4] and tokens == [260, 260], shares  # a cut in halves: 340 vs 180
    assert deal([3], lengths, 2) == [[3], []]
    assert deal([], lengths, 2) == [[], []]



@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 255, 1000, 4097])
def test_the_index_shuffle_is_a_permutation_of_every_size(n):
    images = IndexShuffle(n, "k")(np.arange(n))
    assert sorted(images.tolist()) == list(range(n))
    assert IndexShuffle(n, "k")(np.arange(n)).tolist() == images.tolist()  # the same key, the same order


def test_the_index_shuffle_looks_random():
    n = 20_000
    images = IndexShuffle(n, "k")(np.arange(n))
    assert abs(np.corrcoef(np.arange(n), images)[0, 1]) < 0.03  # no trace of the input order
    # where index 0 goes, over many keys: every position of 10 about equally often
    counts = np.bincount([int(np.argmax(IndexShuffle(10, f"s{s}")(np.arange(10)) == 0)) for s in range(3000)])
    assert counts.min() > 240 and counts.max() < 360, counts


@pytest.mark.parametrize("version", [1, 2])
def test_every_example_exactly_once_per_epoch_with_each_sampler(version):
    lengths = [random.Random(i).randint(5, 300) for i in range(1003)]
    steps = epoch_steps(lengths, 8, seed=0, epoch=1, version=version)
    assert len(steps) == 126
    flat = [i for k in range(len(steps)) for i in steps[k]]
    assert sorted(flat) == list(range(1003))
    assert sorted(len(steps[k]) for k in range(len(steps)))[0] == 1003 % 8


def test_the_second_sampler_depends_only_on_seed_and_epoch_and_groups_by_length():
    rng = random.Random(0)
    lengths = np.array([rng.randint(10, 500) for _ in range(400)])
    steps = lambda seed, epoch: [EpochSteps(lengths, 8, seed, epoch)[k] for k in range(50)]  # noqa: E731
    assert steps(1, 2) == steps(1, 2) and steps(1, 2) != steps(1, 3) and steps(1, 2) != steps(2, 2)
    order = list(range(400))
    rng.shuffle(order)
    random_batches = [order[i : i + 8] for i in range(0, 400, 8)]

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    assert padding(steps(0, 1)) < 0.25 * padding(random_batches)
    # a step is its window's examples sorted longest first
    assert all(list(lengths[b]) == sorted(lengths[b], reverse=True) for b in steps(0, 1))


def test_the_second_sampler_order_is_pinned():
    """The order a run resumes with must not move under it: the same (seed, epoch) gives these steps on every
    machine and numpy version (integer arithmetic only). A change here needs a new sampler version."""
    lengths = np.array([(i * 37) % 101 + 5 for i in range(100)])
    steps = EpochSteps(lengths, 4, seed=0, epoch=1)
    assert [steps[k] for k in range(3)] == PINNED
    assert steps[-1] == steps[len(steps) - 1]


PINNED = [[47, 77, 6, 36], [16, 46, 76, 5], [51, 81, 29, 59]]


@pytest.mark.parametrize("processes", [2, 3])
def test_processes_read_disjoint_examples_covering_the_epoch_once_over_the_second_sampler(processes):
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 300, size=2001)
    steps = EpochSteps(lengths, 16, seed=3, epoch=2)
    seen = [[] for _ in range(processes)]
    for k in range(len(steps)):
        for rank, share in enumerate(deal(steps[k], lengths, processes)):
            seen[rank] += share
    assert sorted(i for share in seen for i in share) == list(range(2001))
    assert all(not set(seen[a]) & set(seen[b]) for a in range(processes) for b in range(a + 1, processes))


def test_the_first_sampler_is_kept_for_runs_that_started_with_it():
    lengths = [random.Random(i).randint(5, 300) for i in range(103)]
    assert epoch_steps(lengths, 8, 0, 1, version=1) == step_batches(lengths, 8, 0, 1)
    with pytest.raises(ValueError, match="sampler version 3"):
        epoch_steps(lengths, 8, 0, 1, version=3)


def test_longest_first_is_the_stable_descending_sort_in_slices():
    from surefit.data.sampling import longest_first

    rng = random.Random(1)
    values = [rng.randint(1, 30) for _ in range(1000)]  # many ties: the lower index first, as sorted() keeps them
    for k in (1, 5, 64, 1000, 2000):
        want = sorted(range(1000), key=lambda i: -values[i])[:k]
        assert longest_first(values, k, slice_size=97) == want
        assert longest_first(np.array(values, dtype=np.int32), k) == want
    assert longest_first([], 3) == []
