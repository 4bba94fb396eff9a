"""Evaluation batches on a CPU end where padding would cost more than a small share of their tokens
(training/loop.py: ``eval_batches``), and the loss over the set is the same as with full batches."""

from __future__ import annotations

import pytest
import torch

from conftest import OneProcess
from surefit.data.collate import PadCollator
from surefit.training.loop import EVAL_PADDING_SLACK, eval_batches, evaluate_loss


def _order(lengths):
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def test_a_cpu_batch_ends_before_a_row_whose_padding_would_exceed_the_slack():
    lengths = [380, 100, 370, 200, 190, 120, 110, 30]
    order = _order(lengths)
    lean = eval_batches(order, lengths, 8, lean=True)
    assert [[lengths[i] for i in part] for part in lean] == [[380, 370], [200, 190], [120, 110, 100], [30]]
    for part in lean:
        padded, real = lengths[part[0]] * len(part), sum(lengths[i] for i in part)
        assert padded <= (1 + EVAL_PADDING_SLACK) * real
    # Every row once, longest first, and never more rows than the batch size.
    assert [i for part in lean for i in part] == order
    assert eval_batches(order, lengths, 2, lean=True) == [order[0:2], order[2:4], order[4:6], [order[6]], [order[7]]]
    # Elsewhere (a GPU), the batches are the batch size's.
    assert eval_batches(order, lengths, 3, lean=False) == [order[0:3], order[3:6], order[6:8]]


def test_the_loss_over_lean_batches_is_the_full_batches_loss_with_fewer_padded_tokens(tiny_lm_dir):
    from transformers import AutoModelForCausalLM

    from surefit.training.loss import causal_lm_loss_sum

    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [40, 38, 12, 11, 25, 6]
    feats = []
    for n in lengths:
        ids = torch.randint(3, 60, (n,), generator=gen).tolist()
        feats.append({"input_ids": ids, "labels": [-100] * (n // 2) + ids[n // 2:]})
    padded = []

    def collate(items):
        batch = PadCollator(pad_token_id=0)(items)
        padded.append(int(batch["input_ids"].numel()))
        return batch

    def loss(accelerator):
        padded.clear()
        value = evaluate_loss(model, feats, lengths, loss_fn=causal_lm_loss_sum, collate=collate, batch_size=8,
                              accelerator=accelerator)
        return value, sum(padded)

    lean, lean_tokens = loss(OneProcess())
    one_row = evaluate_loss(model, feats, lengths, loss_fn=causal_lm_loss_sum, collate=collate, batch_size=1,
                            accelerator=OneProcess())
    assert lean == pytest.approx(one_row, rel=1e-5)
    assert lean_tokens == 40 + 38 + 25 + 12 + 11 + 6 + (40 - 38) + (12 - 11)  # [40 38] [25] [12 11] [6]
    assert lean_tokens < 6 * 40  # one batch of 6 rows padded to 40
