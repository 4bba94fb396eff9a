"""`surefit train --task dpo` end to end on a tiny local model: metrics each epoch (epoch 0 included), a final adapter
that plain peft loads, the precomputed reference stored with its data hashes, reused on resume and refused when the
data changed, and an exact resume."""

import json
import shutil

import pytest
import torch

from conftest import qa_rows
from surefit.cli import main

WRONG = ["park", "tree", "river", "city", "Berlin"]


def write_pairs(path, n=40, shift=0):
    rows = qa_rows(n)
    items = [{"prompt": r["input"] + "\nAnswer:", "chosen": " " + r["target"],
              "rejected": " " + WRONG[(i + shift) % len(WRONG)] + " " + r["target"] + " maybe"}
             for i, r in enumerate(rows)]
    path.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
    return path


def _train(tiny_lm_dir, data, out, *extra):
    argv = ["train", "--task", "dpo", "--model", str(tiny_lm_dir), "--data", str(data), "--output_dir", str(out),
            "--batch_size", "4", "--max_seq_length", "128", "--val_fraction", "0.2", "--precision", "fp32", *extra]
    return main(argv)


def _epochs(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if json.loads(x)["type"] == "epoch"]


@pytest.fixture(scope="module")
def lora_run(tiny_lm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    out = tmp / "run"
    assert _train(tiny_lm_dir, write_pairs(tmp / "pairs.jsonl"), out, "--lora_r", "8", "--lr", "2e-2",
                  "--epochs", "2") == 0
    return out


def test_lora_run_reports_preference_metrics_each_epoch_and_learns(lora_run):
    epochs = _epochs(lora_run)
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    keys = {"eval_loss", "eval_reward_accuracy", "eval_margin", "eval_logps_chosen", "eval_logps_rejected",
            "eval_ref_logps_chosen", "eval_ref_logps_rejected"}
    assert all(keys <= r.keys() for r in epochs)
    assert epochs[0]["eval_loss"] == pytest.approx(0.6931472, abs=1e-5)  # the reference is the starting policy
    assert epochs[-1]["eval_loss"] < epochs[0]["eval_loss"] - 0.05
    assert epochs[-1]["eval_reward_accuracy"] > epochs[0]["eval_reward_accuracy"]
    assert epochs[-1]["eval_ref_logps_chosen"] == pytest.approx(epochs[0]["eval_ref_logps_chosen"], abs=1e-4)
    record = json.loads((lora_run / "predictions/epoch_2.jsonl").read_text().splitlines()[0])
    assert {"where", "loss", "logps_chosen", "logps_rejected", "ref_logps_chosen", "margin", "correct"} <= record.keys()
    report = json.loads((lora_run / "data_report.json").read_text())
    assert report["format"] == "explicit_prompt" and report["train_rows"] + report["val_rows"] == 40


def test_finished_lora_run_loads_with_plain_peft_base_unchanged(lora_run, tiny_lm_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm_dir), lora_run / "final")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-5)
        with model.disable_adapter():
            assert torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-6)


def test_full_fine_tuning_stores_the_reference_reuses_it_on_resume_and_refuses_changed_data(tiny_lm_dir, tmp_path,
                                                                                           capsys):
    data = write_pairs(tmp_path / "pairs.jsonl", 24)
    out = tmp_path / "run"
    assert _train(tiny_lm_dir, data, out, "--lora_r", "0", "--lr", "1e-3", "--epochs", "2") == 0
    stored = json.loads((out / "reference_logps.json").read_text())
    assert set(stored["digests"]) == {"train", "validation"} and len(stored["train"]) + len(stored["validation"]) == 24
    assert "computed once before step 1" in capsys.readouterr().out
    final = {k: v.clone() for k, v in _safetensors(out / "final/model.safetensors").items()}

    # Resume from the first epoch's checkpoint in a copy: the same final model, the stored reference reused.
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "final")
    shutil.rmtree(copy / "checkpoints/epoch-2")
    (copy / "metrics.jsonl").write_text("".join(x + "\n" for x in (out / "metrics.jsonl").read_text().splitlines()
                                                if json.loads(x).get("epoch", 0) < 2 or json.loads(x)["type"] != "epoch"))
    assert _train(tiny_lm_dir, data, copy, "--lora_r", "0", "--lr", "1e-3", "--epochs", "2", "--resume",
                  str(copy / "checkpoints/epoch-1")) == 0
    said = capsys.readouterr().out
    assert "reference: the log-probabilities stored in" in said
    resumed = _safetensors(copy / "final/model.safetensors")
    for name, value in final.items():
        assert torch.equal(value, resumed[name]), name

    # The data changed: resuming would compare the policy with another data's reference.
    write_pairs(data, 24, shift=2)
    assert _train(tiny_lm_dir, data, copy, "--lora_r", "0", "--lr", "1e-3", "--epochs", "2", "--resume") != 0
    err = capsys.readouterr()
    assert "--allow_changed_data" in err.out + err.err  # every run's inputs are hashed: the general refusal first
    # Accepting changed data does not accept a stored reference computed on other pairs.
    assert _train(tiny_lm_dir, data, copy, "--lora_r", "0", "--lr", "1e-3", "--epochs", "2", "--resume",
                  "--allow_changed_data") != 0
    err = capsys.readouterr()
    text = err.out + err.err
    assert "differ from those whose reference log-probabilities this run computed" in text
    assert "resume with the data the run started with" in text


