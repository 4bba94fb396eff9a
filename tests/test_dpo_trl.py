"""Against TRL itself: on the same tiny model and pairs, surefit's per-pair chosen / rejected log-probabilities and its
first-step loss equal those of ``trl.DPOTrainer`` within 1e-5 in fp32, for the sigmoid and IPO losses.

The policy differs from the reference (its weights are perturbed), so the losses are not the trivial ln 2.
"""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="trl is not installed (pip install trl; the dev extra has it)")

PAIRS = [
    {"prompt": "the cat sat on the mat .\n\nQuestion: where did the cat sit ?\nAnswer:", "chosen": " mat",
     "rejected": " park"},
    {"prompt": "the dog ran to the park .\n\nQuestion: where did the dog run ?\nAnswer:", "chosen": " park",
     "rejected": " the tree near the river"},
    {"prompt": "Paris is the capital of France .\n\nQuestion: what is Paris ?\nAnswer:",
     "chosen": " the capital of France", "rejected": " a city"},
    {"prompt": "the bird flew over the tree .\n\nQuestion: what flew ?\nAnswer:", "chosen": " bird",
     "rejected": " the big red dog"},
]


def _models(folder):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return policy, ref


def _surefit(folder, kind):
    from transformers import AutoTokenizer

    from surefit.data.pairs import PairCollator, detect_pair_format, encode_pairs, to_pairs
    from surefit.data.rows import Row
    from surefit.training.preference import PreferenceLoss, sequence_logps

    tok = AutoTokenizer.from_pretrained(folder)
    rows = [Row(fields=p, where=f"line {i + 1}", index=i) for i, p in enumerate(PAIRS)]
    rows = to_pairs(rows, detect_pair_format(rows, "pairs"), "pairs", [])
    examples, _, failures, _ = encode_pairs(rows, tok, None, max_seq_length=256)
    assert not failures and len(examples) == len(PAIRS)
    policy, ref = _models(folder)
    collate = PairCollator(pad_token_id=tok.pad_token_id)
    batch = collate([e.features() for e in examples])
    with torch.no_grad():
        ref_logps, _ = sequence_logps(ref, batch)
    n = len(PAIRS)
    batch["reference_logps"] = torch.stack([ref_logps[:n], ref_logps[n:]], 1)
    scores = PreferenceLoss(kind, 0.1, "precomputed").score(policy, batch)
    return scores.chosen.detach(), scores.rejected.detach(), float(scores.losses.sum()) / n


def _trl(folder, kind, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(folder)
    policy, ref = _models(folder)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), loss_type=[kind], beta=0.1, per_device_train_batch_size=1,
                     report_to="none", use_cpu=True, bf16=False, fp16=False, max_length=256, seed=0)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(PAIRS),
                         processing_class=tok)
    ds = trainer.train_dataset
    chosen, rejected = [], []
    metrics = trainer._metrics["train"]
    trainer.model.train()
    for i in range(len(ds)):  # one pair per batch: the logged batch means are that pair's values
        inputs = trainer._prepare_inputs(trainer.data_collator([ds[i]]))
        with torch.no_grad():
            trainer.compute_loss(trainer.model, inputs)
        chosen.append(metrics["logps/chosen"][-1])
        rejected.append(metrics["logps/rejected"][-1])
    inputs = trainer._prepare_inputs(trainer.data_collator([ds[i] for i in range(len(ds))]))
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, inputs))
    return torch.tensor(chosen), torch.tensor(rejected), loss


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_per_pair_logps_and_first_step_loss_equal_trl_dpo_trainer(tiny_lm_dir, tmp_path, kind):
    s_chosen, s_rejected, s_loss = _surefit(tiny_lm_dir, kind)
    t_chosen, t_rejected, t_loss = _trl(tiny_lm_dir, kind, tmp_path)
    assert torch.allclose(s_chosen, t_chosen, atol=1e-5), (s_chosen, t_chosen)
    assert torch.allclose(s_rejected, t_rejected, atol=1e-5), (s_rejected, t_rejected)
    assert s_loss == pytest.approx(t_loss, abs=1e-5)
    assert abs(s_loss - 0.6931471805599453) > 1e-3 or kind != "sigmoid"  # a policy unlike its reference


def test_doctor_reads_a_trl_dpo_trainer_and_finds_pairs_its_truncation_breaks(tiny_lm_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from surefit.doctor.checks_dpo import check_dpo_trainer

    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    policy, ref = _models(tiny_lm_dir)
    prompt = PAIRS[2]["prompt"]
    # max_length leaves one answer token after the prompt: " the" for both answers of row 1
    rows = [{"prompt": prompt, "chosen": " a city", "rejected": " a city"},
            {"prompt": prompt, "chosen": " the capital of France", "rejected": " the city"},
            {"prompt": prompt, "chosen": " a", "rejected": " the"}]
    limit = len(tok(prompt)["input_ids"]) + 1
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False, max_length=limit)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tok)
    report = check_dpo_trainer(trainer)
    by = {f.code: f for f in report.findings}
    assert by["dpo-identical-pair"].where == "train_dataset rows 0"
    assert by["dpo-truncation-empties"].where == "train_dataset rows 1"
    assert by["dpo-terminator-masked"].where == "train_dataset rows 2"  # " a" / " the" kept, their EOS cut
    assert report.has_errors
