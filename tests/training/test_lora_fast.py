"""The fused LoRA forward (training/speedups/lora_fast.py): peft's numbers in fp32, the adapter kept in fp32 under 16-bit
base weights, dropout with the same distribution, and peft's own forward wherever the fused one does not apply."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_llama
from surefit.data.collate import PadCollator
from surefit.training.loss import causal_lm_loss_sum
from surefit.training.precision import store_frozen_in
from surefit.training.speedups.lora_fast import effective_p, fuse_lora, keep_mask


def _peft(model, dropout=0.0, **extra):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=12, lora_dropout=dropout, target_modules="all-linear",
                                             **extra))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; a trained adapter does not
            nn.init.normal_(p, std=0.2)
    return model


def _feats(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    feats = []
    for i in range(n):
        ids = torch.randint(3, 60, (9 + 3 * i,), generator=g).tolist()
        feats.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
    return feats


def _batch(seed=0, n=3):
    return PadCollator(pad_token_id=0)(_feats(seed, n))


def _loss_and_grads(model, batch, bf16=False, dtype=torch.bfloat16):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=bf16):  # a 16-bit lm_head needs it, as in training
        loss, n = causal_lm_loss_sum(model, batch)
    (loss / n).backward()
    return (loss / n).item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_fused_forward_gives_peft_loss_and_gradients_in_fp32(monkeypatch):
    import surefit.training.speedups.lora_fast as lf

    ref = _peft(tiny_llama())
    fused = copy.deepcopy(ref)
    assert fuse_lora(fused) == 14  # 7 linear layers x 2 blocks
    batch = _batch()
    loss_ref, g_ref = _loss_and_grads(ref, batch)
    calls = []
    for fn in (lf._LoraBranch, lf._SwiGLULora):
        monkeypatch.setattr(fn, "apply", lambda *a, _o=fn.apply, _n=fn.__name__: calls.append(_n) or _o(*a))
    loss, g = _loss_and_grads(fused, batch)
    # the fused path ran, not peft's fallback: down_proj with the MLP's product (_SwiGLULora), the others alone
    assert sorted(calls) == ["_LoraBranch"] * 12 + ["_SwiGLULora"] * 2
    assert loss == pytest.approx(loss_ref, abs=1e-6)
    assert g.keys() == g_ref.keys() and len(g) == 28
    for k in g:
        assert torch.allclose(g[k], g_ref[k], atol=1e-6, rtol=1e-5), k


def _with_and_without_norm_recipes(model, batch, monkeypatch, switch_off, bf16):
    """Loss and gradients, and the bytes saved for the backward pass, with the norm recipes and then after
    ``switch_off()``; and how often a norm's output was made again (the first run's and the measuring forward's)."""
    import surefit.training.speedups.lora_fast as lf
    from surefit.training.plan import measure_saved_bytes

    model.train()
    made_again = []
    again = lf._norm_again
    monkeypatch.setattr(lf, "_norm_again", lambda *a: made_again.append(1) or again(*a))
    results, saved = [], []
    for recipes in (True, False):
        if not recipes:
            switch_off()
        torch.manual_seed(5)
        results.append(_loss_and_grads(model, batch, bf16=bf16))
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            saved.append(measure_saved_bytes(model, lambda: causal_lm_loss_sum(model, batch)[0]))
    return results, saved, made_again


def test_fp32_adapters_reading_a_norms_output_keep_the_norms_inputs_instead_with_the_same_bits(monkeypatch):
    """q/k/v and gate/up read an RMSNorm's output; in fp32 they keep the norm's input and row scale (saved by the
    norm anyway) and make the output again in the backward pass: the same loss and gradients to the bit, with
    dropout's masks, and one hidden-sized fp32 tensor per norm fewer saved."""
    import surefit.training.speedups.lora_fast as lf

    model = _peft(tiny_llama(), dropout=0.1)
    fuse_lora(model)
    batch = _batch()
    results, saved, made_again = _with_and_without_norm_recipes(
        model, batch, monkeypatch, lambda: monkeypatch.setattr(lf, "_norm_recipe", lambda x: None), bf16=False)
    (loss, g), (loss_plain, g_plain) = results
    assert loss == loss_plain
    assert g.keys() == g_plain.keys() and len(g) == 28
    assert all(torch.equal(g[k], g_plain[k]) for k in g)
    # 3 norms: both of block 1 and block 0's second (block 0's first reads the embeddings, which need no gradient);
    # each output made again by each adapter reading it: gate and up, then q, k, v, then gate and up
    assert len(made_again) == 2 + 3 + 2
    assert saved[1] - saved[0] == 3 * batch["input_ids"].numel() * 32 * 4


def test_16_bit_adapters_reading_a_norms_output_make_its_copy_again_once_with_the_same_bits(monkeypatch):
    """On 16-bit frozen weights q/k/v and gate/up kept a shared bf16 copy of their norm's output for their A
    gradients; now the norm's input and row scale (kept by the norm anyway) make it again in the backward pass, once
    per norm for the adapters sharing it. Without the activation store that is the same copy: the same loss and
    gradients to the bit, dropout included, and two bf16 tensors of the hidden width per token fewer per block."""
    import surefit.training.speedups.lora_fast as lf

    model = _peft(tiny_llama(), dropout=0.1)
    fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    batch = _batch()
    results, saved, made_again = _with_and_without_norm_recipes(
        model, batch, monkeypatch, lambda: monkeypatch.setattr(lf, "NORM_RECIPES_16", False), bf16=True)
    (loss, g), (loss_plain, g_plain) = results
    assert loss == loss_plain
    assert g.keys() == g_plain.keys() and len(g) == 28
    assert all(torch.equal(g[k], g_plain[k]) for k in g)
    # each norm's copy made again once, not once per adapter reading it: block 1's two norms and block 0's second
    # (block 0's first reads the embeddings, which need no gradient, so no norm recipe is tagged there)
    assert len(made_again) == 3
    assert lf._last_norm[0] is None  # the last copy went with the graph that needed it
    assert saved[1] - saved[0] == 3 * batch["input_ids"].numel() * 32 * 2


