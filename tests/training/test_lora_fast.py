"""The fused LoRA forward (training/lora_fast.py): peft's numbers in fp32, the adapter kept in fp32 under 16-bit
base weights, dropout with the same distribution, and peft's own forward wherever the fused one does not apply."""

import copy

import pytest
import torch
from torch import nn

from conftest import tiny_llama
from surefit.data.collate import PadCollator
from surefit.training.lora_fast import effective_p, fuse_lora, keep_mask
from surefit.training.loss import causal_lm_loss_sum
from surefit.training.plan import store_frozen_in


def _peft(model, dropout=0.0, **extra):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=12, lora_dropout=dropout, target_modules="all-linear",
                                             **extra))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; a trained adapter does not
            nn.init.normal_(p, std=0.2)
    return model


def _batch(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    feats = []
    for i in range(n):
        ids = torch.randint(3, 60, (9 + 3 * i,), generator=g).tolist()
        feats.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
    return PadCollator(pad_token_id=0)(feats)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss, n = causal_lm_loss_sum(model, batch)
    (loss / n).backward()
    return (loss / n).item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_fused_forward_gives_peft_loss_and_gradients_in_fp32(monkeypatch):
    import surefit.training.lora_fast as lf

    ref = _peft(tiny_llama())
    fused = copy.deepcopy(ref)
    assert fuse_lora(fused) == 14  # 7 linear layers x 2 blocks
    batch = _batch()
    loss_ref, g_ref = _loss_and_grads(ref, batch)
    calls = []
    original = lf._LoraBranch.apply
    monkeypatch.setattr(lf._LoraBranch, "apply", lambda *a: calls.append(1) or original(*a))
    loss, g = _loss_and_grads(fused, batch)
    assert len(calls) == 14  # the fused path ran, not peft's fallback
    assert loss == pytest.approx(loss_ref, abs=1e-6)
    assert g.keys() == g_ref.keys() and len(g) == 28
    for k in g:
        assert torch.allclose(g[k], g_ref[k], atol=1e-6, rtol=1e-5), k


def test_adapter_contribution_survives_16_bit_base_weights_where_peft_rounds_it_away():
    """A small adapter on bf16 base weights: fused keeps base(bf16 matmul) + adapter in fp32; peft under autocast
    rounds the sum to bf16, losing an adapter contribution below half a bf16 step."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64, bias=False))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=4, target_modules=["0"]))
    layer = model.base_model.model[0]
    nn.init.constant_(layer.lora_B["default"].weight, 1e-5)  # a young adapter: contribution ~1e-4 of the output
    x = torch.randn(8, 64)
    with torch.no_grad():
        delta = layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
        store_frozen_in(model, torch.bfloat16)
        base_out = x.to(torch.bfloat16) @ layer.base_layer.weight.t()  # what the 16-bit base computes
        with torch.autocast("cpu", dtype=torch.bfloat16):
            peft_out = model(x)
        fuse_lora(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fused_out = model(x)
        plain = model(x)  # no autocast: the same numbers (the 16-bit matmul does not depend on autocast)
    assert peft_out.dtype == torch.bfloat16 and fused_out.dtype == torch.float32
    assert torch.equal(fused_out, plain)
    assert torch.allclose(fused_out - base_out.float(), delta, atol=1e-7, rtol=1e-3)
    # peft: most of the contribution is gone
    kept = ((peft_out.float() - base_out.float()) - delta).abs().mean() / delta.abs().mean()
    assert kept > 0.5


def test_dropout_keeps_each_element_with_probability_1_minus_p_and_scales_to_keep_the_mean():
    torch.manual_seed(0)
    keep = keep_mask((1000, 1000), 0.05, "cpu")
    assert keep.dtype == torch.bool and keep.shape == (1000, 1000)
    rate = keep.float().mean().item()
    assert abs(rate - (1 - effective_p(0.05))) < 5 * (0.05 * 0.95 / 1e6) ** 0.5  # within 5 standard errors
    assert abs(effective_p(0.05) - 0.05) < 2**-16
    # no structure between neighbours (the four 16-bit draws of one 64-bit number are independent)
    k = keep.flatten()[: 4 * 200_000].view(-1, 4).float()
    both = (k[:, 0] * k[:, 1]).mean().item()
    assert abs(both - rate * rate) < 0.003
    # in training the kept values are scaled: E[dropout(x)] == x
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(nn.Sequential(nn.Linear(16, 1, bias=False)),
                           LoraConfig(r=16, lora_alpha=16, lora_dropout=0.5, target_modules=["0"]))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.eye(16))
        layer.lora_B["default"].weight.fill_(1.0)
        layer.base_layer.weight.zero_()
    fuse_lora(model)
    model.train()
    x = torch.ones(20000, 16)
    with torch.no_grad():
        out = model(x)  # sum over 16 inputs each kept w.p. 1/2 and scaled by 2
    assert out.mean().item() == pytest.approx(16.0, rel=0.01)
    assert set(torch.unique(out).tolist()) <= {2.0 * k for k in range(17)}
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), torch.full((20000, 1), 16.0))  # no dropout in evaluation


def test_dropout_masks_follow_the_seed_and_recompute_identically_under_checkpointing():
    model = _peft(tiny_llama(), dropout=0.3)
    fuse_lora(model)
    model.train()
    batch = _batch()
    torch.manual_seed(5)
    a, ga = _loss_and_grads(model, batch)
    torch.manual_seed(5)
    b, gb = _loss_and_grads(model, batch)
    torch.manual_seed(6)
    c, _ = _loss_and_grads(model, batch)
    assert a == b and a != c
    # activation checkpointing replays the forward in the backward pass: the same masks must come out
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.base_model.model.enable_input_require_grads()
    torch.manual_seed(5)
    d, gd = _loss_and_grads(model, batch)
    assert d == pytest.approx(a, abs=1e-6)
    for k in ga:
        assert torch.allclose(ga[k], gd[k], atol=1e-6), k


def test_falls_back_to_peft_when_adapters_are_disabled_or_merged():
    ref = _peft(tiny_llama())
    model = copy.deepcopy(ref)
    fuse_lora(model)
    batch = {k: v for k, v in _batch().items() if k != "labels"}
    with torch.no_grad():
        with model.disable_adapter():
            off = model(**batch).logits
        with ref.disable_adapter():
            assert torch.equal(off, ref(**batch).logits)
        on = model(**batch).logits
        assert not torch.allclose(on, off)
        model.merge_adapter()
        assert torch.allclose(model(**batch).logits, on, atol=1e-5)


def test_a_dropout_too_small_for_16_bit_draws_falls_back_to_peft_instead_of_vanishing(monkeypatch):
    import surefit.training.lora_fast as lf

    model = _peft(tiny_llama(), dropout=1e-6)  # rounds to 0 in multiples of 2^-16
    fuse_lora(model)
    model.train()
    calls = []
    original = lf._LoraBranch.apply
    monkeypatch.setattr(lf._LoraBranch, "apply", lambda *a: calls.append(1) or original(*a))
    _loss_and_grads(model, _batch())
    assert calls == []
