"""--eval_loss_in_prefill: one forward per evaluation batch gives the validation loss and the prompts' KV cache that
generation continues from. In fp32 it must give the loss of the separate loss pass and the tokens of the separate
prefill; models whose cache or logits it cannot handle fall back to two passes, saying so."""

import json

import pytest
import torch

from conftest import tiny_llama
from surefit.eval.generate import Decode, LossPass, LossPassUnfit, greedy_generate, why_no_loss_pass
from surefit.training.loss import causal_lm_loss_sum
from surefit.training.speedups import fused_head


def _lora_model(seed: int = 3, base=None):
    from peft import LoraConfig, get_peft_model

    from surefit.training.speedups.lora_fast import fuse_lora

    model = get_peft_model(base if base is not None else tiny_llama(seed=seed),
                           LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    fuse_lora(model)  # as training and evaluation run it
    return model.eval()


def _examples(n: int = 7):
    """Prompts of mixed lengths with answers of mixed lengths; in two rows a stretch of the prompt is supervised too
    (an earlier assistant turn of a conversation), which the loss must count and the cut cache must not mind."""
    g = torch.Generator().manual_seed(5)
    prompts, feats = [], []
    for i in range(n):
        p = torch.randint(2, 64, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        a = torch.randint(2, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() + [0]
        labels = [-100] * len(p) + a
        if i in (2, 5):
            labels[1:3] = p[1:3]
        prompts.append(p)
        feats.append({"input_ids": p + a, "labels": labels})
    return prompts, feats


def _separate_loss(model, feats):
    """The loss pass as evaluate_loss runs it: right-padded batches, the fused head."""
    from surefit.data.collate import PadCollator

    batch = PadCollator(pad_token_id=0)(feats)
    with torch.no_grad():
        total, n = causal_lm_loss_sum(model, batch, fused=fused_head)
    return float(total) / n, n


def _head_loss(model, hidden, targets):
    head = model.get_output_embeddings()
    return fused_head.fused_linear_cross_entropy(hidden, head.weight, head.bias, targets,
                                                 chunk_values=fused_head.FUSED_CHUNK_VALUES)


@pytest.mark.parametrize("batch_size,prefill_batch", [(7, None), (3, None), (7, 2)],
                         ids=["one-batch", "three-batches", "stacked-prefill"])
def test_one_forward_gives_the_loss_and_the_tokens_of_two_passes_in_fp32(batch_size, prefill_batch):
    model = _lora_model()
    prompts, feats = _examples()
    want_loss, want_n = _separate_loss(model, feats)
    free = greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=[], max_new_tokens=6, batch_size=7))
    # two stop ids taken from the answers: rows end at different steps, others run to the limit
    decode = dict(pad_token_id=0, eos_token_ids=sorted({free[0][2], free[3][3]}), max_new_tokens=6,
                  batch_size=batch_size, prefill_batch=prefill_batch)
    want = greedy_generate(model, prompts, Decode(**decode))
    assert len(set(map(len, want))) > 1 and max(map(len, want)) == 6
    passes = LossPass(feats, _head_loss)
    stats: dict[str, int] = {}
    got = greedy_generate(model, prompts, Decode(**decode, loss_pass=passes), stats=stats)
    assert got == want
    assert passes.tokens == want_n == sum(sum(t != -100 for t in f["labels"][1:]) for f in feats)
    assert passes.loss_sum / passes.tokens == pytest.approx(want_loss, rel=1e-5)
    assert stats["prefill_tokens"] == sum(len(f["input_ids"]) for f in feats)  # each example computed once


def test_the_loss_pass_is_refused_where_the_prompts_are_computed_otherwise():
    model = _lora_model()
    prompts, feats = _examples(3)
    assert why_no_loss_pass(model, prompts, feats, merge_lora=False, share_prefixes=False) is None
    assert "merged" in why_no_loss_pass(model, prompts, feats, merge_lora=True, share_prefixes=False)
    assert "shared" in why_no_loss_pass(model, prompts, feats, merge_lora=False, share_prefixes=True)
    feats[1] = {**feats[1], "input_ids": [7, *feats[1]["input_ids"][1:]]}
    assert "beginning" in why_no_loss_pass(model, prompts, feats, merge_lora=False, share_prefixes=False)
    with pytest.raises(ValueError, match="beginning"):
        greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=[0], max_new_tokens=2, batch_size=3,
                                               loss_pass=LossPass(feats, _head_loss)))


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"], ids=["every-layer-windowed", "mixed-layers"])
def test_a_sliding_window_model_gets_the_loss_and_tokens_of_two_passes(family):
    """transformers' own cache for a sliding-window layer keeps only the window's last tokens and cannot be cut;
    generation gives such models a full-length cache (the mask still applies the window), so the loss pass, the
    stacked prefill and the reserved cache serve them too, with the numbers of two passes (window 4, prompts up to
    19 tokens: the window bites)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                               pad_token_id=0, eos_token_id=0)
    model = _lora_model(base=AutoModelForCausalLM.from_config(cfg))
    prompts, feats = _examples()
    want_loss, want_n = _separate_loss(model, feats)
    for prefill_batch in (None, 2):
        decode = dict(pad_token_id=0, eos_token_ids=[], max_new_tokens=6, batch_size=7, prefill_batch=prefill_batch)
        want = greedy_generate(model, prompts, Decode(**decode, reuse_cache=False))  # the model's own cache
        passes = LossPass(feats, _head_loss)
        assert greedy_generate(model, prompts, Decode(**decode, loss_pass=passes)) == want
        assert passes.tokens == want_n
        assert passes.loss_sum / passes.tokens == pytest.approx(want_loss, rel=1e-5)


def _linear_attention_model():
    """A Qwen3-Next-style tiny model: a linear-attention (gated delta rule) layer, then a full-attention one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_next", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                               linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"],
                               pad_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(cfg)


