"""The evaluation before training (epoch 0) reused from the start-up cache (tasks/baseline_eval.py, docs/startup.md).

Whether the evaluation ran is counted (the task's evaluation function is wrapped, and every model forward inside it
counted), never timed. A reused epoch 0 must leave the run folder as a computed one does: the same epoch-0 record
(timings aside), the same predictions file, the same printed line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import surefit.startup.cache as startup_cache
import surefit.tasks.sft.train_sft as sft
from conftest import qa_rows
from surefit.cli import main
from surefit.tasks.baseline_eval import KIND, initial_state

TIMINGS = ("eval_seconds", "time")


@pytest.fixture()
def counted(monkeypatch):
    """Evaluations run (calls of sft's evaluate_examples) and the model forwards inside them."""
    calls = {"evaluations": 0, "forwards": 0}
    real = sft.evaluate_examples

    def counting(model, *a, **k):
        calls["evaluations"] += 1

        def hook(*_):
            calls["forwards"] += 1

        handle = model.register_forward_pre_hook(hook)
        try:
            return real(model, *a, **k)
        finally:
            handle.remove()

    monkeypatch.setattr(sft, "evaluate_examples", counting)
    return calls


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture()
def data(tmp_path):
    rows = qa_rows(20)
    return _write(tmp_path / "train.jsonl", rows[:14]), _write(tmp_path / "val.jsonl", rows[14:])


def _train(model: Path, data: tuple[Path, Path], out: Path, *extra: str) -> dict:
    argv = ["train", "--task", "sft", "--model", str(model), "--data", str(data[0]), "--val_data", str(data[1]),
            "--epochs", "1", "--lora_r", "4", "--batch_size", "4", "--max_seq_length", "96", "--output_dir", str(out),
            "--max_new_tokens", "3", *extra]
    assert main(argv) == 0
    return json.loads((out / "startup.json").read_text(encoding="utf-8"))


def _epoch0(out: Path) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    [first] = [r for r in records if r.get("type") == "epoch" and r["epoch"] == 0]
    return {k: v for k, v in first.items() if k not in TIMINGS}


def _epoch_line(text: str) -> str:
    [line] = [x for x in text.splitlines() if x.startswith("epoch 0/")]
    return line


def test_a_rerun_with_another_lr_seed_and_epochs_reuses_epoch_0_and_writes_the_same_files(tmp_path, tiny_lm_dir, data,
                                                                                          counted, capsys):
    first = _train(tiny_lm_dir, data, tmp_path / "a")
    computed_out = capsys.readouterr().out
    assert first["cache"][KIND] == "computed" and counted["evaluations"] == 2 and counted["forwards"] > 0
    counted.update(evaluations=0, forwards=0)
    second = _train(tiny_lm_dir, data, tmp_path / "b", "--lr", "1e-3", "--seed", "7", "--epochs", "2")
    reused_out = capsys.readouterr().out
    # epochs 1 and 2 evaluated; epoch 0 not: no forward ran for it
    assert second["cache"][KIND] == "reused" and counted["evaluations"] == 2
    assert "evaluation before training: reused from the start-up cache" in reused_out and "--no_cache" in reused_out
    assert _epoch0(tmp_path / "a") == _epoch0(tmp_path / "b")
    a, b = (p / "predictions" / "epoch_0.jsonl" for p in (tmp_path / "a", tmp_path / "b"))
    assert a.read_bytes() == b.read_bytes() and a.stat().st_size > 0
    # the printed line, epochs aside (the second run takes 2)
    assert _epoch_line(computed_out).replace("0/1", "0/2") == _epoch_line(reused_out)


def test_reused_epoch_0_without_generation_and_the_reuse_with_a_third_run(tmp_path, tiny_lm_dir, data, counted):
    _train(tiny_lm_dir, data, tmp_path / "a", "--eval_generate", "false")
    third = [_train(tiny_lm_dir, data, tmp_path / n, "--eval_generate", "false", "--lr", lr)["cache"]
             for n, lr in (("b", "1e-3"), ("c", "3e-4"))]
    assert [c[KIND] for c in third] == ["reused", "reused"]
    assert _epoch0(tmp_path / "a") == _epoch0(tmp_path / "c")
    assert not (tmp_path / "c" / "predictions" / "epoch_0.jsonl").exists()


def test_the_seed_does_not_change_epoch_0(tmp_path, tiny_lm_dir, data):
    """Verified, not assumed: LoRA's A is drawn from the seed, but B starts at zero, so the outputs are the base
    model's to the bit; computed twice without the cache, the records and predictions are the same."""
    for name, seed in (("a", "0"), ("b", "12345")):
        _train(tiny_lm_dir, data, tmp_path / name, "--no_cache", "--seed", seed)
    assert _epoch0(tmp_path / "a") == _epoch0(tmp_path / "b")
    a, b = (p / "predictions" / "epoch_0.jsonl" for p in (tmp_path / "a", tmp_path / "b"))
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("change", ["validation row", "max_new_tokens", "eval_batch_size", "metric", "model file",
                                    "no_cache", "lora_r"])
def test_anything_epoch_0_reads_changed_recomputes_it(tmp_path, tiny_lm_dir, data, counted, change):
    model = tmp_path / "model"
    shutil.copytree(tiny_lm_dir, model)
    _train(model, data, tmp_path / "a")
    counted.update(evaluations=0)
    extra: tuple[str, ...] = ()
    if change == "validation row":
        rows = [json.loads(x) for x in data[1].read_text(encoding="utf-8").splitlines()]
        rows[0]["target"] += " mat"
        _write(data[1], rows)
    elif change == "max_new_tokens":
        extra = ("--max_new_tokens", "4")
    elif change == "eval_batch_size":
        extra = ("--eval_batch_size", "3")
    elif change == "metric":
        extra = ("--metric", "rouge_l")
    elif change == "model file":
        from safetensors.torch import load_file, save_file

        weights = load_file(model / "model.safetensors")
        name = next(k for k in weights if k.endswith("norm.weight"))
        weights[name] = weights[name] * 1.5
        save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    elif change == "no_cache":
        extra = ("--no_cache",)
    else:
        extra = ("--lora_r", "8")
    second = _train(model, data, tmp_path / "b", *extra)
    assert counted["evaluations"] == 2
    assert second["cache"][KIND] == ("off" if change == "no_cache" else "computed")


@pytest.mark.parametrize("damage", ["not json", "edited metric", "not an evaluation"])
def test_a_damaged_entry_is_ignored_with_a_note_and_recomputed(tmp_path, tiny_lm_dir, data, counted, capsys, damage):
    _train(tiny_lm_dir, data, tmp_path / "a")
    [entry] = (startup_cache.cache_dir() / KIND).glob("*.json")
    stored = json.loads(entry.read_text(encoding="utf-8"))
    if damage == "not json":
        entry.write_bytes(b"\x80\x04garbage")  # e.g. a pickle: read as text, never unpickled
    elif damage == "edited metric":
        stored["value"]["metrics"]["eval_f1"] = 1.0  # the checksum no longer matches
        entry.write_text(json.dumps(stored), encoding="utf-8")
    else:
        stored["value"] = {"metrics": {"eval_f1": "high"}, "records": None}
        stored["check"] = startup_cache.digest(stored["value"])  # checksum recomputed, but not an evaluation
        entry.write_text(json.dumps(stored), encoding="utf-8")
    capsys.readouterr()
    counted.update(evaluations=0)
    record = _train(tiny_lm_dir, data, tmp_path / "b")
    out = capsys.readouterr()
    assert "note: ignored a" in out.out and "recomputing it" in out.out and "Traceback" not in out.out + out.err
    assert counted["evaluations"] == 2 and record["cache"][KIND] == "computed"
    assert _epoch0(tmp_path / "a") == _epoch0(tmp_path / "b")
    # rewritten whole: the next run reuses it
    assert _train(tiny_lm_dir, data, tmp_path / "c")["cache"][KIND] == "reused"


def test_the_initial_state_leaves_out_an_a_whose_b_is_zero_and_keeps_it_otherwise():
    from peft import LoraConfig, get_peft_model

    from conftest import tiny_llama

    def adapted(seed: int, b: float = 0.0):
        base = tiny_llama()  # the same base weights each time
        torch.manual_seed(seed)  # another A
        m = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.fill_(b)
        return m

    assert initial_state(adapted(0)) == initial_state(adapted(1))  # A differs, B is zero
    assert initial_state(adapted(0, 0.5)) != initial_state(adapted(1, 0.5))  # a warm start: A matters
    assert initial_state(adapted(0)) != initial_state(adapted(0, 0.5))


def _reused_twice(tmp_path: Path, argv: list[str], changed: list[str], capsys) -> tuple[dict, dict]:
    """Train with ``argv`` into a/ and with ``argv + changed`` into b/; both startup.json records."""
    records = []
    for name, extra in (("a", []), ("b", changed)):
        assert main([*argv, "--output_dir", str(tmp_path / name), *extra]) == 0
        records.append(json.loads((tmp_path / name / "startup.json").read_text(encoding="utf-8")))
    out = capsys.readouterr().out
    assert out.count("evaluation before training: reused from the start-up cache") == 1, [r["cache"] for r in records]
    return records[0], records[1]


@pytest.mark.parametrize("lora", ["0", "4"])
def test_classify_reuses_epoch_0_and_another_seed_draws_another_head(tmp_path, tiny_bert_dir, capsys, monkeypatch,
                                                                     lora):
    import surefit.tasks.classify.train_classify as classify
    from conftest import sentiment_rows, write_tsv

    calls = []
    real = classify.evaluate_features
    monkeypatch.setattr(classify, "evaluate_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    train, dev = write_tsv(tmp_path / "train.tsv", sentiment_rows(24)), write_tsv(tmp_path / "dev.tsv", sentiment_rows(8, template="the {filler} is really {word}"))
    argv = ["train", "--task", "classify", "--model", str(tiny_bert_dir), "--data", str(train), "--val_data", str(dev),
            "--epochs", "1", "--batch_size", "8", "--lora_r", lora]
    a, b = _reused_twice(tmp_path, argv, ["--lr", "1e-3", "--epochs", "2"], capsys)
    assert (a["cache"][KIND], b["cache"][KIND]) == ("computed", "reused") and len(calls) == 2 + 2  # a: epochs 0 and 1; b: epochs 1 and 2
    assert _epoch0(tmp_path / "a") == _epoch0(tmp_path / "b")
    assert (tmp_path / "a/predictions/epoch_0.jsonl").read_bytes() == (tmp_path / "b/predictions/epoch_0.jsonl").read_bytes()
    # The classifier's head is new, drawn from the seed: another seed is another model before training.
    assert main([*argv, "--output_dir", str(tmp_path / "c"), "--seed", "3"]) == 0
    assert json.loads((tmp_path / "c/startup.json").read_text(encoding="utf-8"))["cache"][KIND] == "computed"


def test_dpo_reuses_epoch_0(tmp_path, tiny_lm_dir, capsys):
    from test_dpo_run import write_pairs

    pairs = write_pairs(tmp_path / "pairs.jsonl", n=20)
    argv = ["train", "--task", "dpo", "--model", str(tiny_lm_dir), "--data", str(pairs), "--batch_size", "4",
            "--max_seq_length", "128", "--val_fraction", "0.2", "--precision", "fp32", "--lora_r", "4", "--epochs", "1"]
    a, b = _reused_twice(tmp_path, argv, ["--lr", "1e-3"], capsys)
    assert (a["cache"][KIND], b["cache"][KIND]) == ("computed", "reused")
    assert _epoch0(tmp_path / "a") == _epoch0(tmp_path / "b")
    assert (tmp_path / "a/predictions/epoch_0.jsonl").read_bytes() == (tmp_path / "b/predictions/epoch_0.jsonl").read_bytes()
    # --beta changes the loss epoch 0 reports
    assert main([*argv, "--output_dir", str(tmp_path / "c"), "--beta", "0.3"]) == 0
    assert json.loads((tmp_path / "c/startup.json").read_text(encoding="utf-8"))["cache"][KIND] == "computed"


def test_trainable_weights_above_the_hashing_cap_are_not_stored_and_say_so(tmp_path, tiny_lm_dir, data, counted,
                                                                         capsys, monkeypatch):
    """A full fine-tune of a large model would hash gigabytes on every run to find its epoch 0: above the cap the
    evaluation is computed each time (the tiny model stands in, with the cap lowered below its adapters' bytes)."""
    import surefit.tasks.baseline_eval as baseline_eval

    monkeypatch.setattr(baseline_eval, "MAX_HASHED_BYTES", 1024)
    statuses = [_train(tiny_lm_dir, data, tmp_path / n)["cache"][KIND] for n in ("a", "b")]
    out = capsys.readouterr().out
    assert statuses == ["not cacheable", "not cacheable"] and counted["evaluations"] == 4
    assert "not stored in the start-up cache" in out and "GiB of trainable weights" in out
