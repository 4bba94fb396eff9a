"""16-bit loading and QLoRA (--quantize 4bit|8bit): what trains, what is saved, how it loads back, what it costs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import build_tokenizer, qa_rows
from surefit.cli import main
from surefit.models import ModelSource, load_causal_lm
from surefit.models.lowbit import quantized_bits
from surefit.training.precision import store_frozen_in

SRC = Path(__file__).resolve().parents[1] / "src"


def _bitsandbytes_problem() -> str | None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:  # the only reason to skip: it cannot be imported here
        return f"bitsandbytes cannot be imported ({e}); pip install 'surefit[quantize]' to run these tests"
    return None


needs_bnb = pytest.mark.skipif(_bitsandbytes_problem() is not None, reason=_bitsandbytes_problem() or "")


def _write_lm(folder: Path, tie: bool = False, seed: int = 0) -> Path:
    """A 2-layer Llama whose Linear widths are multiples of 64 (bitsandbytes' 4-bit block on a CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms that 16 bits cannot hold exactly (a fresh model's are all 1.0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lm64(tmp_path_factory) -> Path:
    return _write_lm(tmp_path_factory.mktemp("lm64"))


@pytest.fixture(scope="module")
def qa_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qa") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(24)), encoding="utf-8")
    return path


def _train(model: Path, data: Path, out: Path, *extra: str) -> None:
    assert main(["train", "--model", str(model), "--data", str(data), "--epochs", "3", "--lora_r", "4",
                 "--batch_size", "4", "--max_seq_length", "128", "--lr", "1e-2", "--lora_dropout", "0",
                 "--output_dir", str(out), *extra]) == 0


def _epoch_losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in rows if r.get("type") == "epoch"]


@pytest.fixture(scope="module")
def run4(lm64, qa_data, tmp_path_factory):
    """A finished 4-bit run (bf16 compute) and what it printed."""
    import io
    from contextlib import redirect_stdout

    out = tmp_path_factory.mktemp("q4") / "run"
    buf = io.StringIO()
    with redirect_stdout(buf):
        _train(lm64, qa_data, out, "--quantize", "4bit", "--precision", "bf16")
    return out, buf.getvalue()


# ----------------------------------------------------------------------------------------------- 16-bit loading


@pytest.mark.parametrize("tie", [False, True])
def test_16bit_load_equals_an_fp32_load_stored_in_16_bits(tmp_path, tie):
    """Reading straight into bf16 gives bit for bit the weights, buffers and logits the old fp32 load + cast gave."""
    folder = _write_lm(tmp_path / "lm", tie=tie)
    src = ModelSource("folder", str(folder), "tiny")
    old = load_causal_lm(str(folder), src).requires_grad_(False)
    store_frozen_in(old, torch.bfloat16)
    new = load_causal_lm(str(folder), src, dtype="bf16", say=pytest.fail).requires_grad_(False)  # no fallback
    store_frozen_in(new, torch.bfloat16)
    a, b = old.state_dict(), new.state_dict()
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert new.model.embed_tokens.weight.dtype == torch.bfloat16 and new.model.norm.weight.dtype == torch.float32
    assert not torch.equal(new.model.norm.weight, new.model.norm.weight.bfloat16().float())  # fp32 values kept
    assert (new.lm_head.weight is new.model.embed_tokens.weight) is tie
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(old(input_ids=ids).logits, new(input_ids=ids).logits)
    assert new.generation_config.eos_token_id == old.generation_config.eos_token_id
    assert new.config.name_or_path == str(folder)
    import types

    from surefit.models import apply_lora

    lora = types.SimpleNamespace(lora_r=4, resolved_lora_alpha=8, lora_dropout=0.0, lora_targets="all-linear",
                                 lora_variant="lora")
    wrapped = apply_lora(new, lora, "CAUSAL_LM", say=lambda s: None)
    assert {p.dtype for p in wrapped.parameters() if p.requires_grad} == {torch.float32}  # the adapters train in fp32


