"""Out of memory loses no example: injected OOMs end with the same weights and the same examples seen."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import OneProcess, qa_rows, sentiment_rows, write_tsv
from surefit.cli import main
from surefit.data.collate import PadCollator
from surefit.training.loop import StepPlan, accumulate_step, evaluate_loss
from surefit.training.memory import OOMGuard
from surefit.training.work import TrainingWork


def _epochs(out):
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == "epoch"]


def test_sft_with_injected_ooms_ends_with_the_same_weights(tmp_path, tiny_lm_dir, monkeypatch, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    args = ["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2", "--batch_size", "8",
            "--lr", "1e-2", "--lora_dropout", "0", "--max_seq_length", "128",
            # fp32: with LoRA, precision auto is bf16 on CPUs with AVX-512 BF16, whose rounding depends on the
            # micro-batch's padded shape; this test is about the recovery, not about the rounding
            "--precision", "fp32"]
    assert main([*args, "--output_dir", str(tmp_path / "plain")]) == 0
    monkeypatch.setenv("SUREFIT_INJECT_OOM", "2,5,9")
    assert main([*args, "--output_dir", str(tmp_path / "oom")]) == 0
    said = capsys.readouterr().out
    assert said.count("out of memory on a micro-batch of") == 3
    a = load_file(tmp_path / "plain" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "oom" / "final" / "adapter_model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    plain, oom = _epochs(tmp_path / "plain"), _epochs(tmp_path / "oom")
    assert [r.get("examples_seen") for r in plain] == [r.get("examples_seen") for r in oom] == [None, 36, 36]
    assert [r["oom_splits"] for r in oom[1:]] == [3, 3] and [r["oom_splits"] for r in plain[1:]] == [0, 0]


def test_classification_with_injected_ooms_ends_with_the_same_weights(tmp_path, tiny_bert_dir, monkeypatch):
    model = tmp_path / "bert"
    shutil.copytree(tiny_bert_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # dropout masks depend on batch shapes
    (model / "config.json").write_text(json.dumps(cfg))
    train = write_tsv(tmp_path / "train.tsv", sentiment_rows(32))
    dev = write_tsv(tmp_path / "dev.tsv", sentiment_rows(8, template="the {filler} is really {word}"))
    args = ["train", "--task", "classify", "--model", str(model), "--data", str(train), "--val_data", str(dev),
            "--epochs", "1", "--batch_size", "16", "--lr", "3e-3"]
    assert main([*args, "--output_dir", str(tmp_path / "plain")]) == 0
    monkeypatch.setenv("SUREFIT_INJECT_OOM", "1,4")
    assert main([*args, "--output_dir", str(tmp_path / "oom")]) == 0
    a = load_file(tmp_path / "plain" / "final" / "model.safetensors")
    b = load_file(tmp_path / "oom" / "final" / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert _epochs(tmp_path / "oom")[-1]["examples_seen"] == _epochs(tmp_path / "plain")[-1]["examples_seen"] == 32




def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    feats = [{"input_ids": [i % 5 + 1] * (3 + i % 4), "labels": [1.0] * (3 + i % 4)} for i in range(8)]
    seen = []

    def loss_fn(m, batch):
        seen.append(batch["input_ids"].shape[0])
        if batch["input_ids"].shape[0] > 2:  # a device that fits at most 2 of these examples
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        x = torch.nn.functional.one_hot(batch["input_ids"][:, 0], 6)[:, 1:5].float()
        return m(x).pow(2).sum(), batch["input_ids"].shape[0]

    return model, feats, loss_fn, seen


def test_smaller_micro_batch_is_kept_for_later_batches_of_that_size():
    model, feats, loss_fn, seen = _setup()
    lengths = [len(f["input_ids"]) for f in feats]
    guard = OOMGuard(inject=set())
    work = TrainingWork([{"input_ids": f["input_ids"]} for f in feats], lengths, [1] * 8,
                        collate=PadCollator(0, stack_keys=()), loss_fn=loss_fn)
    how = StepPlan(8, guard=guard, say=lambda *_: None)
    accumulate_step(model, work, list(range(8)), OneProcess(), how)
    first = list(seen)
    assert max(first[-4:]) <= 2 and guard.splits == 3  # 8 -> 4+4 -> 2+2(+2+2)
    seen.clear()
    accumulate_step(model, work, list(range(8)), OneProcess(), how)
    assert max(seen) <= 2 and guard.splits == 3  # no second out-of-memory: split before trying


def test_evaluation_oom_shrinks_only_the_evaluation_batch():
    model, feats, loss_fn, seen = _setup()
    said = []
    feats = [{"input_ids": f["input_ids"]} for f in feats]
    lengths = [len(f["input_ids"]) for f in feats]
    value = evaluate_loss(model, feats, lengths, loss_fn=loss_fn, collate=PadCollator(0), batch_size=8,
                          accelerator=OneProcess(), say=said.append)
    reference = evaluate_loss(model, feats, lengths, loss_fn=loss_fn, collate=PadCollator(0), batch_size=2,
                              accelerator=OneProcess(), say=said.append)
    assert value == pytest.approx(reference)
    assert said == ["out of memory during evaluation: retrying with batch size 4 (training is unaffected)",
                    "out of memory during evaluation: retrying with batch size 2 (training is unaffected)"]


def test_oom_on_a_single_example_is_a_clear_error(tmp_path, tiny_lm_dir, monkeypatch, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(12)), encoding="utf-8")
    monkeypatch.setenv("SUREFIT_INJECT_OOM", "1")
    code = main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--batch_size", "1", "--epochs", "1",
                 "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not fit in memory" in err and "--max_seq_length" in err and "--gradient_checkpointing" in err


def _sft_pair(tmp_path, tiny_lm_dir, monkeypatch, rows, extra, inject="2,5,9"):
    """The same sft run twice, plainly and with injected out-of-memory errors; the two final adapters and losses."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    args = ["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2", "--batch_size", "8",
            "--lr", "1e-2", "--max_seq_length", "256", "--log_every", "1", *extra]
    monkeypatch.delenv("SUREFIT_INJECT_OOM", raising=False)
    assert main([*args, "--output_dir", str(tmp_path / "plain")]) == 0
    monkeypatch.setenv("SUREFIT_INJECT_OOM", inject)
    assert main([*args, "--output_dir", str(tmp_path / "oom")]) == 0
    out = []
    for name in ("plain", "oom"):
        records = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        out.append((load_file(tmp_path / name / "final" / "adapter_model.safetensors"),
                    [r["loss"] for r in records if r["type"] == "step"], records))
    (a, la, _), (b, lb, rb) = out
    assert [r.get("oom_splits") for r in rb if r["type"] == "epoch"][-1] == len(inject.split(","))
    return max(float((a[k] - b[k]).abs().max()) for k in a), max(abs(x - y) for x, y in zip(la, lb, strict=True))


