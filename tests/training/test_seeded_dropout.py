"""Dropout masks keyed by example: the same mask whatever rows share the micro-batch, nn.Dropout outside training.

The out-of-memory runs that rely on them are in tests/training/test_oom.py.
"""

import math

import pytest
import torch
from torch import nn

from surefit.training.dropout import UNKEYED, SeededDropout, effective_p, seed_dropout, training_rows


def _drop(p=0.1, name="model.layers.0.mlp.dropout"):
    return SeededDropout(p, name=name).train()


def test_an_example_gets_the_same_mask_alone_or_with_longer_and_shorter_rows():
    drop = _drop(0.3)
    torch.manual_seed(0)
    x = torch.randn(3, 12, 16)
    with training_rows(seed=7, step=4, rows=[5]):
        alone = drop(x[1:2, :7])  # example 5, 7 tokens, padded to nothing else
    with training_rows(seed=7, step=4, rows=[2, 5, 9]):
        batch = drop(x)  # the same example between others, padded to 12 tokens
        again = drop(x)  # a recomputation (gradient checkpointing) draws it again
    with training_rows(seed=7, step=4, rows=[5, 2]):
        short = drop(x[[1, 0], :4])  # first in a batch whose rows are 4 tokens long
    assert torch.equal(alone[0], batch[1, :7])
    assert torch.equal(batch, again)
    assert torch.equal(short[0], batch[1, :4])
    assert not torch.equal(batch[0], batch[1])  # another example, another mask
    with training_rows(seed=7, step=5, rows=[2, 5, 9]):
        assert not torch.equal(drop(x), batch)  # another step, other masks
    with training_rows(seed=7, step=4, rows=[2, 5, 9]):
        assert not torch.equal(_drop(0.3, name="model.layers.1.mlp.dropout")(x), batch)  # another module


def test_a_pooled_batch_x_features_tensor_is_keyed_per_row():
    drop = _drop(0.5, name="classifier.dropout")
    x = torch.ones(3, 64)
    with training_rows(seed=0, step=0, rows=[4, 8, 1]):
        batch = drop(x)
    with training_rows(seed=0, step=0, rows=[8]):
        alone = drop(x[:1])
    assert torch.equal(alone[0], batch[1])


def test_keep_rate_and_rescale():
    p = 0.1
    drop = _drop(p)
    x = torch.ones(4, 256, 512)
    with training_rows(seed=1, step=3, rows=[0, 1, 2, 3]):
        y = drop(x)
    n = x.numel()
    kept = int((y != 0).sum())
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(kept - n * (1 - p)) < 4 * sigma
    # rescaled by 1/(1-p), p as the mask uses it (a multiple of 2^-16: 0.1 -> 0.100006)
    assert torch.equal(y[y != 0], torch.full((kept,), 1 / (1 - effective_p(p))))
    assert abs(effective_p(p) - p) <= 2**-17
    # per feature and per position too (no feature or position always dropped)
    rate_f = (y != 0).float().mean(dim=(0, 1))
    assert float(rate_f.min()) > 1 - p - 4 * math.sqrt(p * (1 - p) / 1024)
    x.requires_grad_(True)
    with training_rows(seed=1, step=3, rows=[0, 1, 2, 3]):
        drop(x).sum().backward()
    assert torch.equal(x.grad, y)  # the gradient goes through the same mask


def test_outside_a_training_micro_batch_it_is_nn_dropout():
    x = torch.randn(2, 5, 8)
    ours, theirs = _drop(0.25), nn.Dropout(0.25).train()
    torch.manual_seed(3)
    expected = theirs(x)
    torch.manual_seed(3)
    assert torch.equal(ours(x), expected)  # same generator, same draws
    ours.eval()
    with training_rows(seed=0, step=0, rows=[0, 1]):
        assert ours(x) is x or torch.equal(ours(x), x)  # eval mode: no dropout, as nn.Dropout
    # a layout with no per-row key (a batch of another size) falls back to torch's generator, counted by name
    UNKEYED.clear()
    ours.train()
    with training_rows(seed=0, step=0, rows=[0, 1, 2]):
        torch.manual_seed(3)
        assert torch.equal(ours(x), expected)
    assert UNKEYED == {"model.layers.0.mlp.dropout": 1}


def test_seed_dropout_replaces_the_models_dropout_modules_with_their_p():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2), nn.ModuleDict({"default": nn.Dropout(0.05)}))
    assert seed_dropout(model) == 2
    assert isinstance(model[1], SeededDropout) and model[1].p == 0.2 and model[1].name == "1"
    assert isinstance(model[2]["default"], SeededDropout) and model[2]["default"].name == "2.default"
    assert seed_dropout(model) == 0  # already seeded