def test_bf16_run_loads_in_16_bits_and_the_plan_counts_what_was_loaded(lm64, qa_data, tmp_path, capsys):
    out = tmp_path / "run"
    _train(lm64, qa_data, out, "--precision", "bf16", "--epochs", "1")
    printed = capsys.readouterr().out
    assert "frozen weights loaded in bf16" in printed and "no fp32 copy" in printed
    plan = json.loads((out / "memory_plan.json").read_text())
    assert plan["frozen_dtype"] == "bf16" and plan["quantized"] is None
    assert any("loaded in bf16 (read straight into 16 bits" in c for c in plan["changes"])
    # The weights as loaded: every Linear and Embedding in 2 bytes, norms in 4, LoRA adapters (fp32) in 4.
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(lm64)
    two = sum(p.numel() for n, p in ref.named_parameters() if "norm" not in n)
    four = sum(p.numel() for n, p in ref.named_parameters() if "norm" in n)
    buffers = sum(b.numel() * b.element_size() for b in ref.buffers())
    lora = 4 * 4 * sum(m.in_features + m.out_features for n, m in ref.named_modules()
                       if isinstance(m, torch.nn.Linear) and n != "lm_head")
    assert plan["estimate"]["weights"] == 2 * two + 4 * four + buffers + lora
    assert plan["estimate"]["AdamW states"] == 8 * lora // 4  # the adapters stay fp32, and so do their states


_RSS = textwrap.dedent("""
    import sys, types
    import torch, transformers, peft
    from surefit.models import ModelSource, apply_lora, load_causal_lm
    from surefit.training.precision import store_frozen_in
    path = sys.argv[2]  # converted by the test beforehand: a conversion here would set the peak before the load
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    # ru_maxrss is no measure here: Linux carries the parent's peak across fork and exec, and the parent is a test
    # process that may hold gigabytes. Reset this process's peak (clear_refs 5) and read VmHWM instead.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    dtype = None if sys.argv[1] == "fp32" else sys.argv[1]
    model = load_causal_lm(path, ModelSource("folder", path, "embedded"), dtype=dtype)
    cfg = types.SimpleNamespace(lora_r=16, resolved_lora_alpha=32, lora_dropout=0.0, lora_targets="all-linear",
                                lora_variant="lora")
    model = apply_lora(model, cfg, "CAUSAL_LM", say=lambda s: None)
    if dtype:
        store_frozen_in(model, torch.bfloat16)  # what the planner does: nothing left to convert
    with torch.no_grad():  # every weight read once, as the first training step does
        total = sum(float(t.sum()) for t in [*model.parameters(), *model.buffers()])
    print(status("VmHWM") - before)
""")


