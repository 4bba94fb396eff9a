"""surefit eval / predict / export on tiny finished runs: numbers match training, outputs, and error reports."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import surefit
from conftest import qa_rows, sentiment_rows, write_tsv
from surefit.cli import main
from surefit.errors import ConfigError, SurefitError

REPO = Path(__file__).resolve().parents[1]


def _last_epoch(run: Path) -> dict:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"epoch"' in x][-1]


@pytest.fixture(scope="module")
def sft_run(tiny_lm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(32)), encoding="utf-8")
    out = tmp / "run"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(data), "--epochs", "1", "--lora_r", "8",
                 "--batch_size", "4", "--lr", "1e-2", "--val_fraction", "0.25", "--max_seq_length", "128",
                 "--output_dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def cls_run(tiny_bert_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cls")
    train = write_tsv(tmp / "train.tsv", sentiment_rows(64))
    dev = write_tsv(tmp / "dev.tsv", sentiment_rows(12, template="the {filler} is really {word}"))
    out = tmp / "run"
    assert main(["train", "--task", "classify", "--model", str(tiny_bert_dir), "--data", str(train), "--val_data",
                 str(dev), "--epochs", "8", "--batch_size", "8", "--lr", "3e-3", "--output_dir", str(out)]) == 0
    # 8 epochs: the tiny BERT learns the label word between epochs 4 and 6, depending on the order (tests/test_classify.py)
    return out


# ------------------------------------------------------------------------------------------------------------ sft


def test_sft_eval_reproduces_the_last_epoch_and_writes_json(sft_run, tmp_path, capsys):
    capsys.readouterr()
    assert main(["eval", "--run", str(sft_run), "--out", str(tmp_path / "eval.json"),
                 "--predictions", str(tmp_path / "p.jsonl")]) == 0
    table = capsys.readouterr().out
    assert "eval_f1" in table and "metrics.jsonl, epoch 1" in table
    result = json.loads((tmp_path / "eval.json").read_text())
    last = _last_epoch(sft_run)
    assert result["task"] == "sft" and result["rows"] == 8 and result["training"]["epoch"] == 1
    assert result["metrics"]["eval_loss"] == pytest.approx(last["eval_loss"], abs=1e-5)
    assert result["metrics"]["eval_f1"] == pytest.approx(last["eval_f1"], abs=1e-9)
    assert result["metrics"]["eval_em"] == pytest.approx(last["eval_em"], abs=1e-9)
    trained = [json.loads(x) for x in (sft_run / "predictions/epoch_1.jsonl").read_text().splitlines()]
    now = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["prediction"] for r in now] == [r["prediction"] for r in trained]


def test_sft_eval_generates_as_far_as_training_did_when_training_answers_are_longer(tiny_lm_dir, tmp_path, capsys):
    """Training caps generation at the longest validation answer + 4 tokens; ``surefit eval`` used the longest
    training target + 4, so a training set with a long answer made eval generate further and score another F1
    (seen on docs/outputs.md's command with --limit 40: 0.6458 against 0.6467)."""
    from surefit.tasks.sft import use_sft

    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    rows = qa_rows(16) + [{"input": "the cat sat .\n\nQuestion: tell the story ?",
                           "target": " ".join(["the cat sat on the mat near the dog"] * 4)}]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    val.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(20)[16:]), encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_lm_dir), "--data", str(train), "--val_data", str(val), "--epochs", "1",
                 "--lora_r", "4", "--batch_size", "4", "--lr", "1e-6", "--max_seq_length", "128",
                 "--eval_generate", "true", "--output_dir", str(out)]) == 0
    report = json.loads((out / "data_report.json").read_text())
    assert "longest_target\": 37" in json.dumps(report)  # the long training answer is there, in tokens
    caps = []
    real = use_sft.Generation

    def spy(*args, **kwargs):
        gen = real(*args, **kwargs)
        caps.append(gen.max_new_tokens)
        return gen

    use_sft.Generation = spy
    try:
        assert main(["eval", "--run", str(out), "--predictions", str(tmp_path / "p.jsonl")]) == 0
    finally:
        use_sft.Generation = real
    printed = capsys.readouterr().out
    # training's cap: "eval generates up to 8 tokens (the longest validation answer, 4 tokens with its terminator, + 4)"
    assert caps == [8], (caps, printed)
    trained = [json.loads(x)["prediction"] for x in (out / "predictions/epoch_1.jsonl").read_text().splitlines()]
    now = [json.loads(x)["prediction"] for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert now == trained and len(now) == 4


def test_sft_eval_json_to_stdout_and_on_another_file(sft_run, tmp_path, capsys):
    rows = qa_rows(40)[32:]
    data = tmp_path / "other.jsonl"
    data.write_text("".join(json.dumps({"question": r["input"], "answer": r["target"]}) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["eval", "--run", str(sft_run), "--data", str(data), "--json", "--input_field", "question",
                 "--target_field", "answer"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == 8 and result["training"] is None and result["data"] == str(data)
    assert set(result["metrics"]) == {"eval_loss", "eval_f1", "eval_em"} and result["metrics"]["eval_loss"] > 0
    # The run's own field names are the default: this file has other columns, reported with file and fix.
    assert main(["eval", "--run", str(sft_run), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"field 'input' not found in {data}" in err and "'question'" in err and "--input_field" in err


def test_sft_predict_streams_json_lines_with_the_run_prompt(sft_run, tmp_path, capsys):
    val = [json.loads(x) for x in (sft_run / "predictions/epoch_1.jsonl").read_text().splitlines()]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input": r["input"]}) + "\n" for r in val[:3]))
    capsys.readouterr()
    assert main(["predict", "--run", str(sft_run), "--file", str(rows), "--batch_size", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["where"] for r in lines] == [f"{rows} line {i}" for i in (1, 2, 3)]
    assert [r["input"] for r in lines] == [r["input"] for r in val[:3]]
    assert all(isinstance(r["prediction"], str) for r in lines)
    out = surefit.predict(sft_run, val[0]["input"], say=lambda *_: None)
    assert out[0]["where"] == "--input" and out[0]["prediction"] == lines[0]["prediction"]
    # --out: the same records in a file, one per line; collect=False keeps nothing in memory.
    assert surefit.predict(sft_run, [val[0]["input"], val[1]["input"]], out=tmp_path / "o/p.jsonl",
                           say=lambda *_: None, options=surefit.UseOptions(collect=False)) == []
    written = [json.loads(x) for x in (tmp_path / "o/p.jsonl").read_text().splitlines()]
    assert [r["where"] for r in written] == ["--input #1", "--input #2"]
    assert written[0]["prediction"] == lines[0]["prediction"]


def test_sft_predict_bad_rows_name_file_and_line(sft_run, tmp_path, capsys):
    rows = tmp_path / "bad.jsonl"
    rows.write_text('{"input": "the cat sat"}\n{"input": ""}\n{"text": "no input"}\n{"input": "cut\n')
    assert main(["predict", "--run", str(sft_run), "--file", str(rows)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "line 3" in err and "line 4" in err and str(rows) in err
    assert main(["predict", "--run", str(sft_run)]) == 2
    assert "give either --input TEXT or --file ROWS" in capsys.readouterr().err


def test_export_merge_gives_a_plain_model_with_the_same_logits(sft_run, tiny_lm_dir, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dest = tmp_path / "merged"
    assert main(["export", "--run", str(sft_run), "--merge", "--to", str(dest)]) == 0
    assert (dest / "model.safetensors").is_file() and (dest / "tokenizer.json").is_file()
    assert not (dest / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(dest).eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), sft_run / "final").eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, peft_model(input_ids=ids).logits
    assert (a - b).abs().max().item() <= 1e-5
    assert not torch.allclose(a, AutoModelForCausalLM.from_pretrained(tiny_lm_dir)(input_ids=ids).logits, atol=1e-3)

    # A non-empty folder is refused without --overwrite; with it, replaced.
    capsys.readouterr()
    assert main(["export", "--run", str(sft_run), "--to", str(dest)]) == 2
    err = capsys.readouterr().err
    assert f"{dest} is not empty" in err and "--overwrite" in err
    assert main(["export", "--run", str(sft_run), "--to", str(dest), "--overwrite"]) == 0
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in (sft_run / "final").iterdir())
    assert (dest / "adapter_model.safetensors").read_bytes() == (sft_run / "final/adapter_model.safetensors").read_bytes()
    assert main(["export", "--run", str(sft_run), "--to", str(sft_run / "final"), "--overwrite"]) == 2
    assert "would replace the run" in capsys.readouterr().err


def test_run_folder_problems_say_what_where_and_fix(sft_run, tmp_path, capsys):
    assert main(["eval", "--run", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["eval", "--run", str(sft_run / "final")]) == 2
    err = capsys.readouterr().err
    assert "has no config.yaml" in err and f"--run {sft_run}" in err
    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoints" / "epoch-1").mkdir(parents=True)
    shutil.copy(sft_run / "config.yaml", unfinished / "config.yaml")
    assert main(["predict", "--run", str(unfinished), "--input", "x"]) == 2
    err = capsys.readouterr().err
    assert "has no final/ folder" in err and "--resume" in err
    assert main(["eval", "--run", str(sft_run), "--text_field", "x"]) == 2
    assert "--text_field does not apply to a sft run" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------ classify


def test_classify_eval_matches_training_and_predict_gives_probabilities(cls_run, tmp_path, capsys):
    result = surefit.evaluate(cls_run, say=lambda *_: None)
    last = _last_epoch(cls_run)
    m = result["metrics"]
    assert result["rows"] == 12
    assert m["eval_accuracy"] == last["eval_accuracy"] and m["eval_confusion_matrix"] == last["eval_confusion_matrix"]
    assert m["eval_macro_f1"] == pytest.approx(last["eval_macro_f1"])
    assert m["eval_per_class_f1"] == pytest.approx(last["eval_per_class_f1"])
    assert m["eval_loss"] == pytest.approx(last["eval_loss"], abs=1e-6)
    # A setting of the other command would be ignored: refused, by name, before anything loads.
    with pytest.raises(ConfigError, match=r"UseOptions.stream applies to predict only") as e:
        surefit.evaluate(cls_run, options=surefit.UseOptions(stream=sys.stdout, batch_size=2))
    assert e.value.problems[0].where == "options.stream"
    with pytest.raises(ConfigError, match=r"UseOptions.show applies to evaluate only"):
        surefit.predict(cls_run, "x", options=surefit.UseOptions(show="json"))

    capsys.readouterr()
    assert main(["predict", "--run", str(cls_run), "--input", "the movie was very great", "--input",
                 "the plot was very awful"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["label"] for r in recs] == ["pos", "neg"]
    for r in recs:
        assert set(r["probabilities"]) == {"neg", "pos"} and sum(r["probabilities"].values()) == pytest.approx(1, abs=1e-5)
        assert r["probabilities"][r["label"]] > 0.5


def test_classify_eval_on_a_file_checks_columns_and_labels(cls_run, tmp_path, capsys):
    good = write_tsv(tmp_path / "good.tsv", sentiment_rows(8, template="a {filler} was very {word}"))
    result = surefit.evaluate(cls_run, str(good), say=lambda *_: None)
    assert result["rows"] == 8 and len(result["metrics"]["eval_confusion_matrix"]) == 2
    wrong = write_tsv(tmp_path / "wrong.tsv", [{"review": "the film was good", "label": "pos"}])
    assert main(["eval", "--run", str(cls_run), "--data", str(wrong)]) == 2
    err = capsys.readouterr().err
    assert f"field 'sentence' not found in {wrong}" in err and "'review'" in err and "--text_field" in err
    unseen = write_tsv(tmp_path / "unseen.tsv", [{"sentence": "the film was good", "label": "pos"},
                                                 {"sentence": "the film was dull", "label": "meh"}])
    assert main(["eval", "--run", str(cls_run), "--data", str(unseen)]) == 2
    err = capsys.readouterr().err
    assert "line 3 ('meh')" in err and "'neg', 'pos'" in err


def test_classify_export_loads_with_plain_transformers_and_labels(cls_run, tmp_path):
    from transformers import AutoModelForSequenceClassification

    dest = surefit.export(cls_run, tmp_path / "cls", merge=True, say=lambda *_: None)
    model = AutoModelForSequenceClassification.from_pretrained(dest)
    assert model.config.id2label == {0: "neg", 1: "pos"} and model.config.label2id == {"neg": 0, "pos": 1}


# ------------------------------------------------------------------------------------------------------------ custom


def test_custom_eval_reproduces_the_validation_loss(tmp_path):
    import subprocess
    import sys

    subprocess.run([sys.executable, str(REPO / "examples/custom/make_shards.py"), "--out", str(tmp_path / "d"),
                    "--vocab", "11", "--train", "64", "--val", "16", "--shard_rows", "32"], check=True,
                   capture_output=True)
    out = tmp_path / "run"
    surefit.train(task="custom", model=str(REPO / "examples/custom/projection_model.py") + ":build",
                  model_args='{"vocab": 11, "hidden": 16}', data=str(tmp_path / "d/train"), epochs=1, batch_size=16,
                  output_dir=str(out))
    # A custom run's model factory is code: eval runs it only when asked (a run folder is data).
    result = surefit.evaluate(out, say=lambda *_: None, allow_code=True)
    assert result["rows"] == 6  # val_fraction 0.1 of 64, split by index as training did
    assert result["metrics"]["eval_loss"] == pytest.approx(_last_epoch(out)["eval_loss"], abs=1e-6)
    other = surefit.evaluate(out, str(tmp_path / "d/val"), say=lambda *_: None, allow_code=True)
    assert other["rows"] == 16 and other["metrics"]["eval_loss"] > 0
    with pytest.raises(SurefitError, match="custom-task run"):
        surefit.predict(out, "x", allow_code=True)