def test_a_linear_attention_cache_stops_the_loss_pass_before_any_loss_is_added():
    model = _lora_model(base=_linear_attention_model())
    prompts, feats = _examples(4)
    passes = LossPass(feats, _head_loss)
    with pytest.raises(LossPassUnfit, match="full-attention"):
        greedy_generate(model, prompts, Decode(pad_token_id=0, eos_token_ids=[0], max_new_tokens=3, batch_size=4,
                                               loss_pass=passes))
    assert passes.tokens == 0 and passes.loss_sum == 0.0


def _epochs(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["type"] == "epoch"]


def test_a_run_evaluates_the_same_in_one_pass_or_two(tmp_path, tiny_lm_dir, qa_jsonl, monkeypatch):
    """Through the command line in fp32: the same validation loss, the same predictions, and the prompts are run once
    (no forward of the separate loss pass)."""
    from surefit.cli import main
    from surefit.tasks.sft import train_sft as recipe

    calls = {"evaluate_loss": 0}
    real = recipe.evaluate_loss

    def spy(*a, **k):
        calls["evaluate_loss"] += 1
        return real(*a, **k)

    monkeypatch.setattr(recipe, "evaluate_loss", spy)
    common = ["train", "--model", str(tiny_lm_dir), "--data", str(qa_jsonl), "--epochs", "2", "--lora_r", "4",
              "--max_new_tokens", "4", "--precision", "fp32", "--lr", "1e-2"]
    assert main([*common, "--output_dir", str(tmp_path / "one")]) == 0
    assert calls["evaluate_loss"] == 0
    assert main([*common, "--eval_loss_in_prefill", "false", "--output_dir", str(tmp_path / "two")]) == 0
    assert calls["evaluate_loss"] == 3  # epochs 0, 1, 2
    one, two = _epochs(tmp_path / "one"), _epochs(tmp_path / "two")
    assert [r["eval_loss"] for r in one] == pytest.approx([r["eval_loss"] for r in two], rel=1e-5)
    assert [r["eval_f1"] for r in one] == [r["eval_f1"] for r in two]
    for epoch in (1, 2):
        name = f"predictions/epoch_{epoch}.jsonl"
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "two" / name).read_text()


def test_a_model_that_soft_caps_its_logits_is_evaluated_in_two_passes_and_says_so(tmp_path, capsys):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from conftest import build_tokenizer, qa_rows
    from surefit.cli import main

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, sliding_window=16,
        final_logit_softcapping=30.0, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id))
    folder = tmp_path / "gemma2"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    assert main(["train", "--model", str(folder), "--data", str(data), "--epochs", "1", "--lora_r", "4",
                 "--max_new_tokens", "3", "--precision", "fp32", "--output_dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.count("computed in two passes for this model (the model soft-caps its logits") == 1
    assert "stopped by an error" not in out
    assert all("eval_loss" in r and "eval_f1" in r for r in _epochs(tmp_path / "run"))
