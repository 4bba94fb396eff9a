"""LoRA under bf16 stores the frozen base in bf16 while training (no fp32 copy cast at every matmul), yet what the
run hands out is the plain adapter for the original base: ``final/`` loads with plain peft onto the fp32 base, and
``export --merge`` folds the adapter into the base read in its own dtype (fp32), not into the bf16 training copy."""

import json

import torch

from surefit.cli import main


def test_bf16_lora_run_stores_the_frozen_base_in_bf16_and_hands_out_an_adapter_for_the_fp32_base(tmp_path,
                                                                                                  tiny_lm_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import qa_rows
    from surefit.tasks.sft import train_sft

    loaded = []
    real_load = train_sft.load_model

    def spy(*a, **k):
        model = real_load(*a, **k)
        loaded.append({n: p.dtype for n, p in model.named_parameters()})
        return model

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    out = tmp_path / "run"
    train_sft.load_model = spy
    try:
        assert main(["train", "--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1",
                     "--lora_r", "4", "--batch_size", "4", "--max_seq_length", "96", "--lr", "1e-2",
                     "--precision", "bf16", "--val_fraction", "0.2", "--eval_generate", "false",
                     "--output_dir", str(out)]) == 0
    finally:
        train_sft.load_model = real_load
    [dtypes] = loaded
    linear = {n: d for n, d in dtypes.items() if n.endswith("proj.weight")}
    assert linear and set(linear.values()) == {torch.bfloat16}  # read straight into bf16: no fp32 copy to cast
    assert {d for n, d in dtypes.items() if "norm" in n} == {torch.float32}
    plan = json.loads((out / "memory_plan.json").read_text())
    assert plan["frozen_dtype"] == "bf16"

    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert adapter and {v.dtype for v in adapter.values()} == {torch.float32}  # the trained adapter, fp32
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    assert {p.dtype for p in base.parameters()} == {torch.float32}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), out / "final")
    params = dict(model.named_parameters())
    for name, p in base.named_parameters():  # the base under the adapter is the original, fp32, unchanged
        q = params.get("base_model.model." + name.replace(".weight", ".base_layer.weight"),
                       params.get("base_model.model." + name))
        assert q.dtype == torch.float32 and torch.equal(p, q), name

    dest = tmp_path / "merged"
    assert main(["export", "--run", str(out), "--merge", "--to", str(dest)]) == 0
    merged = load_file(dest / "model.safetensors")
    expected = model.merge_and_unload().state_dict()  # peft's merge into the fp32 base
    assert {v.dtype for v in merged.values()} == {torch.float32}
    for name, v in merged.items():
        assert torch.equal(v, expected[name]), name


def test_doctor_runs_where_the_model_is_and_under_that_devices_autocast():
    """Seen on an H200: a bf16 LoRA run's doctor ran its dry-run forward on the model still on the CPU while the
    run's autocast was the GPU's, so the 16-bit frozen weights met fp32 inputs and the doctor refused a healthy run
    (the same in a sharded run, whose model stays on the CPU); a 4-bit model placed on the GPU at load got CPU
    inputs. The doctor's batch now goes to the model's device, and its autocast is that device's."""
    import contextlib
    import types

    import pytest

    from conftest import build_tiny_lm, build_tokenizer
    from surefit.data.collate import PadCollator
    from surefit.doctor.core import Setup
    from surefit.training.precision import autocast_where, store_frozen_in

    tok = build_tokenizer()
    model = build_tiny_lm(tok).requires_grad_(False)  # a LoRA run's frozen base
    store_frozen_in(model, torch.bfloat16)
    # a GPU run's accelerator, seen from a CPU: its autocast is CUDA's, which no CPU operation follows
    gpu_run = types.SimpleNamespace(device=torch.device("cuda"), mixed_precision="bf16",
                                    autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.warns(UserWarning), gpu_run.autocast(), pytest.raises(RuntimeError, match="dtype"):
        model(input_ids=ids)
    with autocast_where(model, gpu_run):
        out = model(input_ids=ids)
    assert out.logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(out.logits).all()
    cpu_run = types.SimpleNamespace(device=torch.device("cpu"), mixed_precision="bf16", autocast=contextlib.nullcontext)
    assert isinstance(autocast_where(model, cpu_run), contextlib.nullcontext)  # the model is where the run is

    # the dry-run batch lands on the model's device (meta stands in for a GPU: no data, only where it is)
    features = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [5, 6, 7]}] * 2
    setup = Setup(model.to("meta"), tok, features, None, PadCollator(pad_token_id=0))
    batch, err = setup.batch()
    assert err is None and {v.device.type for v in batch.values()} == {"meta"}
