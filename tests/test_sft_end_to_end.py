"""One real CLI run on a tiny local model, and the bad-input reports. CPU, seconds."""

import json

import pytest
import torch

from surefit.cli import main


@pytest.fixture(scope="module")
def run_dir(tiny_lm_dir, tmp_path_factory):
    from conftest import qa_rows

    tmp = tmp_path_factory.mktemp("e2e")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)), encoding="utf-8")
    out = tmp / "run"
    argv = ["train", "--task", "sft", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "2",
            "--augmentation_factor", "2", "--lora_r", "8", "--batch_size", "4", "--grad-accum", "2",
            "--max_seq_length", "128", "--lr", "1e-2", "--val_fraction", "0.2", "--log_every", "2", "--output_dir", str(out)]
    assert main(argv) == 0
    return out


def test_cli_run_writes_every_output(run_dir):
    for name in ["config.yaml", "metrics.jsonl", "data_report.json", "predictions/epoch_0.jsonl",
                 "predictions/epoch_1.jsonl", "predictions/epoch_2.jsonl", "final/adapter_model.safetensors",
                 "final/adapter_config.json", "final/tokenizer.json", "checkpoints/epoch-1/model/adapter_model.safetensors",
                 "checkpoints/epoch-1/manifest.json", "checkpoints/epoch-1/trainable.safetensors", "checkpoints/epoch-1/rng.pt",
                 "checkpoints/epoch-2/optimizer.pt", "checkpoints/epoch-2/trainer_state.json"]:
        assert (run_dir / name).is_file(), name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    assert all({"eval_loss", "eval_f1", "eval_em"} <= r.keys() for r in epochs)
    assert all("train_loss" in r and r["train_loss"] > 0 for r in epochs[1:])
    assert any(r["type"] == "step" for r in records)
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report["val_rows"] == 8 and report["train_rows"] == 64  # 32 train rows x augmentation 2
    pred = json.loads((run_dir / "predictions/epoch_2.jsonl").read_text().splitlines()[0])
    assert {"where", "input", "gold", "prediction", "f1", "em"} <= pred.keys()


def test_training_lowers_validation_loss(run_dir):
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["eval_loss"] for r in epochs if r["type"] == "epoch"]
    assert losses[-1] < losses[0]


def test_lora_base_weights_unchanged_adapter_changed_and_loads_with_plain_peft(run_dir, tiny_lm_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base_before = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), run_dir / "final")
    for name, p in base_before.named_parameters():
        peft_name = "base_model.model." + name.replace(".weight", ".base_layer.weight")
        merged = dict(model.named_parameters())
        q = merged.get(peft_name, merged.get("base_model.model." + name))
        assert torch.equal(p, q), name
    adapter = load_file(run_dir / "final" / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)  # B starts at zero: nonzero means it trained


def test_no_validation_row_or_variant_of_it_in_training(run_dir):
    from surefit.config import SFTConfig, build_config
    from surefit.data.split import normalize_key
    from surefit.tasks.sft import load_data

    cfg = build_config(SFTConfig, {**json.loads(json.dumps(__import__("yaml").safe_load((run_dir / "config.yaml").read_text())))}, None)
    train, val, _ = load_data(cfg, say=lambda *_: None)
    val_keys = {normalize_key(r.fields["input"]) for r in val}
    val_where = {r.where for r in val}
    assert len(train) == 64 and len(val) == 8
    for r in train:
        assert normalize_key(r.fields["input"]) not in val_keys
        assert r.where.split(" (variant")[0] not in val_where
    variants = [r for r in train if r.variant_of is not None]
    assert len(variants) == 32


def _write(path, lines):
    path.write_bytes(b"".join(lines))


def test_bad_input_one_report_exit_2_nothing_trained(tmp_path, tiny_lm_dir, capsys):
    train = tmp_path / "train.jsonl"
    _write(train, [b'{"input": "a", "target": "b"}\n', b'{"input": "c", "answer": "d"}\n', b'{"input": "e", "target": null}\n',
                   b'{"input": "f", "target": ""}\n', b'{"input": "caf\xe9", "target": "x"}\n'])
    val = tmp_path / "val.csv"
    val.write_text("question,answer\nq,a\n")
    out = tmp_path / "run"
    code = main(["train", "--model", str(tiny_lm_dir), "--data", str(train), "--val_data", str(val), "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "data error" in err
    assert "line 5" in err and "UTF-8" in err  # non-UTF-8 bytes, with the line
    assert "val.csv" in err and "--input_field" in err and "--target_field" in err  # missing fields in the other file
    assert not (out / "final").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("name,content,expected", [
    ("missing.jsonl", None, "file not found"),
    ("data.xlsx", b"PK", "Parquet"),
    ("empty.jsonl", b"", "no rows"),
])
def test_missing_unknown_and_empty_files_are_reported(tmp_path, tiny_lm_dir, capsys, name, content, expected):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(path), "--output_dir", str(tmp_path / "o")]) == 2
    assert expected in capsys.readouterr().err