def test_under_the_bf16_store_the_copy_made_again_is_within_a_bf16_step_and_trains_the_same(monkeypatch):
    """With activations saved in bf16 the norm's input comes back rounded, so the copy made again can differ from the
    forward's by a bf16 step: the loss is the same (the forward is untouched), the A gradients within bf16 rounding,
    the rest to the bit."""
    import surefit.training.speedups.lora_fast as lf
    from surefit.training.speedups.lora_fast import SavedActivationsIn

    monkeypatch.setattr(SavedActivationsIn, "MIN_NUMEL", 1)  # this tiny batch's tensors are packed too

    model = _peft(tiny_llama())
    fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    batch = _batch()
    results = []
    for recipes in (True, False):
        lf.NORM_RECIPES_16 = recipes
        try:
            with SavedActivationsIn():
                results.append(_loss_and_grads(model, batch, bf16=True))
        finally:
            lf.NORM_RECIPES_16 = True
    (loss, g), (loss_plain, g_plain) = results
    assert loss == loss_plain
    a_grads = [k for k in g if "lora_A" in k and any(n in k for n in ("q_proj", "k_proj", "v_proj", "gate", "up_"))]
    assert len(a_grads) == 10  # 5 adapters reading a norm x 2 blocks
    assert all(torch.equal(g[k], g_plain[k]) for k in g if k not in a_grads)
    assert all(_rel(g[k], g_plain[k]) < 0.02 for k in a_grads)
    assert any(not torch.equal(g[k], g_plain[k]) for k in a_grads)


def test_a_norms_output_changed_in_place_before_an_adapter_reads_it_is_saved_as_it_is():
    """An in-place change voids the recipe (the adapter's gradient is the changed input's); the norm's output may be
    changed in place at all (it was once a view made inside a Function, which autograd forbids changing)."""
    import surefit.training.speedups.lora_fast as lf

    torch.manual_seed(0)
    norm = tiny_llama().model.norm
    lora = _peft(nn.Sequential(nn.Linear(32, 16, bias=False)))
    fuse_lora(norm), fuse_lora(lora)
    x = torch.randn(3, 32, requires_grad=True)
    grads = []
    for scaled_in_place in (True, False):
        lora.zero_grad()
        y = norm(x)
        if scaled_in_place:
            y.mul_(3.0)
        else:
            y = y * 3.0
        assert lf._norm_recipe(y) is None  # changed in place, or a new tensor (y * 3)
        lora(y).square().sum().backward()
        grads.append((lora.base_model.model[0].lora_A["default"].weight.grad.clone(), x.grad.clone()))
        x.grad = None
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert lf._norm_recipe(norm(x)) is not None


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
    import surefit.training.speedups.lora_fast as lf

    model = _peft(tiny_llama(), dropout=1e-6)  # rounds to 0 in multiples of 2^-16
    fuse_lora(model)
    model.train()
    calls = []
    original = lf._LoraBranch.apply
    monkeypatch.setattr(lf._LoraBranch, "apply", lambda *a: calls.append(1) or original(*a))
    _loss_and_grads(model, _batch())
    assert calls == []


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_on_16_bit_frozen_weights_the_mixed_path_runs_and_learns_as_fp32(monkeypatch):
    """bf16 matmuls (base and adapter), sum in fp32: loss and gradients within bf16 rounding of the fp32 path."""
    import surefit.training.speedups.lora_fast as lf

    ref = _peft(tiny_llama())
    fuse_lora(ref)
    mixed = copy.deepcopy(ref)
    store_frozen_in(mixed, torch.bfloat16)
    calls = []
    for fn in (lf._LoraMixed, lf._SwiGLUDown):
        monkeypatch.setattr(fn, "apply", lambda *a, _f=fn.apply, _n=fn.__name__: calls.append(_n) or _f(*a))
    batch = _batch()
    loss_ref, g_ref = _loss_and_grads(ref, batch)
    assert not calls  # fp32 frozen weights: the fp32 path
    loss, g = _loss_and_grads(mixed, batch, bf16=True)
    # per block: q, k, v, o, gate, up through _LoraMixed; down_proj with the MLP's product through _SwiGLUDown
    assert sorted(calls) == ["_LoraMixed"] * 12 + ["_SwiGLUDown"] * 2
    assert loss == pytest.approx(loss_ref, rel=2e-3) and loss != loss_ref
    assert g.keys() == g_ref.keys() and len(g) == 28
    assert all(g[k].dtype == torch.float32 for k in g)
    assert max(_rel(g[k], g_ref[k]) for k in g) < 0.08  # measured 0.044; peft under autocast: 0.074


def test_mixed_path_dropout_draws_the_fp32_paths_masks_and_folds_the_rescale_exactly():
    """One layer with a bias and dropout 0.25, the same seed: the mixed path matches the fp32 path to bf16 rounding
    (output, and the gradients of x, A and B), so it applies the same masks with the same rescale."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    ref = get_peft_model(nn.Sequential(nn.Linear(64, 48)), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.25,
                                                                       target_modules=["0"]))
    nn.init.normal_(ref.base_model.model[0].lora_B["default"].weight, std=0.3)
    fuse_lora(ref)
    mixed = copy.deepcopy(ref)
    store_frozen_in(mixed, torch.bfloat16)
    assert mixed.base_model.model[0].base_layer.weight.dtype == torch.bfloat16
    x0 = torch.randn(32, 64)

    def run(model, seed):
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        torch.manual_seed(seed)
        out = model(x)
        (out * torch.linspace(-1, 1, 48)).sum().backward()
        layer = model.base_model.model[0]
        return out.detach(), x.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad

    r, m = run(ref, 7), run(mixed, 7)
    assert m[0].dtype == torch.float32
    for a, b in zip(m, r, strict=True):
        assert _rel(a, b) < 1e-2
    other = run(mixed, 8)
    assert _rel(other[0], m[0]) > 0.05  # another seed, other masks: the dropout is live


def test_adapters_reading_the_same_input_share_one_16_bit_copy_of_it():
    from surefit.training.speedups.lora_fast import _shared_cast

    x = torch.randn(4, 8)
    a = _shared_cast(x, torch.bfloat16)
    assert a.dtype == torch.bfloat16 and torch.equal(a, x.to(torch.bfloat16))
    assert _shared_cast(x, torch.bfloat16) is a  # q, k and v
    assert _shared_cast(x, torch.float16) is not a
    x.add_(1.0)  # modified in place: a fresh copy
    b = _shared_cast(x, torch.bfloat16)
    assert b is not a and torch.equal(b, x.to(torch.bfloat16))
    y = x.clone()  # equal values, another tensor
    assert _shared_cast(y, torch.bfloat16) is not b
    with torch.inference_mode():  # inference tensors have no version counter
        z = torch.randn(4, 8)
        assert torch.equal(_shared_cast(z, torch.bfloat16), z.to(torch.bfloat16))


def test_a_fused_model_runs_under_inference_mode():
    model = _peft(tiny_llama(), dropout=0.1)
    fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    batch = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(input_ids=batch["input_ids"]).logits
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(input_ids=batch["input_ids"]).logits
    model.eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = model(input_ids=batch["input_ids"]).logits
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        b = model(input_ids=batch["input_ids"]).logits
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert torch.equal(a, b)  # evaluation: no dropout, the same numbers either way


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_saved_activations_in_bf16_halve_fp32_saves_and_leave_the_forward_alone(half, monkeypatch):
    """Under fp16 runs too (T4, V100, GTX 16xx: no bf16 arithmetic, but bf16 storage): the fp32 activations are
    stored in bf16, which has fp32's range, never in fp16."""
    import surefit.training.speedups.lora_fast as lf
    from surefit.training.plan import measure_saved_bytes
    from surefit.training.speedups.lora_fast import SavedActivationsIn

    # fp32 gate and up (as on a GPU): on this tiny model the only saved tensors large enough for the store to pack
    monkeypatch.setattr(lf, "GATE_UP_16", False)

    model = _peft(tiny_llama(), dropout=0.0)
    fuse_lora(model)
    store_frozen_in(model, half)
    batch = _batch(n=4)

    def forward():
        with torch.autocast("cpu", dtype=half):
            return causal_lm_loss_sum(model, batch)[0]

    plain = measure_saved_bytes(model, forward)
    packed = measure_saved_bytes(model, forward, SavedActivationsIn())
    assert packed < 0.85 * plain  # measured 0.82 (0.78 before the MLP kept only gate and up, fp32 both ways)
    loss_ref, g_ref = _loss_and_grads(model, batch, bf16=True, dtype=half)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=half), SavedActivationsIn():
        loss, n = causal_lm_loss_sum(model, batch)
    (loss / n).backward()
    assert (loss / n).item() == loss_ref  # the forward is untouched
    g = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert g.keys() == g_ref.keys()
    assert max(_rel(g[k], g_ref[k]) for k in g) < 0.02


