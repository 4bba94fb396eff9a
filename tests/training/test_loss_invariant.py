"""Loss normalisation: the gradient of a step must not depend on how it is split into micro-batches."""

import copy

import pytest
import torch

from conftest import OneProcess, tiny_llama
from surefit.data.collate import PadCollator
from surefit.training.loop import StepPlan, accumulate_step
from surefit.training.loss import causal_lm_loss_sum, count_supervised_tokens
from surefit.training.work import TrainingWork


def _examples(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = []
    for i in range(n):
        prompt = int(torch.randint(3, 20, (1,), generator=g))
        target = 1 + i % 5  # very different numbers of supervised tokens per example
        ids = torch.randint(3, 60, (prompt + target,), generator=g).tolist() + [0]
        feats.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return feats


@pytest.fixture()
def tiny():
    return tiny_llama()


def test_supervised_only_logits_match_the_full_hf_loss(tiny):
    feats = _examples()
    batch = PadCollator(pad_token_id=0)(feats)
    loss_sum, n = causal_lm_loss_sum(tiny, batch)
    hf = tiny(**batch).loss  # transformers: mean over shifted labels != -100
    expected = sum(sum(1 for t in f["labels"][1:] if t != -100) for f in feats)
    assert n == count_supervised_tokens(batch["labels"]) == expected
    assert torch.allclose(loss_sum / n, hf, atol=1e-5)


def _grads(model, feats, micro):
    model = copy.deepcopy(model)
    lengths = [len(f["input_ids"]) for f in feats]
    counts = [sum(1 for t in f["labels"][1:] if t != -100) for f in feats]
    work = TrainingWork(feats, lengths, counts, collate=PadCollator(pad_token_id=0), loss_fn=causal_lm_loss_sum)
    loss = accumulate_step(model, work, list(range(len(feats))), OneProcess(), StepPlan(micro))
    return loss / sum(counts), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_batch_8_accum_1_equals_batch_1_accum_8(tiny):
    feats = _examples()
    loss8, g8 = _grads(tiny, feats, micro=8)
    loss1, g1 = _grads(tiny, feats, micro=1)
    assert abs(loss8 - loss1) < 1e-5
    assert g8.keys() == g1.keys() and len(g8) > 0
    for name in g8:
        assert torch.allclose(g8[name], g1[name], atol=1e-6, rtol=1e-4), name


def test_averaging_micro_batch_means_would_break_the_invariant(tiny):
    """Negative control: the common recipe (mean per micro-batch / accumulation steps) gives another gradient here."""
    feats = _examples()
    _, reference = _grads(tiny, feats, micro=8)
    model = copy.deepcopy(tiny)
    collate = PadCollator(pad_token_id=0)
    for f in feats:
        (model(**collate([f])).loss / len(feats)).backward()
    naive = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(not torch.allclose(reference[n], naive[n], atol=1e-6, rtol=1e-4) for n in reference)


def test_supervised_only_logits_give_the_same_gradients_as_full_logits(tiny):
    """The LM head runs only where labels are supervised; the gradients must equal the full-logits loss's."""
    feats = _examples()
    batch = PadCollator(pad_token_id=0)(feats)
    full = copy.deepcopy(tiny)
    loss_sum, n = causal_lm_loss_sum(tiny, batch)
    (loss_sum / n).backward()
    full(**batch).loss.backward()  # transformers: full-vocabulary logits at every position
    grads = {k: p.grad for k, p in tiny.named_parameters()}
    for name, p in full.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_head_gives_the_same_loss_and_gradients_as_full_logits(tied):
    """Unfused, above ``chunk_values`` the head and loss run in recomputed chunks: same loss, same gradients (tied or
    not)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from surefit.training import loss as loss_mod

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    feats = _examples()
    batch = PadCollator(pad_token_id=0)(feats)
    full = copy.deepcopy(model)
    calls = []
    real = loss_mod._chunk_loss
    loss_mod._chunk_loss = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    try:
        loss_sum, n = causal_lm_loss_sum(model, batch, chunk_values=64 * 5, fused=None)  # 5 tokens per chunk
    finally:
        loss_mod._chunk_loss = real
    assert sum(calls) == n and max(calls) == 5 and len(calls) == -(-n // 5)  # really chunked
    assert isinstance(model.lm_head, torch.nn.Linear)  # the head is put back
    (loss_sum / n).backward()
    hf = full(**batch).loss
    hf.backward()
    assert torch.allclose(loss_sum / n, hf, atol=1e-5)
    grads = {k: p.grad for k, p in model.named_parameters()}
    for name, p in full.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6, rtol=1e-4), name


def test_chunked_head_through_peft_trains_only_the_adapters(tiny):
    from peft import LoraConfig, get_peft_model

    feats = _examples()
    batch = PadCollator(pad_token_id=0)(feats)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    a = get_peft_model(copy.deepcopy(tiny), lora)
    b = copy.deepcopy(a)
    la, n = causal_lm_loss_sum(a, batch, chunk_values=64 * 3)
    lb, _ = causal_lm_loss_sum(b, batch, chunk_values=10**9)  # one piece
    assert torch.allclose(la, lb, atol=1e-4)
    la.backward()
    lb.backward()
    ga = {k: p.grad for k, p in a.named_parameters() if p.grad is not None}
    gb = {k: p.grad for k, p in b.named_parameters() if p.grad is not None}
    assert ga.keys() == gb.keys() and all("lora_" in k for k in ga)
    for k in ga:
        assert torch.allclose(ga[k], gb[k], atol=1e-6, rtol=1e-4), k


def _mask_seen(model, batch):
    """The attention_mask the model's forward received from causal_lm_loss_sum."""
    seen = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    try:
        causal_lm_loss_sum(model, batch)
    finally:
        handle.remove()
    return seen[0]


def test_right_padded_batches_reach_a_causal_model_without_a_mask(tiny):
    """Padding only after each row's last token: causal attention hides it already, so the mask is dropped (SDPA then
    runs its causal kernel); the loss equals transformers' with the mask (checked by the tests above, same batch)."""
    batch = PadCollator(pad_token_id=0)(_examples())
    assert batch["attention_mask"].min() == 0  # the batch really is padded
    assert _mask_seen(tiny, batch) is None
    masked = tiny(**batch).loss
    loss_sum, n = causal_lm_loss_sum(tiny, batch)
    assert torch.allclose(loss_sum / n, masked, atol=1e-5)


def test_the_mask_is_kept_for_left_padding_and_for_attention_that_is_not_causal(tiny):
    left = PadCollator(pad_token_id=0, padding_side="left")(_examples())
    assert _mask_seen(tiny, left) is left["attention_mask"]
    right = PadCollator(pad_token_id=0)(_examples())
    bidirectional = copy.deepcopy(tiny)
    bidirectional.model.layers[1].self_attn.is_causal = False  # e.g. an encoder loaded as an LM without is_decoder
    assert _mask_seen(bidirectional, right) is right["attention_mask"]


def test_without_the_mask_a_sliding_window_still_applies():
    """Mistral-style sliding-window attention (window 4, rows up to 21 tokens): transformers builds the window from
    the positions when no mask is given, so dropping the padding mask leaves the loss as it was."""
    from transformers import MistralConfig, MistralForCausalLM

    import surefit.training.loss as loss_module

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=4))
    batch = PadCollator(pad_token_id=0)(_examples())
    assert _mask_seen(model, batch) is None
    dropped, n = causal_lm_loss_sum(model, batch)
    loss_module._causal[model] = False  # as if the model were not causal: the mask is passed on
    assert _mask_seen(model, batch) is batch["attention_mask"]
    kept, _ = causal_lm_loss_sum(model, batch)
    assert torch.allclose(dropped, kept, rtol=1e-6, atol=1e-5)
    windowed = copy.deepcopy(model)
    windowed.config.sliding_window = 10**6  # a window that never bites gives another loss: the window was applied
    loss_module._causal[windowed] = True
    assert not torch.allclose(causal_lm_loss_sum(windowed, batch)[0], dropped, atol=1e-4)