@pytest.mark.parametrize("frozen_dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_forward_and_pefts_forward_draw_the_same_masks(frozen_dtype):
    from peft import LoraConfig, get_peft_model

    from surefit.training.speedups.lora_fast import fuse_lora

    def build():
        torch.manual_seed(0)
        base = nn.Sequential()
        base.add_module("proj", nn.Linear(16, 8))
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["proj"]))
        with torch.no_grad():
            for n, prm in model.named_parameters():
                if "lora_B" in n:
                    prm.normal_()
        model.base_model.model.proj.base_layer.to(frozen_dtype)
        seed_dropout(model)
        return model.train()

    peft_model, fused_model = build(), build()
    fuse_lora(fused_model)
    x = torch.randn(2, 5, 16)
    with training_rows(seed=0, step=1, rows=[3, 4]):
        a = peft_model(x.to(frozen_dtype)).float()
        b = fused_model(x.to(frozen_dtype)).float()
    tol = 1e-5 if frozen_dtype == torch.float32 else 3e-2  # peft rounds its sum to bf16; the fused one is fp32
    assert torch.allclose(a, b, atol=tol, rtol=tol)
    with training_rows(seed=0, step=1, rows=[3, 4]):
        no_dropout = fused_model(x.to(frozen_dtype)).float()
    assert torch.equal(no_dropout, b)  # deterministic


def _reference_keep(seed, step, rows, salt, shape, p):
    """The keyed mask written out as the module docstring defines it, one module at a time, with the 32-bit mask
    after the multiply (what the masks were before the salted keys were computed for all modules at once)."""
    import hashlib

    m32, mul = 0xFFFFFFFF, 0x45D9F3B

    def mix(x):
        for _ in range(2):
            x = ((x ^ (x >> 16)) * mul) & m32
        return x ^ (x >> 16)

    base = torch.tensor([int.from_bytes(hashlib.blake2b(repr((seed, step, r)).encode(), digest_size=4).digest(), "little")
                         for r in rows], dtype=torch.int64)
    length = shape[1] if len(shape) > 2 else 1
    keys = mix(base[:, None] ^ mix(torch.arange(length, dtype=torch.int64) + 0x2545F491)[None, :])
    width = math.prod(shape[2:]) if len(shape) > 2 else shape[1]
    pairs = (width + 1) // 2
    h = ((mix(keys ^ salt)[..., None] ^ mix(torch.arange(pairs, dtype=torch.int64) + 0x6A09E667)) * mul) & m32
    h = h ^ (h >> 16)
    # each 16-bit half v, read as a signed int16 s, is kept when s >= -2^15 + round(p * 2^16): s + 2^15 is v ^ 2^15
    halves = torch.stack([h & 0xFFFF, h >> 16], -1) ^ (1 << 15)
    keep = (halves >= round(p * (1 << 16))).reshape(*keys.shape, 2 * pairs)
    return keep[..., :width].reshape(shape)


@pytest.mark.parametrize("limit", [1 << 22, 1, 200])
def test_the_masks_of_many_modules_are_each_their_definitions_alone_or_salted_together(monkeypatch, limit):
    import surefit.training.dropout as d

    monkeypatch.setattr(d, "SALTED_ELEMENTS", limit)  # all modules' salted keys at once, one by one, or in groups
    mods = [_drop(0.2, name=f"model.layers.{i}.mlp.dropout") for i in range(12)]
    rows = [7, 0, 31]
    for shape in [(3, 9, 10), (3, 5, 7), (3, 11), (3, 4, 2, 3)]:
        with training_rows(seed=5, step=2, rows=rows):
            got = [m.keep(shape, "cpu") for m in reversed(mods)]  # any order of calls
        for m, mask in zip(reversed(mods), got, strict=True):
            assert torch.equal(mask, _reference_keep(5, 2, rows, m.salt, shape, 0.2)), (shape, m.name)
    loose = d.keep_mask((3, 4, 6), 0.2, 12345, "cpu")  # no micro-batch: no mask
    assert loose is None
    with training_rows(seed=5, step=2, rows=rows):  # a salt no live module has
        assert torch.equal(d.keep_mask((3, 4, 6), 0.2, 12345, "cpu"), _reference_keep(5, 2, rows, 12345, (3, 4, 6), 0.2))
