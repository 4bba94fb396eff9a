"""Evaluation batches are the cut of the rows, longest first, that computes the fewest padded tokens counting each
forward as the device's cost in tokens (training/loop.py: ``eval_batches``, data/collate.py: ``length_parts``), and
the loss over the set is the same as with full batches."""

from __future__ import annotations

import pytest
import torch

from conftest import OneProcess
from surefit.data.collate import CPU_PART_COST_TOKENS, PadCollator
from surefit.training.loop import eval_batches, evaluate_loss


def _order(lengths):
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def test_a_cpu_batch_ends_where_padding_costs_more_than_a_forward_and_a_gpu_keeps_the_fewest_batches():
    lengths = [380, 100, 370, 200, 190, 120, 110, 30]
    order = _order(lengths)
    lean = eval_batches(order, lengths, 8, "cpu")
    assert [[lengths[i] for i in part] for part in lean] == [[380, 370], [200, 190], [120, 110, 100], [30]]
    padded = sum(lengths[part[0]] * len(part) for part in lean)
    assert padded + CPU_PART_COST_TOKENS * len(lean) < 380 * 8 + CPU_PART_COST_TOKENS  # cheaper than one batch
    # Every row once, longest first, and never more rows than the batch size.
    assert [i for part in lean for i in part] == order
    assert eval_batches(order, lengths, 2, "cpu") == [order[0:2], order[2:4], order[4:6], [order[6]], [order[7]]]
    # On a GPU a forward costs thousands of tokens: as few batches as the batch size allows (one of 8; three of at
    # most 3), cut where they pad least.
    assert eval_batches(order, lengths, 8, "cuda") == [order]
    assert eval_batches(order, lengths, 3, "cuda") == [order[0:2], order[2:5], order[5:8]]


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
    assert lean_tokens == 3 * 40 + 3 * 12  # [40 38 25] [12 11 6]: 64 padded tokens cost more than a forward
    assert lean_tokens < 6 * 40  # one batch of 6 rows padded to 40
