"""Preference losses against direct computations, the LoRA reference (adapters off), the step-0 loss, and the loop's
token accounting for pairs: per pair over the whole accumulated step, an out-of-memory split keeping pairs whole."""

import copy
import math

import pytest
import torch

from conftest import OneProcess, tiny_llama
from surefit.data.pairs import PairCollator
from surefit.training.loop import StepPlan, accumulate_step
from surefit.training.memory import OOMGuard
from surefit.training.preference import PairLogps, PreferenceLoss, adapters_off, pair_losses, sequence_logps
from surefit.training.work import TrainingWork

# Hand-made log-probabilities of 3 pairs: policy chosen / rejected, reference chosen / rejected, answer lengths.
C, R = torch.tensor([-4.0, -10.0, -2.5]), torch.tensor([-6.0, -9.0, -7.5])
RC, RR = torch.tensor([-5.0, -9.5, -3.0]), torch.tensor([-5.5, -9.5, -6.0])
NC, NR = torch.tensor([4.0, 5.0, 2.0]), torch.tensor([3.0, 6.0, 5.0])


def _sig(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("kind", ["sigmoid", "hinge", "ipo", "simpo", "orpo"])
def test_each_loss_equals_its_formula_on_hand_made_log_probabilities(kind):
    beta, gamma, lam = 0.3, 0.7, 0.2
    losses, cr, rr = pair_losses(kind, PairLogps(C, R, RC, RR, NC, NR), beta=beta, gamma=gamma, orpo_lambda=lam)
    for i in range(3):
        c, r, rc, rref, nc, nr = (float(t[i]) for t in (C, R, RC, RR, NC, NR))
        delta = (c - rc) - (r - rref)
        if kind == "sigmoid":
            want, rewards = -math.log(_sig(beta * delta)), (beta * (c - rc), beta * (r - rref))
        elif kind == "hinge":
            want, rewards = max(0.0, 1 - beta * delta), (beta * (c - rc), beta * (r - rref))
        elif kind == "ipo":
            want, rewards = ((c - rc) / nc - (r - rref) / nr - 1 / (2 * beta)) ** 2, (beta * (c - rc), beta * (r - rref))
        elif kind == "simpo":
            want, rewards = -math.log(_sig(beta * (c / nc - r / nr) - gamma)), (beta * c / nc, beta * r / nr)
        else:
            pc, pr = c / nc, r / nr
            log_odds = (pc - math.log(1 - math.exp(pc))) - (pr - math.log(1 - math.exp(pr)))
            want, rewards = -pc - lam * math.log(_sig(log_odds)), (lam * pc, lam * pr)
        assert float(losses[i]) == pytest.approx(want, rel=1e-5, abs=1e-6), (kind, i)
        assert (float(cr[i]), float(rr[i])) == pytest.approx(rewards, rel=1e-5)


def _pairs(n=8, seed=0):
    """Pairs with a shared prompt and answers of very different lengths (tokens of the tiny Llama's vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 60, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(3, 60, (1 + i % 5,), generator=g).tolist() + [0]
        r = torch.randint(3, 60, (1 + (i * 3) % 7,), generator=g).tolist() + [0]
        out.append({"chosen_ids": prompt + c, "chosen_labels": [-100] * len(prompt) + c,
                    "rejected_ids": prompt + r, "rejected_labels": [-100] * len(prompt) + r})
    return out


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def test_sequence_logps_are_the_sums_over_each_rows_supervised_tokens():
    model = tiny_llama()
    batch = PairCollator(pad_token_id=0)(_pairs(3))
    sums, counts = sequence_logps(model, batch)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=batch["input_ids"]).logits.float(), -1)
    for row in range(6):
        labels = batch["labels"][row]
        want = sum(float(logp[row, t - 1, labels[t]]) for t in range(1, labels.shape[0]) if labels[t] != -100)
        assert float(sums[row]) == pytest.approx(want, abs=1e-4)
        assert int(counts[row]) == int((labels[1:] != -100).sum())


def test_step0_loss_is_ln2_with_the_adapters_off_reference_and_moves_once_the_adapter_does():
    model = _lora(tiny_llama())
    loss_fn = PreferenceLoss("sigmoid", 0.1, "adapters_off")
    batch = PairCollator(pad_token_id=0)(_pairs(4))
    total, n = loss_fn(model, batch)
    assert n == 4 and float(total) / n == pytest.approx(math.log(2), abs=1e-6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)
    total, _ = loss_fn(model, batch)
    assert abs(float(total) / 4 - math.log(2)) > 1e-3
    # the reference really is the base model: its log-probabilities did not move with the adapter
    with torch.no_grad(), adapters_off(model):
        base, _ = sequence_logps(model, batch)
    assert torch.allclose(base, sequence_logps(tiny_llama(), batch)[0], atol=1e-5)


def _grads(model, feats, micro, loss_fn, guard=None):
    model = copy.deepcopy(model)
    lengths = [len(f["chosen_ids"]) + len(f["rejected_ids"]) for f in feats]
    work = TrainingWork(features=feats, lengths=lengths, counts=[1] * len(feats), collate=PairCollator(pad_token_id=0),
                        loss_fn=loss_fn)
    loss = accumulate_step(model, work, list(range(len(feats))), OneProcess(),
                           StepPlan(micro_batch_size=micro, guard=guard, say=lambda s: None))
    return loss / len(feats), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo"])
def test_batch_8_accum_1_equals_batch_1_accum_8_and_an_oom_split_gives_the_same_update(kind):
    model = _lora(tiny_llama())
    with torch.no_grad():  # a non-zero adapter: the policy differs from the reference
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    loss_fn = PreferenceLoss(kind, 0.5, "none" if kind == "simpo" else "adapters_off")
    feats = _pairs(8)
    loss8, g8 = _grads(model, feats, 8, loss_fn)
    loss1, g1 = _grads(model, feats, 1, loss_fn)
    guard = OOMGuard(inject={1})  # a real torch.OutOfMemoryError in the first micro-batch: split and redone
    loss_oom, g_oom = _grads(model, feats, 8, loss_fn, guard)
    assert guard.splits == 1
    assert loss8 == pytest.approx(loss1, abs=1e-5) and loss8 == pytest.approx(loss_oom, abs=1e-5)
    assert g8.keys() == g1.keys() == g_oom.keys() and g8
    for name in g8:
        assert torch.allclose(g8[name], g1[name], atol=1e-6, rtol=1e-4), name
        assert torch.allclose(g8[name], g_oom[name], atol=1e-6, rtol=1e-4), name


def test_averaging_per_micro_batch_would_break_it():
    """Negative control: a per-sequence mean over the micro-batch's 2 x pairs rows (a common mistake) changes the
    gradient of the same step split differently; the per-pair sum does not."""
    model = _lora(tiny_llama())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    inner = PreferenceLoss("ipo", 0.5, "adapters_off")
    wrong = lambda m, b: (inner(m, b)[0] / (b["input_ids"].shape[0] // 2), 1)  # noqa: E731
    feats = _pairs(8)
    _, g8 = _grads(model, feats, 8, wrong)
    _, g1 = _grads(model, feats, 3, wrong)
    assert any(not torch.allclose(g8[n], g1[n], atol=1e-6, rtol=1e-4) for n in g8)


def test_under_bf16_the_reference_uses_the_policys_arithmetic_so_step0_is_exactly_ln2():
    """With 16-bit frozen weights and surefit's fused LoRA forward (fp32 sums), peft's disabled-adapter path rounds
    each layer's output to bf16: a reference computed that way differs from the zero-adapter policy by ~1e-3 per
    token. The reference keeps the fused forward with the adapter scaled to 0 instead."""
    from surefit.training.speedups.lora_fast import fuse_lora

    model = tiny_llama().to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = p.data.float()
    model = _lora(model)
    fuse_lora(model)
    batch = PairCollator(pad_token_id=0)(_pairs(4))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        total, n = PreferenceLoss("sigmoid", 0.1, "adapters_off")(model, batch)
        policy, _ = sequence_logps(model, batch)
        with model.disable_adapter():  # peft's own path: not the same numbers
            peft_off, _ = sequence_logps(model, batch)
        with adapters_off(model):
            ours, _ = sequence_logps(model, batch)
    assert float(total) / n == math.log(2) or abs(float(total) / n - math.log(2)) < 1e-7
    assert torch.equal(policy, ours) and not torch.equal(policy, peft_off)
    assert all(float(v) == 2.0 for m in model.modules() if hasattr(m, "lora_A") for v in m.scaling.values())


def test_doctor_step0_check_allows_16_bit_rounding_but_not_another_reference():
    from surefit.doctor.checks_dpo import step0_finding
    from surefit.training.preference import PairScores

    batch = PairCollator(pad_token_id=0)(_pairs(2))  # answers of 2 and 3 (chosen), 2 and 5 (rejected) tokens

    def scores(shift):
        c, r = torch.tensor([-10.0, -12.0]), torch.tensor([-11.0, -9.0])
        losses, cr, rr = pair_losses("sigmoid", PairLogps(c + shift, r, c, r, torch.ones(2), torch.ones(2)), beta=0.1)
        return PairScores(c + shift, r, c, r, losses, cr, rr)

    assert step0_finding(scores(0.0), batch, fp32=True) is None
    assert step0_finding(scores(0.01), batch, fp32=False) is None  # rounding-sized
    found = step0_finding(scores(0.01), batch, fp32=True)
    assert found.code == "dpo-step0-loss" and "not ln 2" in found.message
    found = step0_finding(scores(2.0), batch, fp32=False)
    assert found is not None and "nats per token (16-bit rounding alone stays under 0.02)" in found.message
