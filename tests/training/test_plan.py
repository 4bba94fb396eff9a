"""The memory planner: it fits the budget by cutting steps smaller, never by changing the effective batch."""

import copy
import json
import math
import os

import pytest
import torch

from conftest import tiny_llama
from surefit.training.plan import (
    GB,
    MemoryPlanError,
    PlanRequest,
    Workload,
    make_plan,
    measure_saved_bytes,
    micro_candidates,
)
from surefit.training.precision import store_frozen_in
from surefit.training.speedups.lora_fast import SavedActivationsIn


@pytest.fixture()
def tiny():
    return tiny_llama()


def _work(n=16, length=40, store=SavedActivationsIn):
    return Workload(lengths=[length - i % 7 for i in range(n)], supervised=[3 + i % 4 for i in range(n)],
                    activation_store=store)


def _plan(model, budget_gb, batch_size=8, work=None, **kw):
    args = dict(batch_size=batch_size, processes=1, requested_micro=batch_size, gradient_checkpointing=False,
                precision="fp32", eval_batch_size=8, budget=(budget_gb, "test"), lora=False,
                device=torch.device("cpu"))
    args.update(kw)
    probe = args.pop("probe", None)
    return make_plan(model, work or _work(), PlanRequest(**args), probe=probe)


def test_micro_candidates_are_the_smallest_micro_for_each_accumulation():
    assert micro_candidates(8, 8) == [8, 4, 3, 2, 1]
    assert micro_candidates(7, 7) == [7, 4, 3, 2, 1]  # 7 = 4 + 3, 3 + 3 + 1, ...
    assert micro_candidates(8, 4) == [4, 3, 2, 1]  # never above the requested micro-batch


def test_planner_keeps_the_effective_batch_at_every_budget(tiny):
    unlimited = _plan(copy.deepcopy(tiny), None)
    assert (unlimited.micro_batch_size, unlimited.grad_accum) == (8, 1)
    full = unlimited.estimated_bytes
    seen = set()
    for fraction in (1.5, 0.8, 0.6, 0.45, 0.35):
        plan = _plan(copy.deepcopy(tiny), full * fraction / GB)
        share = plan.batch_size
        # micro x accumulation covers the batch exactly once: the last micro-batch may be smaller, never missing
        assert plan.batch_size == 8
        assert plan.micro_batch_size * plan.grad_accum >= share > plan.micro_batch_size * (plan.grad_accum - 1)
        assert plan.estimated_bytes <= full * fraction * 0.9 or plan.micro_batch_size == 1
        seen.add((plan.micro_batch_size, plan.gradient_checkpointing))
        if plan.micro_batch_size < 8:
            assert any("effective batch stays 8" in c for c in plan.changes)
    assert len(seen) >= 3  # the budgets really moved the plan


def test_fsdp_plan_counts_one_process_shard_of_weights_and_adamw_states(tiny):
    from surefit.training.distributed import fsdp_blocks

    plain = _plan(copy.deepcopy(tiny), None, processes=2)
    sharded = _plan(copy.deepcopy(tiny), None, processes=2, sharding="fsdp")
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in fsdp_blocks(tiny))
    assert block > 0
    assert sharded.estimate["AdamW states"] == plain.estimate["AdamW states"] // 2
    # Half the weights, plus two blocks gathered whole (the one computing and the next one fetched ahead).
    assert sharded.estimate["weights"] == plain.estimate["weights"] // 2 + 2 * block
    assert sharded.estimate["gradients"] == plain.estimate["gradients"]  # unsharded while they accumulate
    # Writing a checkpoint: the main process holds its shard, not a copy of the whole state.
    assert sharded.checkpoint_host_bytes == plain.checkpoint_host_bytes // 2 > 0
    text = sharded.render()
    assert "per process (1/2 of the weights and AdamW states)" in text
    assert "each process writes its own shard of the weights and AdamW states" in text
    assert "checkpoint save" not in plain.render()  # unsharded runs print the plan as before