def test_saved_activation_packing_keeps_parameters_small_and_16_bit_tensors_as_they_are():
    from surefit.training.speedups.lora_fast import Packed, SavedActivationsIn, _Kept

    saved = SavedActivationsIn()

    def kept(t):  # left as it is: the same storage, handed back unchanged
        k = saved.pack(t)
        return type(k) is _Kept and k.tensor.data_ptr() == t.data_ptr() and torch.equal(saved.unpack(k), t)

    w = nn.Parameter(torch.randn(128, 64))
    x = torch.randn(64, 128, requires_grad=True)
    act = x * 2.0
    assert kept(w)
    assert kept(w.t())  # a view of a parameter: never copied
    assert kept(x)  # a leaf (an input), not an activation
    assert kept(x[:1, :4] * 2.0)  # below MIN_NUMEL: not worth a copy
    assert kept(act.to(torch.bfloat16))
    plain = torch.randn(64, 128)
    assert saved.pack(plain) is plain  # no autograd history to drop
    p = saved.pack(act)
    assert isinstance(p, Packed) and p.tensor.dtype == torch.bfloat16
    assert saved.pack(act) is p  # saved by two operations: packed once
    assert torch.equal(saved.unpack(p), act.detach().to(torch.bfloat16).float())
    with torch.no_grad():
        act.add_(1.0)
    assert saved.pack(act) is not p  # changed in place since: packed again
    # A fused forward's output is a view of a buffer it made with grad off (a leaf that needs no gradient): an
    # activation, packed. Kept as it was, QLoRA's layer outputs stayed fp32 (on an H100: 573 against 426 MB saved).
    from surefit.training.speedups.lora_fast import _LoraBranch

    a, b = nn.Parameter(torch.randn(4, 128)), nn.Parameter(torch.randn(64, 4))
    out = _LoraBranch.apply(act @ torch.randn(128, 64), act, a, b, 0.0, 1.0)
    assert out._base is not None and out._base.is_leaf and not out._base.requires_grad
    assert isinstance(saved.pack(out), Packed)
    with pytest.raises(ValueError, match="bfloat16 only"):
        SavedActivationsIn(torch.float16)


def test_a_forward_without_backward_under_packing_frees_its_graph():
    """An op that saves its own output (tanh here; SDPA and norms in a model) must not keep itself alive through the
    pack hook: a forward that raises (out of memory, retried smaller) or only measures would otherwise leak."""
    import gc
    import weakref

    from surefit.training.plan import measure_saved_bytes
    from surefit.training.speedups.lora_fast import SavedActivationsIn

    w = nn.Parameter(torch.randn(128, 128))
    x = torch.randn(64, 128)
    with SavedActivationsIn():
        small = torch.tanh(x[:4, :4] @ w[:4, :4])  # kept as it is (below MIN_NUMEL)
        big = torch.tanh(x @ w)  # packed in bf16
        loss = (small.sum() + big.sum())
    refs = [weakref.ref(small), weakref.ref(big)]
    del small, big, loss
    gc.collect()
    assert [r() for r in refs] == [None, None]

    out = []
    model = nn.Sequential(nn.Linear(128, 128), nn.Tanh())
    assert measure_saved_bytes(model, lambda: out.append(weakref.ref(model(x))) or out[-1]()) > 0
    gc.collect()
    assert out[0]() is None


def test_changing_a_saved_tensor_in_place_is_still_caught_under_packing():
    from surefit.training.speedups.lora_fast import SavedActivationsIn

    w = nn.Parameter(torch.randn(8, 8))
    with SavedActivationsIn():
        h = torch.tanh(torch.randn(2, 8) @ w)  # small: kept, and tanh saves it for its backward
        y = (h * h).sum()
    with torch.no_grad():
        h.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch.float32 \[2, 8\]\] is at version 1; "
                                           r"expected version 0.*not `x.mul_\(2\)`"):
        y.backward()


def test_a_training_step_stores_saved_activations_in_bf16_when_asked(monkeypatch):
    """``LoopSettings.saved_activations`` (set by the plan for LoRA on bf16 frozen weights) reaches the step."""
    from conftest import OneProcess
    from surefit.training.loop import StepPlan, accumulate_step
    from surefit.training.speedups.lora_fast import SavedActivationsIn
    from surefit.training.work import TrainingWork

    packed = []
    original = SavedActivationsIn.pack
    monkeypatch.setattr(SavedActivationsIn, "pack", lambda self, t: packed.append(t.dtype) or original(self, t))
    model = _peft(tiny_llama())
    fuse_lora(model)
    feats = _feats(n=2)
    lengths, counts = [len(f["input_ids"]) for f in feats], [len(f["input_ids"]) - 6 for f in feats]
    work = TrainingWork(feats, lengths, counts, collate=PadCollator(pad_token_id=0), loss_fn=causal_lm_loss_sum,
                        activation_store=SavedActivationsIn)
    accumulate_step(model, work, [0, 1], OneProcess(), StepPlan(2))
    assert not packed
    accumulate_step(model, work, [0, 1], OneProcess(), StepPlan(2, saved_activations="bf16"))
    assert torch.float32 in packed


