"""Out of memory loses no example: injected OOMs end with the same weights and the same examples seen."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import OneProcess, qa_rows, sentiment_rows, write_tsv
from surefit.cli import main
from surefit.data.collate import PadCollator
from surefit.training.loop import accumulate_step, evaluate_loss
from surefit.training.memory import OOMGuard


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
    kw = dict(micro_batch_size=8, loss_fn=loss_fn, collate=PadCollator(0, stack_keys=()), accelerator=OneProcess(),
              guard=guard, say=lambda *_: None)
    accumulate_step(model, [{"input_ids": f["input_ids"]} for f in feats], list(range(8)), lengths, [1] * 8, **kw)
    first = list(seen)
    assert max(first[-4:]) <= 2 and guard.splits == 3  # 8 -> 4+4 -> 2+2(+2+2)
    seen.clear()
    accumulate_step(model, [{"input_ids": f["input_ids"]} for f in feats], list(range(8)), lengths, [1] * 8, **kw)
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
