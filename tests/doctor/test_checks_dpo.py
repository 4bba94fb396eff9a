"""The dpo checks through their real entry points: ``check_dpo_trainer`` on a real ``trl.DPOTrainer`` built on a tiny
model, and ``surefit doctor --task dpo`` (``check_pairs`` on the pairs and model the dpo task prepares). Each code has
a broken case that produces it and a healthy twin that does not.

The encoded pairs of ``--task dpo`` cannot hold identical answers (refused), trained prompt tokens (labels -100 over
the prompt by construction) or an emptied prompt (excluded): those codes come from TRL setups only."""

import importlib.util
import json
import shutil

import pytest
import torch

from conftest import build_tiny_lm
from surefit.cli import main

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                               reason="trl is not installed (pip install trl; the dev extra has it)")

PROMPT = "Paris is the capital of France .\n\nQuestion: what is Paris ?\nAnswer:"


def _trainer(folder, tmp_path, rows, ref="copy", model=None, **args):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(folder)
    model = model if model is not None else AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if ref == "copy":
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False, **args)
    return DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=Dataset.from_list(rows),
                      processing_class=tok)


def _report(trainer):
    from surefit.doctor.checks_dpo import check_dpo_trainer

    return check_dpo_trainer(trainer)


def _prompt_len(folder):
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"])


@needs_trl
def test_identical_answers_are_found_and_different_ones_pass(tiny_lm_dir, tmp_path):
    rows = [{"prompt": PROMPT, "chosen": " the capital", "rejected": " a city"},
            {"prompt": PROMPT, "chosen": " a city", "rejected": " a city"}]
    broken = _report(_trainer(tiny_lm_dir, tmp_path, rows, max_length=256))
    assert [(f.code, f.where) for f in broken.findings] == [("dpo-identical-pair", "train_dataset rows 1")]
    assert broken.has_errors
    healthy = _report(_trainer(tiny_lm_dir, tmp_path, rows[:1], max_length=256))
    assert "dpo-identical-pair" not in healthy.codes() and not healthy.findings


@needs_trl
def test_truncation_that_leaves_two_identical_answers_is_found_and_enough_room_passes(tiny_lm_dir, tmp_path):
    # one answer token fits after the prompt: " the" for both answers
    rows = [{"prompt": PROMPT, "chosen": " the capital of France", "rejected": " the city"}]
    limit = _prompt_len(tiny_lm_dir) + 1
    broken = _report(_trainer(tiny_lm_dir, tmp_path, rows, max_length=limit))
    found = {f.code: f for f in broken.findings}
    assert found["dpo-truncation-empties"].where == "train_dataset rows 0"
    assert f"max_length={limit}" in found["dpo-truncation-empties"].message
    healthy = _report(_trainer(tiny_lm_dir, tmp_path, rows, max_length=limit + 20))
    assert "dpo-truncation-empties" not in healthy.codes()


@needs_trl
def test_an_answer_cut_before_its_eos_is_found_and_a_whole_one_passes(tiny_lm_dir, tmp_path):
    rows = [{"prompt": PROMPT, "chosen": " a", "rejected": " the"}]
    limit = _prompt_len(tiny_lm_dir) + 1  # the answer's first token fits, its EOS does not
    broken = _report(_trainer(tiny_lm_dir, tmp_path, rows, max_length=limit))
    assert [(f.code, f.severity) for f in broken.findings] == [("dpo-terminator-masked", "warning")]
    healthy = _report(_trainer(tiny_lm_dir, tmp_path, rows, max_length=limit + 2))
    assert "dpo-terminator-masked" not in healthy.codes()


@needs_trl
def test_keep_end_truncation_that_drops_the_whole_prompt_is_found_and_a_fitting_pair_passes(tiny_lm_dir, tmp_path):
    rows = [{"prompt": PROMPT, "chosen": " the capital of France and a city of the river", "rejected": " a city"}]
    trainer = _trainer(tiny_lm_dir, tmp_path, rows, max_length=6, truncation_mode="keep_end")
    answer = len(trainer.train_dataset[0]["chosen_ids"])
    assert answer >= 6  # what TRL's collator keeps is the answer's end alone
    found = {f.code: f for f in _report(trainer).findings}
    assert found["dpo-prompt-emptied"].where == "train_dataset rows 0"
    assert "keep_end" in found["dpo-prompt-emptied"].message
    healthy = _report(_trainer(tiny_lm_dir, tmp_path, rows, max_length=256, truncation_mode="keep_end"))
    assert healthy.findings == []


@needs_trl
def test_a_ref_model_that_get_peft_model_wrapped_in_place_is_found_and_a_separate_one_passes(tiny_lm_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rows = [{"prompt": PROMPT, "chosen": " the capital", "rejected": " a city"}]
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32)
    policy = get_peft_model(base, lora)  # injects the LoRA layers into `base` itself
    broken = _report(_trainer(tiny_lm_dir, tmp_path, rows, ref=base, model=policy, max_length=256))
    assert [f.code for f in broken.findings] == ["dpo-reference-is-policy"] and broken.has_errors
    assert broken.findings[0].where == "ref_model"
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_lm_dir, dtype=torch.float32), lora)
    healthy = _report(_trainer(tiny_lm_dir, tmp_path, rows, model=policy, max_length=256))
    assert healthy.findings == []


def _pairs(path):
    items = [{"prompt": f"the {w} sat on the mat .\nQuestion: where did the {w} sit ?\nAnswer:", "chosen": " mat",
              "rejected": " park"} for w in ("cat", "dog", "bird", "red", "big", "small")]
    path.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
    return path


def _doctor(model, data, out, *extra):
    return main(["doctor", "--task", "dpo", "--model", str(model), "--data", str(data), "--output_dir", str(out),
                 "--lora_r", "0", "--batch_size", "2", "--max_seq_length", "64", "--val_fraction", "0.34",
                 "--precision", "fp32", *extra])


def test_a_stored_reference_of_another_model_fails_the_step0_loss_and_its_own_passes(tiny_lm_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from surefit.config.dpo_config import DPOConfig
    from surefit.tasks.dpo.train_dpo import REFERENCE_FILE, prepare

    data = _pairs(tmp_path / "pairs.jsonl")
    out = tmp_path / "run"
    cfg = DPOConfig(model=str(tiny_lm_dir), data=str(data), output_dir=str(out), lora_r=0, batch_size=2,
                    max_seq_length=64, val_fraction=0.34, precision="fp32")
    stored = prepare(cfg, say=lambda s: None).found.files[REFERENCE_FILE]  # what a full fine-tuning run stores
    out.mkdir()
    (out / REFERENCE_FILE).write_text(json.dumps(stored), encoding="utf-8")

    # The same model resumes with its own stored reference: the loss before step 1 is ln 2.
    assert _doctor(tiny_lm_dir, data, out, "--resume") == 0
    said = capsys.readouterr().out
    assert "reference: the log-probabilities stored in" in said and "dpo-step0-loss" not in said

    # Another model (same tokenizer, so the pairs' hashes match) resumes on that reference: not its starting policy.
    other = tmp_path / "other"
    shutil.copytree(tiny_lm_dir, other)
    build_tiny_lm(AutoTokenizer.from_pretrained(tiny_lm_dir), seed=1).save_pretrained(other)
    assert _doctor(other, data, out, "--resume") == 1
    said = capsys.readouterr().out
    assert "[dpo-step0-loss]" in said and "not ln 2 = 0.693147" in said