def test_sft_with_lora_dropout_and_injected_ooms_ends_with_the_same_weights(tmp_path, tiny_lm_dir, monkeypatch):
    # Dropout masks are keyed by (seed, step, example, layer, position, feature), so the split step draws the same
    # ones; in fp32 what is left is the order of additions, amplified by Adam at lr 1e-2 for weights whose gradients
    # are near zero: 6e-7 with dropout 0, 3e-7 to 1.2e-6 measured with 0.1 (torch's masks: 6e-2), losses 4e-7.
    weights, losses = _sft_pair(tmp_path, tiny_lm_dir, monkeypatch, qa_rows(40),
                                ["--lora_dropout", "0.1", "--precision", "fp32"])
    assert weights <= 5e-6 and losses <= 2e-6


def test_sft_with_shared_prefixes_lora_dropout_and_injected_ooms_ends_with_the_same_weights(tmp_path, tiny_lm_dir,
                                                                                           monkeypatch):
    # Groups of rows share a 40+ token context, computed once per micro-batch (--share_prefixes, the default); a split
    # regroups the rows, and their masks there are keyed by the tokens, so they do not change. The losses agree to
    # fp32 rounding (6e-7: a shared layout attends through a 4D mask, a lone row through the causal kernel); Adam at
    # lr 1e-2 amplifies that for weights whose gradients are near zero (4e-6 measured with dropout 0, 2e-5 with 0.1;
    # torch's masks: 1e-2 and more).
    context = " ".join(["the cat sat on the mat near the river"] * 5)
    rows = [{"input": f"{context} .\n\nQuestion: where did the {w} sit ?", "target": w}
            for w in ("dog", "bird", "cat", "Paris", "city", "tree", "park", "river")] * 4
    rows = [dict(r, input=f"{i // 8} {r['input']}") for i, r in enumerate(rows)]  # 4 contexts, 8 questions each
    weights, losses = _sft_pair(tmp_path, tiny_lm_dir, monkeypatch, rows, ["--lora_dropout", "0.1", "--precision",
                                                                           "fp32"], inject="1,3")
    assert weights <= 1e-4 and losses <= 1e-5


def test_sft_under_bf16_with_lora_dropout_and_injected_ooms_stays_within_the_measured_bound(tmp_path, tiny_lm_dir,
                                                                                            monkeypatch):
    # bf16 autocast: the same masks, adapter gradients summed in fp32; what is left comes from kernels whose rounding
    # depends on the micro-batch's shape (benchmarks/results/oom_split_drift.md measures it on the embedded model).
    # Measured on this tiny model over two seeds: weights 2e-4 and 7e-4, losses 2e-4 and 3e-4; with torch's masks
    # (before) 6e-3 and 3e-3 to 7e-3.
    weights, losses = _sft_pair(tmp_path, tiny_lm_dir, monkeypatch, qa_rows(40),
                                ["--lora_dropout", "0.1", "--precision", "bf16", "--lr", "1e-3"])
    assert weights <= 2e-3 and losses <= 1e-3


def test_classification_with_hidden_dropout_and_injected_ooms_ends_with_the_same_weights(tmp_path, tiny_bert_dir,
                                                                                       monkeypatch):
    # The model's own nn.Dropout modules (BERT's hidden and classifier dropout) draw keyed masks too; attention
    # dropout happens inside the attention kernel, which takes a probability, not a module: it stays torch's.
    model = tmp_path / "bert"
    shutil.copytree(tiny_bert_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.0)
    (model / "config.json").write_text(json.dumps(cfg))
    train = write_tsv(tmp_path / "train.tsv", sentiment_rows(32))
    dev = write_tsv(tmp_path / "dev.tsv", sentiment_rows(8, template="the {filler} is really {word}"))
    args = ["train", "--task", "classify", "--model", str(model), "--data", str(train), "--val_data", str(dev),
            "--epochs", "1", "--batch_size", "16", "--lr", "3e-3"]
    monkeypatch.delenv("SUREFIT_INJECT_OOM", raising=False)
    assert main([*args, "--output_dir", str(tmp_path / "plain")]) == 0
    monkeypatch.setenv("SUREFIT_INJECT_OOM", "1,4")
    assert main([*args, "--output_dir", str(tmp_path / "oom")]) == 0
    a = load_file(tmp_path / "plain" / "final" / "model.safetensors")
    b = load_file(tmp_path / "oom" / "final" / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