def test_a_compiled_mask_packing_keeps_every_bit():
    """Under torch.compile the masks are packed with torch operations; inductor's uint8 sum on an AVX2 CPU dropped
    the high bits, and the backward then unpacked another mask than the forward drew."""
    from surefit.training.speedups.lora_fast import pack_mask, unpack_mask

    torch.manual_seed(0)
    keep = torch.rand(2, 37, 64) > 0.1
    eager = pack_mask(keep)  # numpy's packbits on a CPU
    compiled = torch.compile(pack_mask, dynamic=True)(keep)
    assert torch.equal(compiled, eager)
    assert torch.equal(torch.compile(unpack_mask, dynamic=True)(eager, keep.shape).bool(), keep)


def test_a_fused_model_compiles_and_trains_as_it_does_eagerly():
    """torch.compile traces the fused forward; the shared cast must not hand one layer another layer's input. The
    first block is compiled (every fused function is in it) and the second runs eagerly after it: compiling the
    second as well traced the same code again for its own weights. ``aot_eager``: dynamo's trace (where the bug was:
    the test fails with the bypass in ``_shared_cast`` removed) and AOTAutograd's over the fused autograd Functions,
    without inductor's C++ build, which took 2-3x the test's time and checks torch, not surefit."""
    model = _peft(tiny_llama(), dropout=0.1)
    fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    batch = _batch()
    torch.manual_seed(0)
    eager, g_eager = _loss_and_grads(model, batch, bf16=True)
    layer = model.base_model.model.model.layers[0]
    layer.forward = torch.compile(layer.forward, dynamic=True, backend="aot_eager")
    torch.manual_seed(0)
    compiled, g = _loss_and_grads(model, batch, bf16=True)
    assert compiled == pytest.approx(eager, rel=1e-2)
    assert g.keys() == g_eager.keys()
    assert max(_rel(g[k], g_eager[k]) for k in g) < 0.05


@pytest.mark.parametrize("bf16", [True, False])
def test_a_fused_lora_layer_traces_as_one_graph(bf16):
    """Without dropout (evaluation, or lora_dropout 0) dynamo traces a fused layer whole: it cannot trace
    ``is_inference()``, which the shared cast once asked first (a graph break at every adapter). In fp32 the norm's
    recipe and the MLP tail's function stand aside under the compiler, and nothing breaks the graph either."""
    model = _peft(tiny_llama(), dropout=0.0)
    fuse_lora(model)
    if bf16:
        store_frozen_in(model, torch.bfloat16)
    layer = model.base_model.model.model.layers[0]
    torch._dynamo.reset()
    for f, x in ((layer.self_attn.q_proj.forward, torch.randn(2, 5, 32, requires_grad=True)),
                 (layer.mlp.forward, torch.randn(2, 5, 32, requires_grad=True)),
                 (layer.input_layernorm.forward, torch.randn(2, 5, 32, requires_grad=True))):
        explained = torch._dynamo.explain(f)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1


def _unfuse_mlps(model):
    for m in model.modules():
        if "forward" in m.__dict__ and hasattr(m, "_surefit_act"):
            del m.forward  # the class's own forward again: act_fn(gate) * up, then down_proj through _LoraMixed


def _fused_and_plain_mlps(bf16: bool):
    """A fused tiny LoRA model (16-bit frozen weights under ``bf16``) and a copy with the MLPs' own forward, with the
    loss and gradients of each on the same batch and the same dropout masks."""
    fused = _peft(tiny_llama(), dropout=0.1)
    fuse_lora(fused)
    if bf16:
        store_frozen_in(fused, torch.bfloat16)
    plain = copy.deepcopy(fused)
    _unfuse_mlps(plain)
    batch = _batch()
    results = []
    for model in (fused, plain):
        model.train()
        torch.manual_seed(5)
        results.append(_loss_and_grads(model, batch, bf16=bf16))
    return fused, plain, batch, results[0], results[1]


@pytest.mark.parametrize("gate_up_16", [False, True])
def test_the_fused_mlp_computes_the_unfused_mixed_path_and_saves_only_gate_and_up(gate_up_16, monkeypatch):
    import surefit.training.speedups.lora_fast as lf
    from surefit.training.plan import measure_saved_bytes

    monkeypatch.setattr(lf, "GATE_UP_16", gate_up_16)
    fused, plain, batch, (loss_f, g_f), (loss_p, g_p) = _fused_and_plain_mlps(bf16=True)
    assert "forward" in fused.base_model.model.model.layers[0].mlp.__dict__
    assert "forward" not in plain.base_model.model.model.layers[0].mlp.__dict__
    assert g_f.keys() == g_p.keys() and len(g_f) == 28
    if not gate_up_16:
        assert loss_f == loss_p  # the same forward, the same dropout masks (drawn at the same point of the stream)
        assert max(_rel(g_f[k], g_p[k]) for k in g_f) < 1e-5  # the same backward, in another order
    else:  # gate and up rounded to 16 bits before the product (which is rounded to 16 bits after it anyway)
        assert loss_f != loss_p and loss_f == pytest.approx(loss_p, rel=2e-3)
        assert max(_rel(g_f[k], g_p[k]) for k in g_f) < 0.03

    def forward(model):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return causal_lm_loss_sum(model, batch)[0]
        return run

    tokens = batch["input_ids"].numel()
    saved_f, saved_p = measure_saved_bytes(fused, forward(fused)), measure_saved_bytes(plain, forward(plain))
    # per MLP element unfused: silu(gate) 4 bytes and down_proj's 16-bit copy of the product 2 bytes more; with 16-bit
    # gate and up, 2 + 2 bytes of them instead of 4 + 4
    assert saved_p - saved_f == (10 if gate_up_16 else 6) * tokens * 64 * 2  # intermediate 64, 2 blocks


def test_an_mlp_whose_down_proj_is_not_16_bit_keeps_gate_and_up_only_with_the_same_bits():
    """fp32 LoRA (a CPU's default) cannot take the 16-bit fused MLP; its own fused MLP saves gate and up only, not
    silu(gate) or the product as well, with autograd's numbers to the bit (dropout 0.1: the same masks too)."""
    import surefit.training.speedups.lora_fast as lf
    from surefit.training.plan import measure_saved_bytes

    fused, plain, batch, (loss_f, g_f), (loss_p, g_p) = _fused_and_plain_mlps(bf16=False)
    assert loss_f == loss_p
    assert g_f.keys() == g_p.keys() and len(g_f) == 28
    assert all(torch.equal(g_f[k], g_p[k]) for k in g_f)

    def forward(model):
        return lambda: causal_lm_loss_sum(model, batch)[0]

    tokens = batch["input_ids"].numel()
    saved_f, saved_p = measure_saved_bytes(fused, forward(fused)), measure_saved_bytes(plain, forward(plain))
    assert saved_p - saved_f == 2 * 4 * tokens * 64 * 2  # silu(gate) and the product in fp32: intermediate 64, 2 blocks
    calls = []
    original = lf._SwiGLULora.apply
    lf._SwiGLULora.apply = lambda *a: calls.append(1) or original(*a)
    try:
        _loss_and_grads(fused, batch)
    finally:
        lf._SwiGLULora.apply = original
    assert len(calls) == 2  # one per block
    fused.eval(), plain.eval()
    with torch.no_grad():  # evaluation: the module's own forward
        assert torch.equal(fused(**{k: v for k, v in batch.items() if k != "labels"}).logits,
                           plain(**{k: v for k, v in batch.items() if k != "labels"}).logits)


