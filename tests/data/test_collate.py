import pytest
import torch

from surefit.data.collate import PadCollator


def test_collator_pads_every_key_with_its_own_value_and_keeps_eos_label_when_pad_is_eos():
    eos = pad = 2
    collate = PadCollator(pad_token_id=pad)
    batch = collate(
        [
            {"input_ids": [5, 6, 7, eos], "labels": [-100, -100, 7, eos]},
            {"input_ids": [8, eos], "labels": [-100, eos]},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 2], [8, 2, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # The real EOS (position 1 of row 2) stays a label; only the padded positions are -100.
    assert batch["labels"].tolist() == [[-100, -100, 7, 2], [-100, 2, -100, -100]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_collator_pad_to_multiple_leaves_lengths_that_already_are_multiples():
    collate = PadCollator(pad_token_id=0, pad_to_multiple_of=4)
    exact = collate([{"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, 4]}, {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}])
    assert exact["input_ids"].shape == (2, 4)
    assert exact["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    rounded = collate([{"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, 4, 5]}])
    assert rounded["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert rounded["labels"].tolist() == [[-100, 2, 3, 4, 5, -100, -100, -100]]


def test_collator_left_padding_for_generation():
    batch = PadCollator(pad_token_id=9, padding_side="left")([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [9, 9, 4]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_collator_names_example_and_lengths_when_labels_do_not_match_input_ids():
    # The seeds' bug: labels built for a different length than input_ids.
    with pytest.raises(ValueError, match=r"example 1: sequence keys have different lengths \{'input_ids': 3, 'labels': 2\}"):
        PadCollator(pad_token_id=0)([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}])


def test_collator_refuses_sequence_key_with_unknown_pad_value_and_stacks_scalars():
    with pytest.raises(ValueError, match="batch key 'idx_list'"):
        PadCollator(pad_token_id=0)([{"input_ids": [1], "idx_list": [3]}])
    batch = PadCollator(pad_token_id=0)([{"input_ids": [1, 2], "label": 1}, {"input_ids": [3], "label": 0}])
    assert batch["label"].tolist() == [1, 0]


def test_stack_keys_are_stacked_not_padded():
    batch = PadCollator(pad_token_id=0, stack_keys=("labels",))(
        [{"input_ids": [1, 2, 3], "labels": [1.0, 0.0, 1.0, 0.0]}, {"input_ids": [4], "labels": [0.0, 0.0, 0.0, 1.0]}]
    )
    assert batch["labels"].tolist() == [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    assert batch["labels"].dtype == torch.float32
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
