"""Shared prompt prefixes computed once: the same loss and gradients as every row in full, per model family."""

import copy

import pytest
import torch

from surefit.data.collate import IGNORE_INDEX, PadCollator
from surefit.training.loss import causal_lm_loss_sum
from surefit.training.speedups.prefixes import PrefixSharing, prefix_groups, why_not_shared

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, eos_token_id=0)


def _model(kind: str, attn: str = "sdpa", **extra):
    import transformers as tf

    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    kw = dict(SMALL, **extra)
    if kind == "gemma":
        kw["head_dim"] = 8
    model = model_cls(config_cls(**kw, attn_implementation=attn)).double()
    return model


def _rows(seed: int = 0):
    """Three questions on one paragraph, two on another, one row alone (right padding); and one question asked twice
    with two answers, whose rows' common prompt runs up to the first supervised token (the shared part must stop
    before the prompt's last token, whose output predicts the answer)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(3, 60, (n,), generator=g).tolist()

    para_a, para_b, para_c, q1 = rand(14), rand(9), rand(12), rand(5)
    prompts = [para_a + rand(5), para_a + rand(4), para_a + rand(6), para_b + rand(6), para_b + rand(3), rand(11),
               para_c + q1, para_c + q1]
    answers = [rand(3), rand(2), rand(4), rand(1), rand(3), rand(2), rand(2), rand(3)]
    feats = []
    for p, a in zip(prompts, answers, strict=True):
        ids = p + a + [0]
        feats.append({"input_ids": ids, "labels": [IGNORE_INDEX] * len(p) + ids[len(p):]})
    return feats


def _loss_and_grads(model, batch, share):
    model = copy.deepcopy(model)
    loss, n = causal_lm_loss_sum(model, batch, share=share)
    (loss / n).backward()
    return loss.detach() / n, n, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind,attn,extra", [
    ("llama", "sdpa", {}),
    ("llama", "eager", {}),
    ("mistral", "sdpa", {"sliding_window": 6}),  # a window shorter than the rows: it must still apply
    ("qwen2", "sdpa", {}),
    ("qwen3", "sdpa", {}),
    ("gemma", "sdpa", {}),
    ("phi3", "sdpa", {}),
])
def test_shared_prefixes_give_the_loss_and_gradients_of_full_rows(kind, attn, extra):
    model = _model(kind, attn, **extra)
    batch = PadCollator(pad_token_id=0)(_rows())
    share = PrefixSharing(min_tokens=4, max_share=1.0)
    loss, n, grads = _loss_and_grads(model, batch, share)
    counts = share.take()
    assert counts["shared_batches"] == 1 and counts["rows"] == 4  # 2 rows join paragraph A's first, 1 B's, 1 C's
    # paragraph A (14 tokens) twice, B (9) once; the twice-asked question's 17-token prompt but for its last token
    assert counts["tokens_saved"] == 2 * 14 + 9 + 16
    ref_loss, ref_n, ref_grads = _loss_and_grads(model, batch, None)
    assert n == ref_n == sum(sum(1 for t in f["labels"][1:] if t != IGNORE_INDEX) for f in _rows())
    # the model runs in float64; the cross-entropy in float32 (as always), hence float32's tolerance
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0), (loss.item(), ref_loss.item())
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], rtol=1e-5, atol=1e-8), name


def test_the_mask_keeps_a_row_from_seeing_its_neighbours_rest():
    """Negative control: rows laid out one after another without the mask (plain causal attention) see each other's
    tokens, and the loss changes. The shared layout's equality above is not an accident of the data."""
    model = _model("llama")
    batch = PadCollator(pad_token_id=0)(_rows())
    kwargs, keep, targets = PrefixSharing(min_tokens=4, max_share=1.0).pack(model, batch)
    with torch.no_grad():
        masked = model(**kwargs, logits_to_keep=keep).logits
        kwargs["attention_mask"] = None
        unmasked = model(**kwargs, logits_to_keep=keep).logits
    assert not torch.allclose(masked, unmasked)


