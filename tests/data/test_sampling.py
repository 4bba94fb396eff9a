import random

from surefit.data.sampling import deal, micro_batches, step_batches


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