def _lora_step(model, batch, rows):
    from surefit.training.dropout import training_rows

    model.zero_grad(set_to_none=True)
    with training_rows(seed=3, step=1, rows=rows):
        loss_sum, n = causal_lm_loss_sum(model, batch)
    mean = loss_sum / n
    mean.backward()
    return mean.item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_padding_to_a_multiple_gives_the_same_loss_and_gradients(tiny):
    """--pad_to_multiple_of (fewer batch shapes for the allocator): the extra columns carry no loss and come after
    every row's last token, and the keyed dropout masks do not depend on the padded length; so the loss and the
    adapters' gradients are those of the batch padded to its longest row, up to rounding."""
    from peft import LoraConfig, get_peft_model

    from surefit.training.dropout import seed_dropout
    from surefit.training.speedups.lora_fast import fuse_lora

    model = get_peft_model(tiny, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.25, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    seed_dropout(model)
    fuse_lora(model)
    for p in model.parameters():
        if p.requires_grad:  # LoRA B starts at zero: give it values so every adapter's gradient is non-trivial
            torch.nn.init.normal_(p, std=0.05)
    model.train()
    feats, rows = _examples(), [3, 1, 4, 0, 5, 2, 7, 6]
    plain = PadCollator(pad_token_id=0)(feats)
    padded = PadCollator(pad_token_id=0, pad_to_multiple_of=16)(feats)
    assert plain["input_ids"].shape[1] % 16 and padded["input_ids"].shape[1] % 16 == 0  # the multiple added columns
    loss, grads = _lora_step(model, plain, rows)
    loss16, grads16 = _lora_step(model, padded, rows)
    assert abs(loss - loss16) < 1e-6
    assert grads.keys() == grads16.keys() and len(grads) == 2 * 7 * 2
    for name in grads:
        assert torch.allclose(grads[name], grads16[name], atol=1e-7, rtol=1e-5), name
    other_rows = _lora_step(model, plain, rows[::-1])[0]  # the masks are keyed by the rows: the check can fail
    assert abs(other_rows - loss) > 1e-4
