import random

from surefit.data.sampling import micro_batches, step_batches


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