def _load_rss_kb(dtype: str, path: str) -> int:
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    import os

    env["HOME"] = os.environ.get("HOME", "/root")
    if os.environ.get("SUREFIT_CACHE"):
        env["SUREFIT_CACHE"] = os.environ["SUREFIT_CACHE"]
    done = subprocess.run([sys.executable, "-c", _RSS, dtype, path], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bf16_lora_load_of_the_embedded_model_peaks_at_most_055x_the_fp32_load():
    """Peak RSS added by loading SmolLM2-135M with LoRA adapters (after the imports), each in a fresh process."""
    from surefit.models import model_folder, resolve_model

    path = model_folder(resolve_model(None), log=lambda s: None)
    fp32, bf16 = _load_rss_kb("fp32", path), _load_rss_kb("bf16", path)
    assert fp32 > 400 * 1024, fp32  # the measurement saw the load: 538 MB of fp32 weights
    # 135M weights: ~538 MB in fp32, ~269 MB in bf16, + ~20 MB of fp32 adapters in both; 0.55 leaves room for
    # the 8 MB read buffer and allocator slack, while any whole-model fp32 copy (the old load) would exceed 1x.
    print(f"peak RSS added by the load: fp32 {fp32 / 1024:.0f} MiB, bf16 {bf16 / 1024:.0f} MiB ({bf16 / fp32:.2f}x)")
    assert bf16 <= 0.55 * fp32, (bf16, fp32)


# ------------------------------------------------------------------------------------------------------------ QLoRA


@needs_bnb
def test_4bit_run_trains_the_loss_falls_and_says_how(run4):
    out, printed = run4
    losses = _epoch_losses(out)
    assert losses[-1] < losses[0] - 0.3, losses
    assert "quantised to 4-bit nf4 with double quantisation" in printed
    assert "the adapters run surefit's fused LoRA forward" in printed
    plan = json.loads((out / "memory_plan.json").read_text())
    assert plan["quantized"] == "4bit" and "frozen Linear weights quantised to 4-bit, the other frozen weights in bf16" in printed
    # 4-bit Linear weights: half a byte per value, + block scales (one byte per 64 values, double quantisation,
    # and small code tables); embeddings and output layer in bf16, norms and adapters in fp32.
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(_base(out))
    linears = [m for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    linear = sum(m.weight.numel() for m in linears)
    norms = sum(p.numel() for n, p in ref.named_parameters() if "norm" in n)
    lora = 4 * 4 * sum(m.in_features + m.out_features for m in linears)
    rest = ref.model.embed_tokens.weight.numel() + ref.lm_head.weight.numel()
    buffers = sum(b.numel() * b.element_size() for b in ref.buffers())
    lower = linear // 2 + 2 * rest + 4 * norms + buffers + lora
    weights = plan["estimate"]["weights"]
    assert lower + linear // 64 <= weights <= lower + linear // 64 + len(linears) * 2 * 1024 + 4096, (weights, lower)
    from safetensors import safe_open

    with safe_open(str(out / "final" / "adapter_model.safetensors"), "pt") as f:  # trained and saved in fp32
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    adapter_cfg = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(_base(out))


def _base(out: Path) -> Path:
    return Path(json.loads((out / "final" / "adapter_config.json").read_text())["base_model_name_or_path"])


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@needs_bnb
@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_qlora_layers_take_the_fused_forward_same_numbers_less_saved(lm64, bits):
    """On an H200 QLoRA peaked above 16-bit LoRA (2.87 against 2.58 GB): its layers trained through peft's forward,
    which keeps each adapter's dropped input for the backward pass. They now take the fused forward (the base layer
    called as peft calls it, a bit mask saved): the same loss and gradients as peft's forward with the same masks,
    and fewer bytes saved."""
    import copy

    from peft import LoraConfig, get_peft_model

    from surefit.training.dropout import seed_dropout, training_rows
    from surefit.training.plan import measure_saved_bytes
    from surefit.training.speedups.lora_fast import fuse_lora

    base = load_causal_lm(str(lm64), ModelSource("folder", str(lm64), "tiny"), quantize=bits, say=lambda *_: None)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    torch.manual_seed(1)
    for n, t in peft_model.named_parameters():
        if "lora_B" in n:
            t.data.normal_(0, 0.1)  # B starts at zero: nonzero, so the adapters' gradients and outputs count
    seed_dropout(peft_model)
    fused = copy.deepcopy(peft_model)
    assert fuse_lora(fused) == 14  # 2 layers x q, k, v, o, gate, up, down
    # where bitsandbytes placed the model (a GPU, where there is one)
    ids = torch.randint(3, 60, (3, 24)).to(peft_model.get_input_embeddings().weight.device)
    results = []
    for model in (peft_model, fused):
        model.train()
        with training_rows(0, 0, [0, 1, 2]):  # the same keyed masks for both
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            saved = measure_saved_bytes(model, lambda m=model: m(input_ids=ids, labels=ids).loss)
        grads = {n: t.grad.clone() for n, t in model.named_parameters() if t.grad is not None}
        results.append((loss.detach(), grads, saved))
    (l0, g0, s0), (l1, g1, s1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) == 28
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)
    print(f"saved for the backward pass: peft {s0:,} bytes, fused {s1:,} ({s1 / s0:.2f}x)")
    assert s1 < 0.8 * s0, (s1, s0)


@needs_bnb
@pytest.mark.parametrize("bits", ["none", "4bit"])
def test_every_fp32_activation_a_bf16_lora_run_saves_is_stored_in_bf16(lm64, bits):
    """Under bf16 with LoRA the activation store keeps what autograd saves in bf16. QLoRA's layer outputs are views
    of the fused adapter's own buffer (made with grad off: a leaf), and the store once skipped every view of a leaf:
    on an H100 QLoRA then saved 573 MB where it had saved 426 MB (benchmarks/results/qlora_saved_views.md)."""
    from peft import LoraConfig, get_peft_model

    from surefit.data.collate import PadCollator
    from surefit.training.loss import causal_lm_loss_sum
    from surefit.training.speedups.lora_fast import Packed, SavedActivationsIn, fuse_lora

    base = load_causal_lm(str(lm64), ModelSource("folder", str(lm64), "tiny"), dtype="bf16", quantize=bits,
                          say=lambda *_: None)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    assert fuse_lora(model) == 14
    if bits == "none":
        store_frozen_in(model, torch.bfloat16)
    model.train()
    device = model.get_input_embeddings().weight.device
    ids = torch.randint(3, 60, (2, 40))
    batch = {k: v.to(device) for k, v in PadCollator(pad_token_id=0)(
        [{"input_ids": r.tolist(), "labels": r.tolist()} for r in ids]).items()}
    store = SavedActivationsIn()
    escaped: list[tuple[tuple[int, ...], str]] = []
    pack = store.pack

    def watched(t):
        out = pack(t)
        trainable_view = t._base is not None and t._base.is_leaf and t._base.requires_grad
        if type(out) is not Packed and t.dtype == torch.float32 and not t.is_leaf and not trainable_view \
                and t.numel() >= store.MIN_NUMEL:
            escaped.append((tuple(t.shape), type(t.grad_fn).__name__))
        return out

    store.pack = watched
    with torch.autocast(device.type, dtype=torch.bfloat16), store:
        loss, n = causal_lm_loss_sum(model, batch)
    (loss / n).backward()
    assert escaped == []
    assert all(p.grad is not None for name, p in model.named_parameters() if "lora_" in name)


@needs_bnb
def test_4bit_adapter_loads_with_plain_peft_on_the_unquantised_base_within_the_quantisation_error(run4):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out, _ = run4
    base = _base(out)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]])
    plain = AutoModelForCausalLM.from_pretrained(base)
    quant = AutoModelForCausalLM.from_pretrained(base, quantization_config=q, dtype=torch.float32, device_map="cpu")
    base_err = (_logits(plain, ids) - _logits(quant, ids)).abs().max().item()  # quantisation error, no adapter
    fp_with = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / "final").eval()
    q_with = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, quantization_config=q, dtype=torch.float32, device_map="cpu"),
        out / "final").eval()
    a, b = _logits(fp_with, ids), _logits(q_with, ids)
    err = (a - b).abs().max().item()
    moved = (a - _logits(plain, ids)).abs().max().item()
    print(f"max |logit gap|: bare base {base_err:.4g}, with adapter {err:.4g}; adapter moved logits {moved:.4g}; "
          f"logits' std {a.std().item():.4g}")
    # The adapter is the same fp32 A, B in both; the only difference is the base's nf4 rounding. The adapter changes
    # the activations that carry that rounding forward, so the gap is of the bare base's order, not equal to it
    # (0.4x and 1.55x measured on two of these tiny models); 2x bounds that. A lost, mis-scaled or wrongly merged
    # adapter shows its own effect instead, which here is over 10x the gap: the check can tell them apart.
    assert err <= 2 * base_err + 1e-4, (err, base_err)
    assert moved > 4 * err, (moved, err)


