"""The fused LM head + cross-entropy (training/speedups/fused_head.py, handed to training/loss.py): the same loss and
gradients as the unfused head, with no full logits tensor; taken by default in a run, off with the switch, and refused
(falling back) where it would compute something else."""

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import pick_free_port, tiny_llama
from surefit.data.collate import IGNORE_INDEX, PadCollator
from surefit.training.loss import HEAD_PATHS, causal_lm_loss_sum
from surefit.training.speedups import fused_head as head_mod
from surefit.training.speedups.fused_head import fused_linear_cross_entropy, why_not_fused

N, H, V = 29, 16, 50  # 29 rows: a prime, so no chunk size above 1 divides it


def _inputs(dtype=torch.float32, bias=True, ignored=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[list(ignored)] = IGNORE_INDEX
    return hidden, weight, b, targets


def _reference(hidden, weight, bias, targets, softcap=None):
    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _grads(loss, *tensors, scale=0.37):
    return torch.autograd.grad(loss * scale, [t for t in tensors if t is not None])  # a non-unit incoming gradient


def _close(a, b, rtol):
    """Equal to ``rtol`` relative to the larger tensor's largest value (elementwise rtol fails on values near 0)."""
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    return float((a.float() - b.float()).abs().max()) <= rtol * scale


@pytest.mark.parametrize("chunk", [1, 4, 7, 16, 29, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ignored", [(), (0, 5, 6, 28)])
def test_fused_loss_and_gradients_equal_unfused_fp32(chunk, bias, ignored, monkeypatch):
    """Chunks of 1 to more than all rows (4, 7, 16 do not divide 29), ignored targets, with and without bias: loss and
    gradients w.r.t. the hidden states, the weight and the bias equal the unfused ones to ~1e-6 relative."""
    monkeypatch.setattr(head_mod, "MIN_CHUNK_TOKENS", 1)
    hidden, weight, b, targets = _inputs(bias=bias, ignored=ignored)
    ref = _reference(hidden, weight, b, targets)
    fused = fused_linear_cross_entropy(hidden, weight, b, targets, chunk_values=chunk * V)
    assert torch.allclose(fused, ref, rtol=1e-6, atol=0)
    got = _grads(fused, hidden, weight, b)
    for g, want in zip(got, _grads(ref, hidden, weight, b), strict=True):
        assert _close(g, want, 1e-6)
    if ignored:
        assert (got[0][list(ignored)] == 0).all()  # an ignored row gets no gradient


def test_fused_chunks_really_bound_the_logits(monkeypatch):
    """No matmul in the forward or the backward produces more than one chunk of logits."""
    monkeypatch.setattr(head_mod, "MIN_CHUNK_TOKENS", 1)
    hidden, weight, b, targets = _inputs()
    shapes = []
    real = head_mod.F.linear
    monkeypatch.setattr(head_mod.F, "linear", lambda *a: shapes.append(tuple(real(*a).shape)) or real(*a))
    fused = fused_linear_cross_entropy(hidden, weight, b, targets, chunk_values=6 * V)
    fused.backward()
    assert shapes and max(s[0] for s in shapes) == 6 and len(shapes) == -(-N // 6)


def test_frozen_head_gets_no_gradient_and_the_hidden_states_the_same_one():
    hidden, weight, b, targets = _inputs()
    weight.requires_grad_(False)
    b.requires_grad_(False)
    fused = fused_linear_cross_entropy(hidden, weight, b, targets, chunk_values=5 * V)
    (gh,) = _grads(fused, hidden)
    (want,) = _grads(_reference(hidden, weight, b, targets), hidden)
    assert _close(gh, want, 1e-6)
    fused2 = fused_linear_cross_entropy(hidden, weight, b, targets, chunk_values=5 * V)
    fused2.backward()
    assert weight.grad is None and b.grad is None


def test_fused_soft_capping_equals_the_capped_reference(monkeypatch):
    monkeypatch.setattr(head_mod, "MIN_CHUNK_TOKENS", 1)
    hidden, weight, b, targets = _inputs(ignored=(3,))
    ref = _reference(hidden * 4, weight, b, targets, softcap=5.0)  # large logits: the cap matters
    fused = fused_linear_cross_entropy(hidden * 4, weight, b, targets, chunk_values=7 * V, softcap=5.0)
    assert torch.allclose(fused, ref, rtol=1e-6, atol=0)
    assert not torch.allclose(fused, _reference(hidden * 4, weight, b, targets), rtol=1e-3)  # the cap is applied
    for got, want in zip(_grads(fused, hidden, weight, b), _grads(ref, hidden, weight, b), strict=True):
        assert _close(got, want, 1e-6)


@pytest.mark.parametrize("chunk", [29, 7])
def test_fused_under_bf16_autocast_matches_the_unfused_head(chunk, monkeypatch):
    """Under bf16 autocast both paths round the same things: the matmul inputs and the logits to bf16, the
    softmax's gradient to bf16 before the matmuls. Two places differ, each by one bf16 rounding (2^-9 relative, less
    than the bf16 head's own error against fp32, which the last assert shows is larger): the fused head computes its
    gradients in the forward pass, so it rounds the softmax's gradient before the incoming gradient scales it, not
    after; and over several chunks grad_weight sums per-chunk bf16 products where the unfused head rounds one. So the
    gradients are compared at 1e-2 of their largest value, and exactly (1e-6) in one chunk with a unit incoming
    gradient; the loss (fp32 from the same bf16 logits) at 1e-5."""
    monkeypatch.setattr(head_mod, "MIN_CHUNK_TOKENS", 1)
    hidden, weight, b, targets = _inputs(bias=False, ignored=(2,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _reference(hidden, weight, None, targets)
        fused = fused_linear_cross_entropy(hidden, weight, None, targets, chunk_values=chunk * V)
    assert torch.allclose(fused, ref, rtol=1e-5, atol=0)
    gh, gw = _grads(fused, hidden, weight)
    rh, rw = _grads(ref, hidden, weight)
    assert gh.dtype == rh.dtype == torch.float32 and gw.dtype == rw.dtype == torch.float32
    assert _close(gh, rh, 1e-2) and _close(gw, rw, 1e-2)
    if chunk == N:  # with a unit incoming gradient, the same roundings at the same places
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = _reference(hidden, weight, None, targets)
            fused = fused_linear_cross_entropy(hidden, weight, None, targets, chunk_values=chunk * V)
        gh, gw = _grads(fused, hidden, weight, scale=1.0)
        rh, rw = _grads(ref, hidden, weight, scale=1.0)
        assert _close(gh, rh, 1e-6) and _close(gw, rw, 1e-6)
    # Against fp32 the bf16 head is visibly different: the comparison above is not a trivial one.
    assert not _close(gh, _grads(_reference(hidden, weight, None, targets), hidden)[0], 1e-4)


# ----------------------------------------------------------------------------------------------- through a model


def _batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    feats = []
    for i in range(n):
        prompt = int(torch.randint(2, 8, (1,), generator=g))
        target = 5 + 3 * i  # mostly supervised rows, as chat data
        ids = torch.randint(3, 60, (prompt + target,), generator=g).tolist() + [0]
        feats.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return PadCollator(pad_token_id=0)(feats)


def _loss_and_grads(model, batch, **kw):
    loss, n = causal_lm_loss_sum(model, batch, **kw)
    (loss / n).backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _llama(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_tokens", [8, 13, 1000])
def test_full_fine_tuning_fused_equals_unfused(tied, chunk_tokens):
    """Every parameter's gradient (the head's, tied to the embeddings or not, included) is the unfused one's."""
    model = _llama(tied)
    batch = _batch()
    before = HEAD_PATHS["fused"]
    lf, gf = _loss_and_grads(copy.deepcopy(model), batch, fused=head_mod, fused_chunk_values=64 * chunk_tokens)
    assert HEAD_PATHS["fused"] == before + 1
    lu, gu = _loss_and_grads(copy.deepcopy(model), batch, fused=None)
    assert torch.allclose(lf, lu, rtol=1e-6, atol=0)
    assert gf.keys() == gu.keys() and any("lm_head" in k or "embed" in k for k in gf)
    for k in gf:
        assert _close(gf[k], gu[k], 1e-5), k


def test_lora_fused_equals_unfused_and_the_head_stays_frozen():
    from peft import LoraConfig, get_peft_model

    from surefit.training.speedups.lora_fast import fuse_lora

    batch = _batch(seed=1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    model = get_peft_model(tiny_llama(), lora)
    fuse_lora(model)
    assert why_not_fused(model) is None
    lf, gf = _loss_and_grads(copy.deepcopy(model), batch, fused=head_mod, fused_chunk_values=64 * 9)
    lu, gu = _loss_and_grads(copy.deepcopy(model), batch, fused=None)
    assert torch.allclose(lf, lu, rtol=1e-6, atol=0)
    assert gf.keys() == gu.keys() and gf and all("lora_" in k for k in gf)
    for k in gf:
        assert _close(gf[k], gu[k], 1e-5), k


def test_gemma2_soft_capped_logits_are_fused_with_the_cap():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=0, final_logit_softcapping=0.5,
                       attn_implementation="eager")
    model = Gemma2ForCausalLM(cfg)
    batch = _batch()
    assert why_not_fused(model) is None
    before = HEAD_PATHS["fused"]
    lf, gf = _loss_and_grads(copy.deepcopy(model), batch, fused=head_mod, fused_chunk_values=64 * 8)
    assert HEAD_PATHS["fused"] == before + 1 and why_not_fused(model) is None
    lu, gu = _loss_and_grads(copy.deepcopy(model), batch, fused=None)
    hf = model(**batch).loss * int((batch["labels"][:, 1:] != -100).sum())
    assert torch.allclose(lf, lu, rtol=1e-6, atol=0) and torch.allclose(lf, hf, rtol=1e-5)
    for k in gf:
        assert _close(gf[k], gu[k], 1e-5), k


def test_a_lora_wrapped_head_and_scaled_logits_take_the_unfused_path():
    from peft import LoraConfig, get_peft_model
    from transformers import CohereConfig, CohereForCausalLM

    wrapped = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert "not a plain Linear" in why_not_fused(wrapped)
    cfg = CohereConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, pad_token_id=0, eos_token_id=0, logit_scale=0.25)
    cohere = CohereForCausalLM(cfg)
    assert "logit_scale=0.25" in why_not_fused(cohere)
    batch = _batch()
    before = dict(HEAD_PATHS)
    loss, n = causal_lm_loss_sum(cohere, batch, fused=head_mod)
    assert HEAD_PATHS["fused"] == before.get("fused", 0) and HEAD_PATHS["unfused"] == before.get("unfused", 0) + 1
    assert torch.allclose(loss / n, cohere(**batch).loss, rtol=1e-5)


def test_an_unknown_transform_of_the_logits_is_found_and_falls_back():
    """A model whose forward changes the logits after the head in a way the fused head does not know: its first batch
    shows it, the loss of that batch is still the model's own, and the model is unfused from then on."""
    from transformers import LlamaForCausalLM

    class Doubled(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, logits_to_keep=0, **kw):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep,
                                  **kw)
            out.logits = out.logits * 2
            return out

    model = Doubled(tiny_llama().config)
    batch = _batch()
    assert why_not_fused(model) is None
    with pytest.warns(UserWarning, match="fused LM head"):
        loss, n = causal_lm_loss_sum(model, batch, fused=head_mod)
    assert "differs from the head's output" in why_not_fused(model)
    logits = model(**batch).logits[:, :-1].float()
    want = F.cross_entropy(logits.reshape(-1, 64), batch["labels"][:, 1:].reshape(-1), reduction="sum")
    assert torch.allclose(loss, want, rtol=1e-5)


def test_eval_without_gradients_keeps_nothing_for_a_backward_pass(monkeypatch):
    """Under no_grad (the evaluation loss) no gradient matmul runs, even for a trainable head."""
    hidden, weight, b, targets = _inputs()
    matmuls = []
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda x, y: matmuls.append(1) or real(x, y))
    with torch.no_grad():
        fused = fused_linear_cross_entropy(hidden, weight, b, targets, chunk_values=7 * V)
    assert fused.grad_fn is None and not matmuls
    with torch.enable_grad():
        fused_linear_cross_entropy(hidden, weight, b, targets, chunk_values=7 * V)
    assert matmuls  # the same call with gradients does run them (the check above is not vacuous)
    assert torch.allclose(fused, _reference(hidden, weight, b, targets).detach(), rtol=1e-6)


# ---------------------------------------------------------------------------------------------------- in a run


def test_a_default_sft_run_takes_the_fused_head_and_the_switch_turns_it_off(tmp_path, tiny_lm_dir, qa_jsonl):
    import surefit

    common = dict(task="sft", model=str(tiny_lm_dir), data=str(qa_jsonl), epochs=1, lr=1e-2, lora_dropout=0.0,
                  precision="fp32", eval_generate=False)
    before = dict(HEAD_PATHS)
    on = surefit.train(output_dir=str(tmp_path / "on"), **common)
    fused_calls = HEAD_PATHS["fused"] - before.get("fused", 0)
    assert fused_calls >= on.history[-1]["step"]  # every training step (and the evaluations) ran fused
    before = dict(HEAD_PATHS)
    off = surefit.train(fused_cross_entropy=False, output_dir=str(tmp_path / "off"), **common)
    assert HEAD_PATHS["fused"] == before.get("fused", 0)  # training, the planner and the evaluations: none fused
    assert HEAD_PATHS["unfused"] > before.get("unfused", 0)
    assert off.history[-1]["train_loss"] == pytest.approx(on.history[-1]["train_loss"], abs=1e-5)
    assert off.history[-1]["eval_loss"] == pytest.approx(on.history[-1]["eval_loss"], abs=1e-5)


def _ddp_worker(rank, port, out):
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        grads = {}
        for fused in (True, False):  # both in one pair of processes: each spawn costs seconds of imports
            model = DistributedDataParallel(_llama(tied=False))
            batch = _batch(seed=rank, n=3)  # each process its own rows
            for _ in range(2):  # the reducer is used again in a second step
                model.zero_grad()
                loss, n = causal_lm_loss_sum(model, batch, fused=head_mod if fused else None,
                                             fused_chunk_values=64 * 8)
                (loss / n).backward()
            grads[fused] = {k: p.grad for k, p in model.module.named_parameters()}
        if rank == 0:
            torch.save(grads, out)
        # Both processes close the group together: one that tore gloo down while the other still held its pair
        # aborted once ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_under_ddp_the_fused_head_gives_the_unfused_gradients(tmp_path):
    """Under DDP the head runs outside the wrapped forward (full fine-tuning, untied head): its gradient is still
    all-reduced with the others, and every gradient equals the unfused run's."""
    import torch.multiprocessing as mp

    out = tmp_path / "grads.pt"
    mp.spawn(_ddp_worker, args=(pick_free_port(), str(out)), nprocs=2, join=True)
    grads = torch.load(out)
    assert grads[True].keys() == grads[False].keys() and "lm_head.weight" in grads[True]
    for k in grads[True]:
        assert _close(grads[True][k], grads[False][k], 1e-5), k


def test_with_gradients_unused_the_forward_saves_the_same_tensors_and_skips_the_gradients_math():
    """The doctor's measured dry run is never backpropagated: within ``gradients_unused`` the fused head still keeps
    (and so counts) its gradient tensors, computes the same loss, and runs only the logits' matmul: half the
    head's FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from surefit.training.plan import measure_saved_bytes

    hidden, weight, bias, targets = _inputs(ignored=(1, 4))

    def run():
        return fused_linear_cross_entropy(hidden, weight, bias, targets, chunk_values=64)

    counted = {}
    for name, ctx in (("computed", torch.enable_grad), ("unused", head_mod.gradients_unused)):
        with torch.enable_grad(), ctx(), FlopCounterMode(display=False) as flops:
            loss = run()
            counted[name] = (float(loss), flops.get_total_flops())
        with ctx():
            counted[name] += (measure_saved_bytes(torch.nn.Module(), run),)
    (loss_c, flops_c, saved_c), (loss_u, flops_u, saved_u) = counted["computed"], counted["unused"]
    assert loss_u == loss_c
    assert saved_u == saved_c == (hidden.numel() + weight.numel()) * 4 + bias.numel() * 4
    n, v, h = hidden.shape[0], weight.shape[0], weight.shape[1]
    # the logits' matmul alone; computed, grad_hidden's too (and grad_weight's, which the counter misses: addmm_)
    assert flops_u == 2 * n * v * h and flops_c >= 2 * flops_u
    assert not getattr(head_mod._UNUSED_GRADIENTS, "on", False)  # put back