def test_only_swiglu_mlps_whose_forward_is_the_known_one_are_fused():
    from surefit.training.speedups.lora_fast import _is_swiglu_mlp

    class Gated(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
            self.act_fn = act

        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return down_proj

    class Scaled(Gated):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 0.5

    assert _is_swiglu_mlp(Gated(nn.SiLU()))
    assert not _is_swiglu_mlp(Gated(nn.GELU()))  # another activation
    assert not _is_swiglu_mlp(Scaled(nn.SiLU()))  # another computation
    assert _is_swiglu_mlp(tiny_llama().model.layers[0].mlp)  # transformers' SiLUActivation


def test_a_hook_on_down_proj_or_the_activation_keeps_the_mlp_unfused_so_the_hook_runs(monkeypatch):
    import surefit.training.speedups.lora_fast as lf

    model = _peft(tiny_llama())
    fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    layers = model.base_model.model.model.layers
    seen = []
    handles = [layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append("down")),
               layers[1].mlp.act_fn.register_forward_hook(lambda m, a, out: seen.append("act"))]
    calls = []
    original = lf._SwiGLUDown.apply
    monkeypatch.setattr(lf._SwiGLUDown, "apply", lambda *a: calls.append(1) or original(*a))
    _loss_and_grads(model, _batch(), bf16=True)
    assert seen == ["down", "act"] and calls == []
    for h in handles:
        h.remove()
    _loss_and_grads(model, _batch(), bf16=True)
    assert len(calls) == 2  # unhooked: both blocks fused again


@pytest.mark.parametrize("torch_ops", [False, True])
@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (3, 5, 7), (2, 9, 64)])
def test_a_mask_packed_into_bits_comes_back_unchanged(monkeypatch, shape, torch_ops):
    from surefit.training.speedups.lora_fast import pack_mask, unpack_mask

    if torch_ops:  # the path other devices and torch.compile take
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    g = torch.Generator().manual_seed(sum(shape))
    keep = torch.rand(shape, generator=g) < 0.7
    bits = pack_mask(keep)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-keep.numel() // 8)
    back = unpack_mask(bits, keep.shape)
    assert back.dtype == torch.uint8 and torch.equal(back, keep.to(torch.uint8))
    # a strided view (a sliced mask) packs as its values
    assert torch.equal(unpack_mask(pack_mask(keep[..., 1:]), keep[..., 1:].shape).bool(), keep[..., 1:])


def test_both_bit_packing_paths_give_the_same_bytes(monkeypatch):
    from surefit.training.speedups.lora_fast import pack_mask

    keep = torch.rand(5, 13, 11, generator=torch.Generator().manual_seed(3)) < 0.5
    numpy_bits = pack_mask(keep)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(pack_mask(keep), numpy_bits)