@needs_bnb
def test_eval_of_a_4bit_run_loads_it_quantised_and_reproduces_training(run4, capsys):
    from surefit.run_folder.open_run import open_run
    from surefit.tasks.sft import load

    out, _ = run4
    loaded = load(open_run(out, say=lambda s: None), say=lambda s: None)
    assert quantized_bits(loaded.model) == "4bit"
    capsys.readouterr()
    assert main(["eval", "--run", str(out), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert metrics["eval_loss"] == pytest.approx(_epoch_losses(out)[-1], abs=1e-6)
    assert main(["predict", "--run", str(out), "--input", "the cat sat on the mat near the dog .\n\nQuestion: "
                 "where did the cat sit ?"]) == 0
    assert '"prediction"' in capsys.readouterr().out


@needs_bnb
def test_export_merge_of_a_4bit_run_is_a_16bit_model_plain_transformers_loads(run4, tmp_path, capsys):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out, _ = run4
    dest = tmp_path / "merged"
    assert main(["export", "--run", str(out), "--merge", "--to", str(dest)]) == 0
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    assert "merged into a bf16 copy of the unquantised base, never into the 4-bit weights" in printed
    config = json.loads((dest / "config.json").read_text())
    assert "quantization_config" not in config
    with safe_open(str(dest / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    merged = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(_base(out)), out / "final").eval()
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    a, b = _logits(ref, ids), _logits(merged, ids)
    # bf16 keeps 8 bits of mantissa: weights rounded by at most 2^-9 relative.
    assert (a - b).abs().max().item() < 0.05 * a.std().item()


@needs_bnb
def test_8bit_run_trains_and_saves_an_adapter_plain_peft_loads(lm64, qa_data, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run8"
    _train(lm64, qa_data, out, "--quantize", "8bit", "--precision", "fp32", "--epochs", "2")
    losses = _epoch_losses(out)
    assert losses[-1] < losses[0], losses
    assert json.loads((out / "memory_plan.json").read_text())["quantized"] == "8bit"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(_base(out)), out / "final")
    assert model.peft_config["default"].r == 4


def test_missing_bitsandbytes_is_a_configuration_error_naming_the_extra(lm64, qa_data, tmp_path):
    """A missing package: its import raises ImportError (None in sys.modules is how Python spells 'not there')."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["bitsandbytes"] = None
        from surefit.cli import main
        sys.exit(main(["train", "--model", {str(lm64)!r}, "--data", {str(qa_data)!r}, "--quantize", "4bit",
                       "--output_dir", {str(tmp_path / "run")!r}]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    text = done.stdout + done.stderr
    assert done.returncode != 0
    assert "--quantize 4bit needs bitsandbytes, which is not installed" in text
    assert "pip install 'surefit[quantize]'" in text
    assert "Traceback" not in text
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize("argv, says", [
    (["--lora_r", "0"], "it needs LoRA adapters (got --lora_r 0)"),
    (["--task", "classify", "--lora_r", "8"], "--quantize is not available for --task classify"),
    (["--task", "custom", "--model", "m.py:build"], "--quantize is not available for --task custom"),
])
def test_quantize_is_refused_where_it_cannot_work(argv, says, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "a", "target": "b"}\n', encoding="utf-8")
    assert main(["train", "--data", str(data), "--quantize", "4bit", "--output_dir", str(tmp_path / "o"), *argv]) != 0
    captured = capsys.readouterr()
    assert says in captured.out + captured.err


@needs_bnb
@pytest.mark.parametrize("hide", ["absent", "broken"])
def test_export_merge_of_a_4bit_run_needs_no_bitsandbytes_and_eval_names_it(run4, tmp_path, hide):
    """``absent``: None in sys.modules (how Python spells 'not installed'). ``broken``: an installed bitsandbytes
    whose import fails as a missing native library does; peft imports it whenever it is installed."""
    out, _ = run4
    fake = tmp_path / "site"
    (fake / "bitsandbytes").mkdir(parents=True)
    (fake / "bitsandbytes" / "__init__.py").write_text(
        'raise OSError("libbitsandbytes_cpu.so: cannot open shared object file")\n')
    hiding = ('sys.modules["bitsandbytes"] = None' if hide == "absent" else f"sys.path.insert(0, {str(fake)!r})")
    script = f"import sys\n{hiding}\nfrom surefit.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300,
                              env=env)

    done = run("export", "--run", str(out), "--merge", "--to", str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    done = run("eval", "--run", str(out))
    text = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in text
    expected = ("which is not installed" if hide == "absent" else
                "which is installed but cannot be loaded on this machine (OSError: libbitsandbytes_cpu.so")
    assert f"--quantize 4bit needs bitsandbytes, {expected}" in text
    assert "pip install 'surefit[quantize]'" in text