def test_python_api_returns_history_and_honours_keep_checkpoints(tmp_path, tiny_lm_dir, qa_jsonl):
    import surefit

    result = surefit.train({"task": "sft", "data": str(qa_jsonl)}, model=str(tiny_lm_dir), epochs=3, batch_size=8,
                           lr=1e-2, keep_checkpoints=1, output_dir=str(tmp_path / "api"))
    assert [r["epoch"] for r in result.history] == [0, 1, 2, 3]
    assert result.final_dir == tmp_path / "api" / "final" and (result.final_dir / "adapter_config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "api" / "checkpoints").iterdir()) == ["epoch-3"]  # --keep_checkpoints 1
    assert result.data_report["train_rows"] + result.data_report["val_rows"] == 24


def test_hub_id_that_cannot_be_reached_says_so(tmp_path, qa_jsonl, capsys, monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE at import; without this the test waits ~45 s on network retries.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["train", "--model", "no-such-owner/no-such-model", "--data", str(qa_jsonl),
                 "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "'no-such-owner/no-such-model' is not a local file or folder" in err and "--model" in err


def test_a_previous_run_is_not_replaced_without_overwrite(run_dir, tiny_lm_dir, qa_jsonl, capsys):
    before = (run_dir / "metrics.jsonl").read_text()
    argv = ["train", "--model", str(tiny_lm_dir), "--data", str(qa_jsonl), "--epochs", "1", "--output_dir", str(run_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite" in err
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_on_bad_rows_skip_trains_on_the_good_rows_and_lists_the_rejected(tmp_path, tiny_lm_dir):
    import surefit
    from conftest import qa_rows

    good = [json.dumps(r) for r in qa_rows(20)]
    bad = ['{"input": "truncated', '{"input": "x", "target": null}', '[1, 2]', '{"input": "a", "input": "b", "target": "c"}']
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(good[:10] + bad + good[10:]) + "\n", encoding="utf-8")
    result = surefit.train(task="sft", model=str(tiny_lm_dir), data=str(data), on_bad_rows="skip", epochs=1,
                           output_dir=str(tmp_path / "run"))
    rejected = [json.loads(x) for x in (tmp_path / "run" / "rejected_rows.jsonl").read_text().splitlines()]
    assert sorted(r["where"] for r in rejected) == sorted(f"{data} line {n}" for n in (11, 12, 13, 14))
    assert result.data_report["rejected_rows"] == 4
    assert result.data_report["train_rows"] + result.data_report["val_rows"] == 20

    # --overwrite of that run: the new run's list is written while its data is read, before the previous run's files
    # are removed; it must survive that removal (it once did not: the message pointed at a deleted file).
    data.write_text("\n".join(good[:10] + bad[:2] + good[10:]) + "\n", encoding="utf-8")
    again = surefit.train(task="sft", model=str(tiny_lm_dir), data=str(data), on_bad_rows="skip", epochs=1,
                          output_dir=str(tmp_path / "run"), overwrite=True)
    rejected = [json.loads(x) for x in (tmp_path / "run" / "rejected_rows.jsonl").read_text().splitlines()]
    assert sorted(r["where"] for r in rejected) == [f"{data} line 11", f"{data} line 12"]
    assert again.data_report["rejected_rows"] == 2


def test_gradient_checkpointing_with_lora_trains_the_same(tmp_path, tiny_lm_dir, qa_jsonl):
    import surefit

    # fp32: under bf16 (precision auto on CPUs with AVX-512 BF16) activations saved for the backward pass are
    # stored in bf16 without checkpointing and recomputed in fp32 with it, so the gradients differ by rounding
    common = dict(task="sft", model=str(tiny_lm_dir), data=str(qa_jsonl), epochs=1, lr=1e-2, lora_dropout=0.0,
                  precision="fp32")
    on = surefit.train(gradient_checkpointing=True, output_dir=str(tmp_path / "on"), **common)
    off = surefit.train(output_dir=str(tmp_path / "off"), **common)
    assert on.history[-1]["train_loss"] == pytest.approx(off.history[-1]["train_loss"], abs=1e-5)
    assert on.history[-1]["eval_loss"] == pytest.approx(off.history[-1]["eval_loss"], abs=1e-5)


def test_shared_prompt_prefixes_train_the_same_and_are_reported(tmp_path, tiny_lm_dir, qa_jsonl, capsys):
    """The default template is 30-odd tokens with the tiny tokenizer: every micro-batch shares it. Without dropout
    (with it, rows of a group share the prefix's masks) the run equals one that computes every row in full."""
    import surefit

    common = dict(task="sft", model=str(tiny_lm_dir), data=str(qa_jsonl), epochs=1, lr=1e-2, lora_dropout=0.0,
                  precision="fp32")
    shared = surefit.train(output_dir=str(tmp_path / "shared"), **common)
    said = capsys.readouterr().out
    full = surefit.train(share_prefixes=False, output_dir=str(tmp_path / "full"), **common)
    assert full.history[-1]["train_loss"] == pytest.approx(shared.history[-1]["train_loss"], abs=1e-5)
    assert full.history[-1]["eval_loss"] == pytest.approx(shared.history[-1]["eval_loss"], abs=1e-5)
    record = shared.history[-1]
    assert record["shared_prefix_rows"] > 0 and record["shared_prefix_tokens"] > 0
    assert "shared_prefix_rows" not in full.history[-1]
    assert (f"epoch 1: {record['shared_prefix_rows']} rows reused a prompt prefix computed once for another row of "
            f"their micro-batch ({record['shared_prefix_tokens']:,} of ") in said
    logged = [json.loads(line) for line in (tmp_path / "shared" / "metrics.jsonl").read_text().splitlines()]
    assert [r["shared_prefix_tokens"] for r in logged if r["type"] == "epoch" and r["epoch"] == 1] == [
        record["shared_prefix_tokens"]]


def test_metric_names_printed_and_stored_are_the_ones_computed(tmp_path, tiny_lm_dir, qa_jsonl, capsys):
    """--eval_generate false prints no metric that is not computed; a rouge_l run stores rouge_l per row, not f1."""
    base = ["train", "--model", str(tiny_lm_dir), "--data", str(qa_jsonl), "--epochs", "1", "--batch_size", "8",
            "--max_seq_length", "128"]
    assert main([*base, "--eval_generate", "false", "--output_dir", str(tmp_path / "loss")]) == 0
    out = capsys.readouterr().out
    assert "metrics: squad" not in out and "metrics: eval_loss only (--eval_generate false" in out
    assert main([*base, "--metric", "rouge_l", "--output_dir", str(tmp_path / "rouge")]) == 0
    assert "metrics: rouge_l" in capsys.readouterr().out
    pred = json.loads((tmp_path / "rouge" / "predictions" / "epoch_1.jsonl").read_text().splitlines()[0])
    assert "rouge_l" in pred and "em" in pred and "f1" not in pred, pred


def test_long_validation_answers_are_scored_by_loss_by_default_and_generated_when_asked(tmp_path, tiny_lm_dir,
                                                                                      capsys):
    """--eval_generate's default: answers longer than GENERATE_AUTO_TOKENS are not generated (the run says why and
    how to turn it on); --eval_generate true and --max_new_tokens generate them; short answers are generated."""
    from conftest import qa_rows
    from surefit.tasks.sft.train_sft import GENERATE_AUTO_TOKENS, generates

    rows = [{"input": r["input"], "target": " ".join([r["target"]] * 100)} for r in qa_rows(16)]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    base = ["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--batch_size", "8",
            "--max_seq_length", "256", "--val_fraction", "0.25", "--lora_r", "4"]
    assert main([*base, "--output_dir", str(tmp_path / "auto")]) == 0
    out = capsys.readouterr().out
    assert "eval computes the validation loss only (the validation answers run to" in out
    assert f"above the {GENERATE_AUTO_TOKENS} the default generates: --eval_generate true" in out
    assert "metrics: eval_loss only (answers of" in out and "generating:" not in out
    assert not (tmp_path / "auto" / "predictions").exists()
    epochs = [json.loads(x) for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert [sorted(k for k in r if k.startswith("eval_") and k != "eval_seconds") for r in epochs
            if r["type"] == "epoch"] == [["eval_loss"], ["eval_loss"]]
    # surefit eval on that run is asked for scores: it generates them (the default resolves to true outside training)
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "auto"), "--json"]) == 0
    assert {"eval_loss", "eval_f1", "eval_em"} <= set(json.loads(capsys.readouterr().out)["metrics"])
    assert main([*base, "--eval_generate", "true", "--output_dir", str(tmp_path / "on")]) == 0
    out = capsys.readouterr().out
    assert "eval generates up to" in out and (tmp_path / "on" / "predictions" / "epoch_1.jsonl").is_file()
    # the rule itself: asked wins; --max_new_tokens means generate; short answers generate
    assert generates(None, None, GENERATE_AUTO_TOKENS + 1)[0] is False
    assert generates(None, 8, GENERATE_AUTO_TOKENS + 1) == (True, "")
    assert generates(None, None, GENERATE_AUTO_TOKENS) == (True, "")
    assert generates(False, None, 3) == (False, "--eval_generate false")
    assert generates(True, None, 10_000) == (True, "")