def test_planner_turns_on_checkpointing_when_that_keeps_a_larger_micro_batch(tiny):
    fp_plan = _plan(copy.deepcopy(tiny), None)
    parts = fp_plan.estimate
    # a budget that fits everything but the activations of more than ~one example
    fixed = parts["weights"] + parts["gradients"] + parts["AdamW states"]
    budget = (fixed + parts["activations"] / 8 * 1.5 + parts["logits"]) / 0.9 / GB
    plan = _plan(copy.deepcopy(tiny), budget)
    assert plan.gradient_checkpointing and plan.micro_batch_size >= 2
    assert any("checkpointing turned on" in c for c in plan.changes)
    assert "gradient checkpointing on" in plan.render()


def test_planner_refuses_when_one_example_cannot_fit_and_says_what_to_change(tiny):
    with pytest.raises(MemoryPlanError) as e:
        _plan(copy.deepcopy(tiny), 1e-6)
    text = e.value.render()
    assert "one example of 40 tokens does not fit" in text and "--gpu_memory_gb" in text
    assert "--max_seq_length" in text and "estimate" in text


def test_measured_probe_steps_down_until_it_fits_and_leaves_the_rng_alone(tiny):
    tried = []

    def probe(micro, ckpt):
        tried.append((micro, ckpt))
        torch.rand(100)  # a probe consumes random numbers (dropout); the planner must put them back
        if micro > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return 1000

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    plan = _plan(copy.deepcopy(tiny), 10.0, probe=probe)
    assert torch.equal(torch.rand(3), expected)
    assert tried[:3] == [(8, False), (4, False), (3, False)] and (plan.micro_batch_size, plan.grad_accum) == (2, 4)
    assert "peak" in plan.measured["how"] and plan.measured["peak_bytes"] >= 1000
    assert sum("measured out of memory" in c for c in plan.changes) == 3


def test_saved_activations_are_counted_exactly():
    lin = torch.nn.Linear(100, 50)
    x = torch.randn(4, 100)

    def forward():
        return torch.relu(lin(x)).sum()

    # linear saves its input (4 x 100) for the weight gradient; relu saves its output (4 x 50); parameters excluded
    assert measure_saved_bytes(lin, forward) == (4 * 100 + 4 * 50) * 4


def test_frozen_weights_in_bf16_compute_the_same_numbers_under_autocast_but_for_rounded_lookups(tiny):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    a = get_peft_model(copy.deepcopy(tiny), lora)
    torch.manual_seed(1)
    for n, p in a.named_parameters():
        if "lora_B" in n:
            p.data.normal_()  # nonzero adapters, so the LoRA branch takes part
    b = copy.deepcopy(a)
    saved = store_frozen_in(b, torch.bfloat16)
    assert saved > 0
    dtypes = {n: p.dtype for n, p in b.named_parameters()}
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16
    assert dtypes["base_model.model.model.embed_tokens.weight"] == torch.bfloat16
    assert all(d == torch.float32 for n, d in dtypes.items() if "lora_" in n or "norm" in n)
    ids = torch.randint(1, 64, (2, 12))
    assert b.get_input_embeddings()(ids).dtype == torch.float32  # lookups come out fp32: the residual stays fp32
    # The one change in numbers: embedding lookups rounded to bf16 (the Linear weights autocast rounds anyway).
    with torch.no_grad():
        emb = a.get_input_embeddings().weight
        emb.copy_(emb.to(torch.bfloat16).float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        la = a(input_ids=ids).logits.float()
        lb = b(input_ids=ids).logits.float()
    assert torch.equal(la, lb)


def test_a_planned_run_trains_the_same_weights_and_saves_its_plan(tiny_lm_dir, tmp_path):
    """End to end: a budget that halves the micro-batch gives the same training losses as no budget."""
    from conftest import qa_rows
    from surefit.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(30)), encoding="utf-8")

    def run(name, *extra):
        out = tmp_path / name
        argv = ["train", "--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1",
                "--augmentation_factor", "1", "--lora_r", "4", "--batch_size", "8", "--max_seq_length", "96",
                "--lr", "1e-2", "--val_fraction", "0.2", "--log_every", "1", "--output_dir", str(out),
                # dropout masks are drawn per micro-batch, so they differ when the step is cut differently
                "--lora_dropout", "0",
                # fp32: precision auto is bf16 for LoRA on CPUs with AVX-512 BF16, and bf16 rounding depends on
                # the micro-batch's padded shape; the plan's exactness is what is tested here
                "--precision", "fp32", *extra]
        assert main(argv) == 0
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return json.loads((out / "memory_plan.json").read_text()), [r["loss"] for r in steps if r["type"] == "step"]

    plan, losses = run("free")
    assert plan["micro_batch_size"] == 8 and plan["budget_gb"] is None
    parts = plan["estimate"]
    fixed = parts["weights"] + parts["gradients"] + parts["AdamW states"] + parts["logits"]
    budget = (fixed + parts["activations"] * 0.45) / 0.9 / GB  # room for less than half the activations
    tight, tight_losses = run("tight", "--gpu_memory_gb", f"{budget:.9f}")
    assert tight["micro_batch_size"] < 8 and tight["batch_size"] == 8
    assert tight["micro_batch_size"] * tight["grad_accum"] >= 8
    assert len(tight_losses) == len(losses) == math.ceil(24 / 8)
    assert max(abs(x - y) for x, y in zip(losses, tight_losses, strict=True)) < 1e-5