def _saved_bytes_loss_grads(model, batch, keyed):
    """(bytes of uint8/bool tensors saved for the backward pass, loss, gradients) of one bf16 step with dropout."""
    from surefit.training.dropout import training_rows

    seen, mask_bytes = set(), [0]

    def pack(t):
        # (the loss's [rows, length] token mask is not dropout's)
        if t.dtype in (torch.uint8, torch.bool) and t.dim() != 2 and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            mask_bytes[0] += t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the unkeyed masks (torch's generator) start from the same state
    def rows():
        return training_rows(0, 3, list(range(batch["input_ids"].shape[0]))) if keyed else contextlib.nullcontext()

    with rows(), torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, n = causal_lm_loss_sum(model, batch)
    with rows():
        (loss / n).backward()
    return mask_bytes[0], (loss / n).item(), {k: p.grad.clone() for k, p in model.named_parameters()
                                              if p.grad is not None}


@pytest.mark.parametrize("keyed", [True, False])
def test_dropout_masks_saved_as_bits_take_an_eighth_and_give_the_same_gradients_to_the_bit(monkeypatch, keyed):
    import surefit.training.speedups.lora_fast as lf
    from surefit.training.dropout import seed_dropout

    model = _peft(tiny_llama(), dropout=0.1)
    if keyed:
        seed_dropout(model)
    store_frozen_in(model, torch.bfloat16)
    fuse_lora(model)
    model.train()
    batch = _batch(n=4)
    monkeypatch.setattr(lf, "PACK_MASKS", False)
    byte_masks, loss_ref, g_ref = _saved_bytes_loss_grads(model, batch, keyed)
    monkeypatch.setattr(lf, "PACK_MASKS", True)
    bit_masks, loss, g = _saved_bytes_loss_grads(model, batch, keyed)
    # 7 masks per block (q, k, v, o, gate, up on [4, 18, 32]; down on [4, 18, 64]), 2 blocks
    assert byte_masks == 2 * (6 * 4 * 18 * 32 + 4 * 18 * 64)
    assert bit_masks == byte_masks // 8
    assert loss == loss_ref and g.keys() == g_ref.keys() and len(g) == 28
    for k in g:
        assert torch.equal(g[k], g_ref[k]), k
    monkeypatch.setattr(lf, "PACK_MASKS", True)
    other = _saved_bytes_loss_grads(_peft(tiny_llama(), dropout=0.0), batch, keyed)[0]
    assert other == 0  # no dropout, no mask saved


@pytest.mark.parametrize("frozen16", [True, False])
def test_a_gpus_mask_paths_give_the_cpus_loss_and_gradients_to_the_bit(monkeypatch, frozen16):
    """Off the CPU the products take the boolean mask itself and the bits are packed by torch operations (fewer kernel
    launches): run here, on the CPU's kernels, they give the same loss and gradients to the bit."""
    import surefit.training.dropout as dropout
    import surefit.training.speedups.lora_fast as lf
    from surefit.training.dropout import seed_dropout

    model = _peft(tiny_llama(), dropout=0.1)
    seed_dropout(model)
    if frozen16:
        store_frozen_in(model, torch.bfloat16)
    fuse_lora(model)
    model.train()
    batch = _batch(n=4)
    _, loss_ref, g_ref = _saved_bytes_loss_grads(model, batch, keyed=True)

    def torch_path(fn):
        def run(*a):
            with monkeypatch.context() as m:
                m.setattr(torch.compiler, "is_compiling", lambda: True)
                return fn(*a)
        return run

    factors, real_as = [], lf._as

    def as_factor(keep, dtype):
        factor = real_as(keep, dtype)
        factors.append(factor.dtype)
        return factor

    monkeypatch.setattr(lf, "CAST_MASKS_ON", set())
    monkeypatch.setattr(dropout, "CONTIGUOUS_WORDS_ON", set())  # the keyed masks' comparison over strided words
    monkeypatch.setattr(lf, "pack_mask", torch_path(lf.pack_mask))
    monkeypatch.setattr(lf, "unpack_mask", torch_path(lf.unpack_mask))
    monkeypatch.setattr(lf, "_as", as_factor)
    _, loss, g = _saved_bytes_loss_grads(model, batch, keyed=True)
    assert len(factors) >= 14 and set(factors) == {torch.bool}  # every product took the boolean mask as it is
    assert loss == loss_ref and g.keys() == g_ref.keys() and len(g) == 28
    for k in g:
        assert torch.equal(g[k], g_ref[k]), k


@pytest.mark.parametrize("shape", [(4, 37, 576), (3, 17, 1), (2, 5, 7), (5, 33, 129), (6, 10)])
def test_the_cpus_int32_keyed_masks_are_the_int64_masks_bit_for_bit(monkeypatch, shape):
    # The CPU hashes in int32 words (a product that wraps modulo 2^32); other devices keep int64 products and read
    # their low words. Masks must not depend on the device: keys above 2^31 included, odd widths (a last half pair).
    from surefit.training import dropout

    masks = {}
    for words in ({"cpu"}, set()):
        monkeypatch.setattr(dropout, "CONTIGUOUS_WORDS_ON", words)
        for seed in range(4):
            with dropout.training_rows(seed, 7 + seed, [3 * seed + r for r in range(shape[0])]):
                for p in (0.05, 0.5, 0.9):
                    masks.setdefault(seed * 10 + int(p * 10), []).append(
                        dropout.keep_mask(shape, p, dropout.module_salt(f"m{seed}"), "cpu"))
    assert len(masks) == 12
    for cpu, other in masks.values():
        assert cpu.shape == shape and torch.equal(cpu, other)
    assert any(0 < m[0].float().mean() < 1 for m in masks.values())


@pytest.mark.parametrize("frozen16", [False, True])
def test_rms_norms_take_torchs_rms_norm_with_the_same_loss_and_gradients_and_others_keep_theirs(frozen16):
    # On a GPU torch's rms_norm is one fused kernel each way; on a CPU it is the same operations as transformers'
    # forward (the same loss to the bit) with the backward written out (the same gradients to fp32 rounding).
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from surefit.training.speedups.lora_fast import _is_rms_norm, _rms_norm_forward

    ref = _peft(tiny_llama(), dropout=0.0)
    if frozen16:
        store_frozen_in(ref, torch.bfloat16)
    fused = copy.deepcopy(ref)
    fuse_lora(ref)
    for m in ref.modules():  # the reference: the fused LoRA layers and MLPs, transformers' own norms
        if _is_rms_norm(m):
            m.forward = type(m).forward.__get__(m)
    fuse_lora(fused)
    norms = [m for m in fused.modules() if getattr(m.forward, "__func__", None) is _rms_norm_forward]
    assert len(norms) == 2 * 2 + 1  # two per decoder layer and the final one
    loss_ref, grads_ref = _loss_and_grads(ref, _batch(), bf16=frozen16)
    loss, grads = _loss_and_grads(fused, _batch(), bf16=frozen16)
    assert loss == loss_ref and grads.keys() == grads_ref.keys()
    assert max(_rel(grads[k], grads_ref[k]) for k in grads) < 1e-5
    assert _is_rms_norm(Qwen3RMSNorm(8))
    assert not _is_rms_norm(GemmaRMSNorm(8))  # (1 + weight), in fp32: another computation


@pytest.mark.parametrize("tokens,width", [(1388, 576), (700, 1536), (37, 96), (5, 3)])
def test_the_cpus_row_major_adapter_products_give_the_same_bits_as_the_plain_ones(tokens, width):
    # B's gradient as (u^T @ grad)^T and the forward's u @ B^T over a row-major copy: faster on a CPU, the same sums
    # (equal to the bit on the Xeon this was measured on; the order of a matmul's sums is its library's, so the test
    # allows fp32 rounding).
    from surefit.training.speedups.lora_fast import _reduce, _row_major_t

    g = torch.Generator().manual_seed(tokens)
    grad = torch.randn(2, tokens, width, generator=g)
    u = torch.randn(2, tokens, 16, generator=g).bfloat16()
    b = torch.randn(width, 16, generator=g)
    plain = grad.reshape(-1, width).t() @ u.reshape(-1, 16).float()
    torch.testing.assert_close(_reduce(grad, u), plain, rtol=1e-5, atol=5e-4)
    bh = _row_major_t(b, torch.bfloat16)
    assert torch.equal(bh, b.bfloat16()) and bh.t().is_contiguous()
    torch.testing.assert_close(u @ bh.t(), u @ b.bfloat16().t(), rtol=0.008, atol=1e-6)  # one bf16 rounding


@pytest.mark.parametrize("masked", [True, False])
def test_the_gated_mlps_backward_in_row_chunks_is_the_whole_tensors_and_fp32_autograds(monkeypatch, masked):
    # _SwiGLUDown's backward runs its elementwise work on row chunks (in cache on a CPU): the chunks change nothing,
    # (rows of 64: whole vectors, so no chunk ends in the kernels' scalar tail, whose exp may differ in the last bit),
    # and the gradients are fp32 autograd's of h = silu(gate) * up, with dL/dh's adapter path masked before the sum.
    import surefit.training.speedups.lora_fast as lf

    g = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(2, 7, 64, generator=g).bfloat16() for _ in range(2))
    gw, gx = (torch.randn(2, 7, 64, generator=g).bfloat16() for _ in range(2))
    kf = (torch.rand(2, 7, 64, generator=g) > 0.3).to(torch.bfloat16) if masked else None

    def run(chunk, paths=(gw, gx), want_h=True):
        monkeypatch.setattr(lf, "CPU_CHUNK_ELEMENTS", chunk)
        return lf._swiglu_backward(gate, up, kf, paths, torch.bfloat16, (want_h, torch.float32, torch.float32))

    whole = run(1 << 20)
    for chunk in (64 * 3, 64 * 5 + 7, 1):  # 3 rows (a remainder of 2), 5 rows, one row at a time
        assert all(torch.equal(a, b) for a, b in zip(run(chunk), whole, strict=True))
    hd, grad_gate, grad_up = whole
    assert hd.dtype == grad_gate.dtype == grad_up.dtype == torch.float32 and hd.shape == gate.shape
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    dh = gw.double() + (gx.double() if kf is None else gx.double() * kf.double())
    (F.silu(g64) * u64).backward(dh)
    torch.testing.assert_close(grad_gate.double(), g64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_up.double(), u64.grad, rtol=1e-5, atol=1e-5)
    h = (F.silu(gate.float()) * up.float()).bfloat16()
    assert torch.equal(hd, (h if kf is None else h * kf).float())  # h as the forward rounds it, then dropped
    only_h = run(64 * 3, paths=None)
    assert torch.equal(only_h[0], hd) and only_h[1:] == (None, None)
    assert run(64 * 3, want_h=False)[0] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpus_rms_norm_in_row_chunks_is_transformers_forward_and_fp64_autograds_backward(monkeypatch, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    import surefit.training.speedups.lora_fast as lf

    g = torch.Generator().manual_seed(9)
    norm = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    x0 = (torch.randn(3, 7, 64, generator=g) * 3).to(dtype)
    dy = torch.randn(3, 7, 64, generator=g)
    ref = norm(x0.clone().requires_grad_())  # transformers' own forward
    for chunk in (1 << 20, 64 * 4, 1):  # one chunk, 4 rows (a remainder of 1), one row at a time
        monkeypatch.setattr(lf, "CPU_CHUNK_ELEMENTS", chunk)
        x = x0.clone().requires_grad_()
        norm.weight.grad = None
        y = lf._rms_norm_forward(norm, x)
        assert y.dtype == ref.dtype and torch.equal(y, ref)
        y.backward(dy)
        x64, w64 = x0.double().requires_grad_(), norm.weight.detach().double().requires_grad_()
        n64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
        # the forward rounds the normed input to the input's dtype: its gradient passes straight through
        y64 = w64 * (n64 + (n64.to(dtype).double() - n64).detach())
        y64.backward(dy.double())
        assert x.grad.dtype == dtype and norm.weight.grad.dtype == torch.float32
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(x.grad.double(), x64.grad.to(dtype).double(), rtol=tol, atol=tol)
        torch.testing.assert_close(norm.weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_the_gated_mlps_gate_and_up_come_back_in_bf16_from_the_store_and_whole_elsewhere(monkeypatch):
    # Under SavedActivationsIn the backward reads gate and up in bf16 (turned into fp32 chunk by chunk); without the
    # store they are kept in fp32; gradient checkpointing's own hooks recompute them. The gradients are the same
    # as when the store gave them back in fp32 (the same bf16 values), and checkpointing changes nothing.
    import torch.utils.checkpoint as ckpt

    import surefit.training.speedups.lora_fast as lf

    model = _peft(tiny_llama(), dropout=0.0)
    fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    batch = _batch()
    monkeypatch.setattr(lf.SavedActivationsIn, "MIN_NUMEL", 1)  # the tiny model's tensors are stored in bf16 too
    monkeypatch.setattr(lf, "GATE_UP_16", False)  # fp32 gate and up (a GPU's): what the store rounds to bf16
    seen, real, read_low_real = [], lf._swiglu_backward, lf._read_low
    monkeypatch.setattr(lf, "_swiglu_backward", lambda gate, up, *a: seen.append((gate.dtype, up.dtype)) or
                        real(gate, up, *a))

    def run(store=None, checkpoint=False, read_low=True):
        seen.clear()
        model.zero_grad(set_to_none=True)
        monkeypatch.setattr(lf, "_read_low", read_low_real if read_low else (lambda t: t))
        layers = model.base_model.model.model.layers
        originals = [layer.forward for layer in layers]
        if checkpoint:
            for layer, f in zip(layers, originals, strict=True):
                layer.forward = lambda *a, _f=f, **k: ckpt.checkpoint(_f, *a, use_reentrant=False, **k)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16), store or contextlib.nullcontext():
                loss, n = causal_lm_loss_sum(model, batch)
            (loss / n).backward()
        finally:
            for layer, f in zip(layers, originals, strict=True):
                layer.forward = f
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    g_store = run(lf.SavedActivationsIn())
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 2
    g_fp32_back = run(lf.SavedActivationsIn(), read_low=False)  # the store turned them back into fp32 whole
    assert seen == [(torch.float32, torch.float32)] * 2
    assert all(torch.equal(g_store[k], g_fp32_back[k]) for k in g_store)
    run()
    assert seen == [(torch.float32, torch.float32)] * 2  # no store: fp32 as the forward made them
    g_ckpt = run(lf.SavedActivationsIn(), checkpoint=True)
    assert seen == [(torch.float32, torch.float32)] * 2  # recomputed under checkpointing's hooks
    # apart by bf16 rounding of gate and up only: under 2% on an AMX Xeon, 2.5% on an AVX2 EPYC
    assert g_ckpt.keys() == g_store.keys() and max(_rel(g_ckpt[k], g_store[k]) for k in g_store) < 0.04


def _attention_calls(monkeypatch):
    """Every scaled_dot_product_attention call: its output's dtype, whether autocast was on around it, and how far its
    output is from the same attention of the same inputs in fp64."""
    calls = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        out = original(q, k, v, attn_mask=attn_mask, **kw)
        with torch.autocast("cpu", enabled=False):
            mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.double()
            ref = original(q.double(), k.double(), v.double(), attn_mask=mask, **kw)
        calls.append((out.dtype, torch.is_autocast_enabled("cpu"), _rel(out.double(), ref)))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("left_padded", [False, True])
def test_training_attention_on_a_cpu_takes_the_fused_layers_fp32_outputs_and_is_exact(monkeypatch, left_padded):
    """Under bf16 autocast with 16-bit frozen weights, training's attention computes on the fp32 q/k/v the fused layers
    return (autocast off inside it): its output within fp32 rounding of fp64's, where autocast's bf16 copies are a
    thousand times further. Evaluation (no gradient) and models fuse_lora did not touch keep autocast's bf16."""
    import surefit.training.speedups.lora_fast as lf

    model = _peft(tiny_llama())
    plain = copy.deepcopy(model)
    fuse_lora(model)
    for m in (model, plain):
        store_frozen_in(m, torch.bfloat16)
        m.train()
    batch = _batch()
    if left_padded:  # a mask reaches the attention
        kwargs = {"input_ids": torch.cat([torch.zeros(3, 2, dtype=torch.long), batch["input_ids"]], 1),
                  "attention_mask": torch.cat([torch.zeros(3, 2, dtype=torch.long), torch.ones_like(batch["input_ids"])], 1)}
    else:
        kwargs = {"input_ids": batch["input_ids"]}

    def attention(m, grad=True):
        calls = _attention_calls(monkeypatch)
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(**kwargs).logits.float().sum()
        if grad:
            out.backward()
        monkeypatch.undo()
        return calls

    trained = attention(model)
    assert len(trained) == 2 and all(dt == torch.float32 and not on for dt, on, _ in trained)
    assert max(err for *_, err in trained) < 1e-6
    monkeypatch.setattr(lf, "FP32_ATTENTION_ON_CPU", False)
    old = attention(model)  # the switch off: autocast's bf16 copies, as before
    assert all(dt == torch.bfloat16 and on for dt, on, _ in old) and min(err for *_, err in old) > 1e-4
    assert all(dt == torch.bfloat16 and on for dt, on, _ in attention(model, grad=False))
    assert all(dt == torch.bfloat16 and on for dt, on, _ in attention(plain))


def _fp32_and_bf16_steps(monkeypatch, switch):
    """Loss and gradients of one training step of a tiny fused LoRA model: in fp32, then with 16-bit frozen weights
    under bf16 autocast with the ``lora_fast`` switch as it is and with it off (the same batch each time)."""
    import surefit.training.speedups.lora_fast as lf

    ref = _peft(tiny_llama())
    fuse_lora(ref)
    mixed = copy.deepcopy(ref)
    store_frozen_in(mixed, torch.bfloat16)
    batch = _batch(n=4)
    on = _loss_and_grads(mixed, batch, bf16=True)
    monkeypatch.setattr(lf, switch, False)
    return _loss_and_grads(ref, batch), on, _loss_and_grads(mixed, batch, bf16=True)


def test_fp32_attention_in_training_keeps_the_loss_and_gradients_of_the_bf16_path_close_to_fp32s(monkeypatch):
    """The change in numbers, bounded: the bf16 training step with fp32 attention against the fp32 step is at least as
    close as with bf16 attention (loss and every gradient), and both stay within the mixed path's documented bound."""
    (loss_ref, g_ref), (loss32, g32), (loss16, g16) = _fp32_and_bf16_steps(monkeypatch, "FP32_ATTENTION_ON_CPU")
    assert loss32 != loss16
    assert abs(loss32 - loss_ref) <= abs(loss16 - loss_ref) * 1.05
    worst32, worst16 = (max(_rel(g[k], g_ref[k]) for k in g_ref) for g in (g32, g16))
    assert worst32 < 0.08 and worst16 < 0.08 and worst32 <= worst16 * 1.05


def test_fp32_attention_keeps_what_bf16_attention_kept_for_the_backward_pass(monkeypatch):
    """Under the bf16 store, fp32 attention's output is packed into bf16 by the store and read by o_proj through a
    transposed view: o_proj takes a view of that copy instead of making a second one. The bytes kept for the backward
    pass are bf16 attention's, and the loss and gradients are those of o_proj making its own copy, bit for bit."""
    import surefit.training.speedups.lora_fast as lf
    from surefit.training.plan import measure_saved_bytes

    model = _peft(tiny_llama(), dropout=0.1)
    fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (4, 80), generator=g)  # long enough for the attention's tensors to be packed
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(ids < 20, -100)}

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return causal_lm_loss_sum(model, batch)[0]

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16), lf.SavedActivationsIn():
            loss, n = causal_lm_loss_sum(model, batch)
        (loss / n).backward()
        return (loss / n).item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    views = []
    original = lf._packed_view
    monkeypatch.setattr(lf, "_packed_view", lambda x, d: views.append(original(x, d)) or views[-1])
    model.train()
    fp32_bytes = measure_saved_bytes(model, forward, lf.SavedActivationsIn())
    assert sum(v is not None for v in views) == 2  # o_proj of each block read the packed copy
    loss, grads = step()
    monkeypatch.setattr(lf, "_packed_view", lambda x, d: None)
    twice_bytes = measure_saved_bytes(model, forward, lf.SavedActivationsIn())
    loss_twice, g_twice = step()
    monkeypatch.setattr(lf, "FP32_ATTENTION_ON_CPU", False)
    bf16_bytes = measure_saved_bytes(model, forward, lf.SavedActivationsIn())
    assert fp32_bytes == bf16_bytes < twice_bytes
    assert loss == loss_twice and grads.keys() == g_twice.keys()
    assert all(torch.equal(grads[k], g_twice[k]) for k in grads)