def test_a_row_sharing_only_a_short_template_does_not_shorten_a_long_shared_paragraph():
    template, para = [1, 2, 3, 4], list(range(10, 40))
    rows = [template + para + [50], template + para + [51], template + [60, 61]]
    groups = prefix_groups(rows, caps=[len(r) - 1 for r in rows], min_tokens=4)
    assert sorted((sorted(m), p) for m, p in groups) == [([0, 1], 34), ([2], 0)]
    # the same with the template-only row sorting first, next to the paragraph rows
    rows = [template + para + [50], template + [5, 6], template + para + [51]]
    groups = prefix_groups(rows, caps=[len(r) - 1 for r in rows], min_tokens=4)
    assert sorted((sorted(m), p) for m, p in groups) == [([0, 2], 34), ([1], 0)]
    # three rows sharing 20 tokens save more together (2 x 20) than the two of them that share 30 (30)
    rows = [list(range(100, 120)) + [1] * 10 + [7], list(range(100, 120)) + [1] * 10 + [8], list(range(100, 120)) + [9]]
    groups = prefix_groups(rows, caps=[len(r) - 1 for r in rows], min_tokens=4)
    assert [(sorted(m), p) for m, p in groups] == [([0, 1, 2], 20)]
    # with a minimum above the template's length nothing joins it either way; with a paragraph as short as the
    # template, all three share it
    rows = [template + [10, 50], template + [10, 51], template + [60, 61]]
    assert [(sorted(m), p) for m, p in prefix_groups(rows, caps=[5, 5, 5], min_tokens=4)] == [([0, 1, 2], 4)]


def test_nothing_is_laid_out_when_rows_share_too_little():
    model = _model("llama")
    batch = PadCollator(pad_token_id=0)(_rows())
    share = PrefixSharing(min_tokens=50)  # longer than any common prefix here
    assert share.pack(model, batch) is None
    assert share.take() == {"batches": 1, "shared_batches": 0, "rows": 0, "tokens_saved": 0,
                            "tokens": sum(len(f["input_ids"]) for f in _rows())}
    share = PrefixSharing(min_tokens=4, max_share=0.2)  # the layout must save 80% of the padded tokens: it does not
    assert share.pack(model, batch) is None


def test_models_it_does_not_cover_say_why_and_train_as_before():
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4))
    assert "model type 'gpt2' is not one of those verified" in why_not_shared(gpt2)
    mixed = Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    assert "mixes sliding-window and full-attention layers" in why_not_shared(mixed)
    share = PrefixSharing(min_tokens=4, max_share=1.0)
    batch = PadCollator(pad_token_id=0)(_rows())
    assert share.pack(mixed, batch) is None and "mixes" in share.reason


def test_left_padding_is_left_alone():
    model = _model("llama")
    batch = PadCollator(pad_token_id=0)(_rows())
    flipped = {k: v.flip(1) for k, v in batch.items()}  # pads first: positions would not start at 0
    assert PrefixSharing(min_tokens=4, max_share=1.0).pack(model, flipped) is None


def test_peft_lora_model_trains_the_same_with_shared_prefixes():
    """Through peft and surefit's fused LoRA forward (dropout 0): the adapters' gradients match full rows."""
    from peft import LoraConfig, get_peft_model

    from surefit.training.speedups.lora_fast import fuse_lora

    model = get_peft_model(_model("llama").float(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                               target_modules=["q_proj", "v_proj", "down_proj"]))
    for _, p in model.named_parameters():  # LoRA B starts at zero: move it so every adapter has a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    fuse_lora(model)
    batch = PadCollator(pad_token_id=0)(_rows())
    loss, _, grads = _loss_and_grads(model, batch, PrefixSharing(min_tokens=4, max_share=1.0))
    ref_loss, _, ref_grads = _loss_and_grads(model, batch, None)
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    assert grads.keys() == ref_grads.keys() and all("lora_" in k for k in grads)
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], rtol=1e-4, atol=1e-6), name


def test_under_a_ddp_style_wrapper_around_peft_the_base_models_forward_is_read():
    """DDP wraps the peft model (``module`` outermost). The forward surefit inspects must be the transformers
    model's (it takes ``logits_to_keep`` and ``position_ids``), not peft's ``**kwargs`` one: reading peft's made
    several processes compute the LM head at every position and share no prefix."""
    from peft import LoraConfig, get_peft_model

    from surefit.training.loss import base_forward_params

    class Wrapper(torch.nn.Module):  # what DistributedDataParallel looks like from outside: the model in `module`
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    peft_model = get_peft_model(_model("llama").float(), LoraConfig(r=4, target_modules=["q_proj"]))
    wrapped = Wrapper(peft_model)
    assert {"logits_to_keep", "position_ids"} <= base_forward_params(wrapped)
    assert why_not_shared(wrapped) is None
    batch = PadCollator(pad_token_id=0)(_rows())
    share = PrefixSharing(min_tokens=4, max_share=1.0)
    loss, n = causal_lm_loss_sum(wrapped, batch, share=share)
    ref, ref_n = causal_lm_loss_sum(peft_model, batch)
    assert share.take()["shared_batches"] == 1 and n == ref_n
    assert abs(loss.item() - ref.item()) < 1e-4 * abs(ref.item())