def test_lora_under_bf16_stores_frozen_weights_and_saved_activations_in_bf16_and_says_so(tiny):
    plan = _plan(tiny, None, precision="bf16", lora=True)
    assert plan.frozen_dtype == "bf16" and plan.saved_activations == "bf16"
    assert "frozen weights stored in bf16; activations saved in bf16" in plan.render()
    assert any(c.startswith("fp32 activations saved for the backward pass stored in bf16") for c in plan.changes)
    # fp16 runs: weights in fp16, saved fp32 activations in bf16 (fp16's range is too narrow for a residual stream)
    fp16 = _plan(tiny_llama(), None, precision="fp16", lora=True)
    assert fp16.frozen_dtype == "fp16" and fp16.saved_activations == "bf16"
    assert "frozen weights stored in fp16; activations saved in bf16" in fp16.render()
    assert any(c.startswith("fp32 activations saved for the backward pass stored in bf16") and "fp32's range" in c
               for c in fp16.changes)
    full = _plan(tiny_llama(), None, precision="bf16", lora=False)  # full fine-tuning: nothing stored differently
    assert full.frozen_dtype is None and full.saved_activations is None
    # The store is a speed-up the task hands in: without one the frozen weights are still stored in bf16, the
    # activations as autograd saves them.
    bare = _plan(tiny_llama(), None, precision="bf16", lora=True, work=_work(store=None))
    assert bare.frozen_dtype == "bf16" and bare.saved_activations is None
    assert "activations saved in bf16" not in bare.render()