def _safetensors(path):
    from safetensors.torch import load_file

    return load_file(path)


def test_bad_pairs_are_refused_in_one_report_and_nothing_is_trained(tiny_lm_dir, tmp_path, capsys):
    path = tmp_path / "pairs.jsonl"
    items = [{"prompt": "Q: where?\nAnswer:", "chosen": " mat", "rejected": " park"}] * 6
    items += [{"prompt": "Q: who?\nAnswer:", "chosen": " cat", "rejected": " cat"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
    out = tmp_path / "run"
    assert _train(tiny_lm_dir, path, out) == 2
    text = capsys.readouterr().err
    assert "1 pair has chosen equal to rejected: line 7" in text and "--on_bad_rows skip" in text
    assert not (out / "final").exists()


def test_eval_rescores_the_held_out_pairs_as_the_last_epoch_did(lora_run):
    import surefit

    result = surefit.evaluate(str(lora_run), say=lambda s: None)
    last = _epochs(lora_run)[-1]
    assert result["task"] == "dpo" and result["rows"] == 8
    for key in ("eval_loss", "eval_reward_accuracy", "eval_margin", "eval_logps_chosen", "eval_ref_logps_rejected"):
        assert result["metrics"][key] == pytest.approx(last[key], abs=1e-4), key


def test_eval_of_another_pair_file_and_inspect_shows_both_sequences(lora_run, tiny_lm_dir, tmp_path, capsys):
    import surefit

    other = write_pairs(tmp_path / "other.jsonl", 6, shift=1)
    result = surefit.evaluate(str(lora_run), str(other), say=lambda s: None)
    assert result["rows"] == 6 and 0.0 <= result["metrics"]["eval_reward_accuracy"] <= 1.0
    out = tmp_path / "pairs_inspected.jsonl"
    assert main(["inspect", "--task", "dpo", "--model", str(tiny_lm_dir), "--data", str(other), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "chosen:   the" in said and "rejected: the" in said and "shared prompt" in said
    first = json.loads(out.read_text().splitlines()[0])
    p = first["prompt_len"]
    assert first["chosen"]["input_ids"][:p] == first["rejected"]["input_ids"][:p]
    assert first["chosen"]["text"].endswith("[[ " + qa_rows(6)[0]["target"] + "</s>]]")
    assert len(out.read_text().splitlines()) == 6


def test_skipped_pairs_are_listed_in_the_run_folder_and_counted_in_the_data_report(tiny_lm_dir, tmp_path):
    path = tmp_path / "pairs.jsonl"
    items = [{"prompt": f"Q{i}: where?\nAnswer:", "chosen": " mat", "rejected": " park"} for i in range(9)]
    items.insert(6, {"prompt": "Q: who?\nAnswer:", "chosen": " cat", "rejected": " cat"})
    path.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
    out = tmp_path / "run"
    assert _train(tiny_lm_dir, path, out, "--on_bad_rows", "skip", "--lora_r", "8") == 0
    [rejected] = [json.loads(x) for x in (out / "rejected_rows.jsonl").read_text().splitlines()]
    assert "line 7" in rejected["where"]
    report = json.loads((out / "data_report.json").read_text())
    assert report["rejected_rows"] == 1 and report["train_rows"] + report["val_rows"] == 9
