"""--lora_variant dora|rslora: the adapter trains, is saved as peft writes it, and loads with plain peft."""

import json

import pytest
import torch

from surefit.cli import main


@pytest.mark.parametrize("variant", ["dora", "rslora"])
def test_variant_trains_saves_and_loads_with_plain_peft(variant, tiny_lm_dir, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from conftest import qa_rows

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2", "--lora_r", "4",
                 "--lora_variant", variant, "--batch_size", "4", "--max_seq_length", "128", "--lr", "1e-2",
                 "--lora_dropout", "0", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads((out / "final" / "adapter_config.json").read_text())
    assert saved["use_dora"] is (variant == "dora") and saved["use_rslora"] is (variant == "rslora")
    if variant == "dora":
        assert "DoRA r=4 alpha=8" in printed and "peft's own layer forward" in printed
    else:
        assert "rsLoRA r=4 alpha=8 (scaling alpha/sqrt(r) = 4)" in printed
    epochs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"epoch"' in x]
    losses = [r["eval_loss"] for r in epochs if r.get("type") == "epoch"]
    assert losses[-1] < losses[0]

    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), out / "final")
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert bool(layer.use_dora["default"]) is (variant == "dora")
    assert layer.scaling["default"] == pytest.approx(8 / (4**0.5 if variant == "rslora" else 4))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-4)  # it trained


@pytest.mark.parametrize("kw", [{"use_dora": True}, {"use_rslora": True}])
def test_fused_forward_computes_what_peft_does_for_each_variant(kw):
    from peft import LoraConfig, get_peft_model

    from conftest import tiny_llama
    from surefit.training.speedups.lora_fast import fuse_lora

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                                    **kw))
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        fuse_lora(model)
        got = model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6)  # DoRA falls back to peft's forward; rsLoRA's scaling is used


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_an_moe_model_trains_at_the_default_dropout_and_its_adapter_loads_with_plain_peft(family, tmp_path, capsys):
    """transformers 5 stores MoE experts as fused 3-D parameters, which peft adapts through ParamWrapper; that refuses
    any lora_dropout, so the default 0.05 stopped every MoE run ('cannot apply LoRA: lora.ParamWrapper does not work
    with lora_dropout != 0', after peft had already changed the model). Now the linear layers' adapters get the
    dropout, the experts' none, and the run says so."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    extra = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
             "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)}[family]
    folder, out, losses = _train_tiny(family, tmp_path, **extra)
    printed = capsys.readouterr().out
    assert ("--lora_dropout 0.05: on the adapters of the 8 linear layers; the fused MoE parameters (down_proj, "
            "gate.weight, gate_up_proj) are adapted through peft's parameter LoRA, which takes no dropout") in printed
    assert "gate_up_proj (parameter)" in printed
    assert losses[-1] < losses[0]

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), out / "final")
    experts = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert len(experts) == 6  # gate_up_proj, down_proj and the router in each of the 2 layers
    trained = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert trained and all(v.abs().sum() > 0 for v in trained.values())


def test_a_mamba_hybrid_trains_on_all_linear_without_the_mixer_layers_peft_refuses(tmp_path, capsys):
    """peft expands all-linear into a Mamba mixer's out_proj, then refuses it part-way through changing the model
    ('Module 'out_proj' is incompatible with Mamba-based models'), so Falcon-H1 failed on the default targets. Now
    the run adapts every other linear layer and says which it left out; the adapter loads with plain peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, out, losses = _train_tiny("falcon_h1", tmp_path, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4,
                                      mamba_d_head=8, mamba_d_state=16, mamba_expand=1, mamba_chunk_size=16)
    printed = capsys.readouterr().out
    assert ("--lora_targets all-linear: not on out_proj, which peft cannot adapt on a falcon_h1 model (a Mamba "
            "mixer's); on the other linear layers (down_proj, gate_proj, in_proj, k_proj, o_proj, q_proj, up_proj, "
            "v_proj;") in printed
    assert losses[-1] < losses[0]

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), out / "final")
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"down_proj", "gate_proj", "in_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"}


def _train_tiny(family, tmp_path, **dims):
    """A 2-layer ``family`` model built from its config, trained 2 epochs on QA rows with the default LoRA targets
    and dropout; returns (its folder, the run folder, the epoch losses)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from conftest import build_tokenizer, qa_rows

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **dims)
    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--model", str(folder), "--data", str(data), "--epochs", "2", "--lora_r", "4",
                 "--batch_size", "4", "--max_seq_length", "128", "--lr", "1e-2", "--max_new_tokens", "2",
                 "--precision", "fp32", "--output_dir", str(out)]) == 0
    losses = [json.loads(x)["eval_loss"] for x in (out / "metrics.jsonl").read_text().splitlines()
              if json.loads(x).get("type") == "epoch"]
    return folder, out, losses