def _file_backed(t: torch.Tensor) -> str | None:
    """The file whose memory mapping holds ``t``'s data (Linux), else None."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5] if len(parts) > 5 and parts[5].startswith("/") else None
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux memory maps")
def test_storing_frozen_weights_in_bf16_lets_go_of_the_checkpoint_file(tmp_path):
    """Weights load memory-mapped from safetensors; a fp32 tensor left in the file (a norm) would keep the whole file's
    pages resident on top of the 16-bit copies."""
    from transformers import LlamaForCausalLM

    tiny_llama().save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    model.requires_grad_(False)
    norm = model.model.norm.weight  # stays fp32: one tensor left in the file would keep all of it mapped
    before = norm.detach().clone()
    assert str(_file_backed(norm)).endswith("model.safetensors")  # what makes this test mean something
    assert store_frozen_in(model, torch.bfloat16) > 0
    assert model.model.norm.weight is norm and norm.dtype == torch.float32 and torch.equal(norm, before)
    assert all(_file_backed(t) is None for t in [*model.parameters(), *model.buffers()])


def test_a_tied_output_layer_in_bf16_saves_no_copy_of_the_table():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).requires_grad_(False)
    model.model.norm.weight.requires_grad_(True)  # something to backpropagate to

    def table_copies(m):
        shapes = []

        table = m.lm_head.weight.untyped_storage().data_ptr()

        def pack(t):
            if t.untyped_storage().data_ptr() != table:  # the table itself costs nothing more
                shapes.append(tuple(t.shape))
            return t.detach()

        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(input_ids=torch.randint(0, 96, (2, 8))).logits.float().sum()
        return shapes.count((96, 32)) + shapes.count((32, 96))

    assert table_copies(model) == 1  # autocast's 16-bit copy of the fp32 table, kept for the backward pass
    store_frozen_in(model, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dtype == torch.bfloat16
    assert table_copies(model) == 0  # the table itself is what is saved: no copy


def test_generation_batch_grows_to_the_cap_as_memory_allows_and_never_below_the_eval_batch():
    from conftest import tiny_llama
    from surefit.training.plan import GENERATE_ROWS, generation_batch

    model = tiny_llama().requires_grad_(False)  # frozen: the budget holds the weights only
    many = [40] * 100
    roomy = generation_batch(model, many, 4, budget_gb=10.0, mixed=False)
    assert (roomy.rows, roomy.prefill) == (GENERATE_ROWS, 4) and "KV cache per row" in roomy.why
    assert generation_batch(model, many[:10], 4, budget_gb=10.0, mixed=False).rows == 10  # no more rows than prompts
    assert generation_batch(model, many[:3], 4, budget_gb=10.0, mixed=False).rows == 4  # one batch: as asked
    # A budget the weights nearly fill leaves room for no extra rows: the evaluation batch the plan fitted stays.
    weights_gb = sum(p.numel() * 4 for p in model.parameters()) / 2**30
    assert generation_batch(model, many, 4, budget_gb=weights_gb * 1.02, mixed=False).rows == 4
    # 2 layers x 2 x 16 values x 4 bytes x 4,000 tokens, twice while stacking, + logits: 2.05 MB a row; 40 MiB of room: 20 rows
    budget = (weights_gb + 40 / 1024) / 0.9
    assert generation_batch(model, [4000] * 100, 4, budget_gb=budget, mixed=False).rows == 20
    assert generation_batch(model, many, 4, budget_gb=None, mixed=True).rows == GENERATE_ROWS  # a CPU's memory


@pytest.mark.parametrize("multiple", [None, "64", "32"])
def test_sft_batches_are_padded_to_the_multiple_the_memory_plan_prints(tmp_path, tiny_lm_dir, capsys, monkeypatch,
                                                                       multiple):
    """--pad_to_multiple_of N pads each training batch's length up to a multiple of N (fewer batch shapes); the plan
    says so and memory_plan.json records it; the batches the loss sees have that length. Off by default: batches are
    as long as their longest row, and the plan says nothing about it."""
    import surefit.tasks.sft.train_sft as sft
    from conftest import qa_rows
    from surefit.cli import main

    widths = []
    loss = sft.causal_lm_loss_sum

    def recording(model, batch, *a, **k):
        if model.training:  # the training loop's batches (the evaluation pads to its longest row)
            widths.append(batch["input_ids"].shape[1])
        return loss(model, batch, *a, **k)

    monkeypatch.setattr(sft, "causal_lm_loss_sum", recording)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(12)), encoding="utf-8")
    out = tmp_path / "run"
    extra = ["--pad_to_multiple_of", multiple] if multiple else []
    assert main(["train", "--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1",
                 "--lora_r", "4", "--batch_size", "4", "--max_seq_length", "96", "--val_fraction", "0.25",
                 "--eval_generate", "false", "--output_dir", str(out), *extra]) == 0
    printed = capsys.readouterr().out
    recorded = json.loads((out / "memory_plan.json").read_text())["pad_to_multiple_of"]
    if multiple is None:
        assert "batch lengths padded" not in printed and recorded is None
        assert widths and any(w % 64 for w in widths), widths  # the longest row's length (96 here), not padded to 64
        return
    want = int(multiple)
    assert f"batch lengths padded up to a multiple of {want} tokens" in printed and recorded == want
    assert widths and all(w % want == 0 for w in widths), widths