def test_gate_and_up_come_16_bit_to_the_mlp_in_training_on_a_cpu_and_keep_a_young_adapter():
    """In training, gate_proj and up_proj hand the fused MLP 16-bit outputs from one matmul over [x | u] and [W | B]:
    the adapter's term, far below half a bf16 step, survives the single rounding on average (its regression on the
    exact term is 1), where adding it to the rounded frozen product would drop it (0). Evaluation keeps fp32 sums."""
    import surefit.training.speedups.lora_fast as lf

    model = _peft(tiny_llama(), dropout=0.0)
    fuse_lora(model)
    store_frozen_in(model, torch.bfloat16)
    mlp = model.base_model.model.model.layers[0].mlp
    torch.manual_seed(3)
    for proj in (mlp.gate_proj, mlp.up_proj):
        nn.init.normal_(proj.lora_B["default"].weight, std=1e-5)  # a young adapter
    x = torch.randn(8, 400, 32, requires_grad=True)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gate, up = lf._gate_up(mlp, x)
        with torch.no_grad():
            gate_eval, _ = lf._gate_up(mlp, x)
    assert gate.dtype == up.dtype == torch.bfloat16 and gate_eval.dtype == torch.float32
    for proj, out in ((mlp.gate_proj, gate), (mlp.up_proj, up)):
        xh = x.detach().bfloat16().double()
        frozen = xh @ proj.base_layer.weight.double().t()
        a, b = proj.lora_A["default"].weight.double(), proj.lora_B["default"].weight.double()
        term = (xh @ a.t()) @ b.t() * proj.scaling["default"]
        assert term.abs().mean() < 0.2 * 2**-9 * frozen.abs().mean()  # a fifth of half a bf16 step, typically
        kept = ((out.double() - frozen) * term).sum() / (term * term).sum()
        dropped = ((frozen.bfloat16().double() - frozen) * term).sum() / (term * term).sum()
        assert abs(kept.item() - 1) < 0.1 and abs(dropped.item()) < 0.1
    (gate.float().sum() + up.float().sum()).backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_16_bit_gate_and_up_keep_the_bf16_steps_loss_and_gradients_as_close_to_fp32s(monkeypatch):
    """The change in numbers, bounded: with 16-bit gate and up the bf16 training step stays within the mixed path's
    documented bound of the fp32 step (loss and every gradient), as with fp32 sums."""
    (loss_ref, g_ref), (loss16, g16), (loss32, g32) = _fp32_and_bf16_steps(monkeypatch, "GATE_UP_16")
    assert loss16 != loss32
    assert loss16 == pytest.approx(loss_ref, rel=2e-3) and loss32 == pytest.approx(loss_ref, rel=2e-3)
    worst16, worst32 = (max(_rel(g[k], g_ref[k]) for k in g_ref) for g in (g16, g32))
    assert worst16 < 0.08 and worst32 < 0.08
