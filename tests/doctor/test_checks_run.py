"""The run checks (workers, empty splits, leakage, fp16 weights, memory), healthy setups end to end, the broken
examples, explain() and check_trainer()."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import build_bert_tokenizer, build_tiny_lm, build_tokenizer, qa_rows, sentiment_rows
from surefit.doctor import check, check_trainer, explain

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def lm(tok):
    return build_tiny_lm(tok)


def features(tok, n: int = 8) -> list[dict]:
    """Tokenized causal-LM rows with labels, all the same length per row."""
    out = []
    for r in qa_rows(n):
        ids = tok(r["input"] + " " + r["target"])["input_ids"] + [tok.eos_token_id]
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def pad_collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    """A module-level collator: picklable."""
    from surefit.data.collate import PadCollator

    return PadCollator(pad_token_id=0)(batch)


class TinyClassifier(nn.Module):
    def __init__(self, features: int = 8, classes: int = 3):
        super().__init__()
        self.proj = nn.Linear(features, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, inputs_embeds: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(torch.relu(self.proj(inputs_embeds)).mean(1))
        return {"logits": logits, **({"loss": F.cross_entropy(logits, labels)} if labels is not None else {})}


def tensor_rows(n: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"inputs_embeds": torch.randn(6, 8, generator=g), "labels": torch.tensor(i % 3)} for i in range(n)]


class FileDataset(torch.utils.data.Dataset):
    """Holds an open file handle: fine in one process, unpicklable for spawned workers."""

    def __init__(self, path: Path):
        self.rows = tensor_rows(4)
        self.fh = open(path, "w", encoding="utf-8")  # noqa: SIM115 - the bug under test

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def findings(report, code: str):
    return [f for f in report.findings if f.code == code]


# ----------------------------------------------------------------------------------------- unpicklable-worker-data


def test_lambda_collator_with_spawned_workers_is_an_error(tok, lm):
    report = check(lm, tok, features(tok), data_collator=lambda b: pad_collate(b),
                   args={"batch_size": 4, "num_workers": 2, "multiprocessing_context": "spawn"})
    (f,) = findings(report, "unpicklable-worker-data")
    assert f.severity == "error" and f.where == "data_collator"
    assert "<lambda>" in f.message and "num_workers=2" in f.message and "'spawn'" in f.message
    assert "module-level" in f.fix and "num_workers 0" in f.fix


def test_local_function_with_fork_is_only_a_warning(tok, lm):
    def collate(batch):
        return pad_collate(batch)

    report = check(lm, tok, features(tok), data_collator=collate,
                   args={"batch_size": 4, "num_workers": 2, "multiprocessing_context": "fork"})
    (f,) = findings(report, "unpicklable-worker-data")
    assert f.severity == "warning"
    assert "local object" in f.message and "collate" in f.message and "'spawn' or 'forkserver'" in f.message


def test_open_file_in_dataset_names_the_attribute(tmp_path):
    ds = FileDataset(tmp_path / "log.txt")
    try:
        report = check(TinyClassifier(), train_dataset=ds,
                       args={"batch_size": 4, "num_workers": 1, "multiprocessing_context": "forkserver"})
    finally:
        ds.fh.close()
    (f,) = findings(report, "unpicklable-worker-data")
    assert f.where == "train_dataset.fh" and "TextIOWrapper" in f.message


@pytest.mark.parametrize("collator,workers", [(pad_collate, 2), (lambda b: pad_collate(b), 0)])
def test_picklable_collator_or_no_workers_is_healthy(tok, lm, collator, workers):
    report = check(lm, tok, features(tok), data_collator=collator,
                   args={"batch_size": 4, "num_workers": workers, "multiprocessing_context": "spawn"})
    assert not findings(report, "unpicklable-worker-data")


# --------------------------------------------------------------------------------------------------- empty-dataset


def test_empty_splits_are_named():
    import datasets

    empty = datasets.Dataset.from_list([{"sentence": "x", "label": 0}]).filter(lambda r: False)
    report = check(TinyClassifier(), train_dataset=empty, eval_dataset=[], task="custom")
    got = {f.where: f for f in findings(report, "empty-dataset")}
    assert set(got) == {"train_dataset", "eval_dataset"}
    assert all(f.severity == "error" and "0 rows" in f.message for f in got.values())
    assert "zero steps" in got["train_dataset"].message


def test_non_empty_splits_are_healthy():
    report = check(TinyClassifier(), train_dataset=tensor_rows(), eval_dataset=tensor_rows(2), task="custom")
    assert not findings(report, "empty-dataset")


# --------------------------------------------------------------------------------------------------- split-leakage


def _sentences(start: int, n: int) -> list[dict]:
    return [{"sentence": f"sentence number {i} about the {['cat', 'dog', 'bird'][i % 3]}", "label": i % 2}
            for i in range(start, start + n)]


def test_leaked_rows_are_counted_with_indices():
    train = _sentences(0, 40)
    leaked = [{"sentence": "  Sentence NUMBER 7 about   the DOG ", "label": 1}, dict(train[12]), dict(train[30])]
    eval_rows = _sentences(100, 7) + leaked
    report = check(TinyClassifier(), train_dataset=train, eval_dataset=eval_rows, task="custom")
    (f,) = findings(report, "split-leakage")
    assert f.severity == "error" and f.where == "eval_dataset"
    assert "3 of 10 rows (30.0%)" in f.message and "eval rows 7, 8, 9" in f.message
    assert "eval row 7 = train row 7" in f.message and "'sentence'" in f.message


def test_a_single_leak_in_a_big_eval_set_is_a_warning():
    import datasets

    train = datasets.Dataset.from_list(_sentences(0, 300))
    ev = datasets.Dataset.from_list(_sentences(1000, 199) + [_sentences(5, 1)[0]])
    (f,) = findings(check(TinyClassifier(), train_dataset=train, eval_dataset=ev, task="custom"), "split-leakage")
    assert f.severity == "warning" and "1 of 200 rows (0.5%)" in f.message and "eval rows 199" in f.message


def test_leak_found_through_decoded_input_ids(tok, lm):
    rows = features(tok, 12)
    report = check(lm, tok, rows[:8], eval_dataset=rows[6:], args={"batch_size": 4})
    (f,) = findings(report, "split-leakage")
    assert "decoded input_ids" in f.message and "2 of 6 rows" in f.message and "eval rows 0, 1" in f.message


def test_disjoint_splits_are_healthy(tok, lm):
    assert not findings(check(TinyClassifier(), train_dataset=_sentences(0, 20), eval_dataset=_sentences(20, 20),
                              task="custom"), "split-leakage")
    rows = features(tok, 12)
    assert not findings(check(lm, tok, rows[:8], eval_dataset=rows[8:], args={"batch_size": 4}), "split-leakage")


# --------------------------------------------------------------------------------------------- fp16-master-weights


def test_half_model_under_fp16_is_an_error():
    model = TinyClassifier().half()
    report = check(model, train_dataset=tensor_rows(), args={"fp16": True, "batch_size": 4}, task="custom")
    (f,) = findings(report, "fp16-master-weights")
    assert f.severity == "error" and "Attempting to unscale FP16 gradients" in f.message
    assert "4 trainable parameters" in f.message and f.where == "proj.weight" and "float32" in f.fix


def test_fp32_model_under_fp16_is_healthy():
    model = TinyClassifier()
    report = check(model, train_dataset=tensor_rows(), args={"fp16": True, "batch_size": 4}, task="custom")
    assert not findings(report, "fp16-master-weights")


# ---------------------------------------------------------------------------------------------- memory-over-budget


def test_over_budget_shows_every_part(tok, lm):
    report = check(lm, tok, features(tok), args={"batch_size": 4, "memory_gb": 1e-05})
    (f,) = findings(report, "memory-over-budget")
    assert f.severity == "error" and "memory_gb=1e-05" in f.message
    for part in ("weights", "gradients", "AdamW states", "activations", "logits", "hidden 32 x 2 layers"):
        assert part in f.message
    n = sum(p.numel() for p in lm.parameters())
    assert f"weights {n * 4 / 2**30:.2g} GB" in f.message
    assert "gradient checkpointing" in f.fix and "LoRA" in f.fix and "accumulation" in f.fix


def test_the_doctor_sizes_activations_with_the_planners_estimator(tok, lm):
    """One memory estimator: `surefit train`'s planner and the doctor give the same bytes per token."""
    from surefit.training.plan import analytic_act_per_token
    from surefit.units import human_bytes

    (f,) = findings(check(lm, tok, features(tok), args={"batch_size": 4, "memory_gb": 1e-05}), "memory-over-budget")
    assert f"tokens x {human_bytes(analytic_act_per_token(lm, False))} a token" in f.message


def test_custom_model_activations_are_measured():
    report = check(TinyClassifier(), train_dataset=tensor_rows(), args={"batch_size": 4, "memory_gb": 1e-7},
                   task="custom")
    (f,) = findings(report, "memory-over-budget")
    assert "layer outputs of one forward" in f.message and "logits" not in f.message


def test_big_budget_is_healthy(tok, lm):
    assert not findings(check(lm, tok, features(tok), args={"batch_size": 4, "memory_gb": 80}), "memory-over-budget")


# --------------------------------------------------------------------------------------- healthy setups, all codes

# Codes whose checks (owned elsewhere) raise a false alarm on a healthy setup: code -> reason. Empty when none do.
FALSE_ALARMS: dict[str, str] = {}


def assert_no_errors(report) -> None:
    errors = [f for f in report.findings if f.severity == "error"]
    real = [f for f in errors if f.code not in FALSE_ALARMS]
    assert not real, str(report)
    if errors:
        pytest.xfail("; ".join(f"{f.code}: {FALSE_ALARMS[f.code]}" for f in errors))


def test_healthy_sft_pipeline(tok, lm):
    from surefit.data.collate import PadCollator
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.rows import Row

    tok.padding_side = "left"
    try:
        rows = [Row(fields=r, where=f"row {i}", index=i) for i, r in enumerate(qa_rows(24))]
        examples, _ = encode_rows(rows, tok, build_prompt_format(tok), max_seq_length=128)
        data = [e.features() for e in examples]
        report = check(lm, tok, data[:16], data[16:], PadCollator(pad_token_id=tok.pad_token_id),
                       args={"batch_size": 4, "generation": True}, task="sft")
    finally:
        tok.padding_side = "right"
    assert_no_errors(report)


def test_healthy_classifier():
    from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding

    btok = build_bert_tokenizer()
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=len(btok), hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=64,
                                                     max_position_embeddings=64, num_labels=2))
    rows = [dict(btok(r["sentence"]), label=int(r["label"] == "pos")) for r in sentiment_rows(40)]
    report = check(model, btok, rows[:24], rows[24:], DataCollatorWithPadding(btok), args={"batch_size": 4},
                   task="classify")
    assert_no_errors(report)


def test_healthy_custom():
    report = check(TinyClassifier(), train_dataset=tensor_rows(), eval_dataset=tensor_rows(4),
                   args={"batch_size": 4}, task="custom")
    assert_no_errors(report)


# ----------------------------------------------------------------------------------------------- broken examples

EXAMPLES = {"seq_labels_not_padded.py": "labels-not-padded", "projection_mismatch.py": "input-dim-mismatch",
            "classifier_idx_column.py": "unexpected-columns", "mlm_collator_classifier.py": "label-shape"}


@pytest.fixture(scope="module", autouse=True)
def example_runs(request):
    """The selected examples, started when this module starts so they run while the other tests do (each is
    mostly import time, one thread each); each example test then waits for its own."""
    selected = [n for n in EXAMPLES if any(f"[{n}-" in item.name for item in request.session.items)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen([sys.executable, str(ROOT / "examples" / "broken" / name)], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name in selected}
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("name,code", list(EXAMPLES.items()))
def test_broken_example_names_the_cause(example_runs, name, code):
    proc = example_runs[name]
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "1. one training step, raw:" in out and "(no error)" not in out
    assert f"[{code}]" in out.split("2. surefit.doctor.check(...):")[1].split("3. explain")[0], out
    assert f"3. explain(error, ...): [{code}]" in out


# --------------------------------------------------------------------------------------------- explain, trainer


def test_explain_oom_without_setup():
    f = explain(RuntimeError("CUDA out of memory. Tried to allocate 1.50 GiB"))
    assert f.code == "memory-over-budget"


def test_explain_pickling_error_uses_the_check(tok, lm):
    collate = lambda b: pad_collate(b)  # noqa: E731 - the bug under test
    exc = pickle.PicklingError("Can't pickle <function <lambda>>: attribute lookup <lambda> on __main__ failed")
    f = explain(exc, lm, tok, features(tok), data_collator=collate, args={"batch_size": 4, "num_workers": 2})
    assert f.code == "unpicklable-worker-data" and f.where == "data_collator" and "num_workers=2" in f.message


def test_check_trainer_reads_workers_and_collator(tmp_path, tok, lm):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             dataloader_num_workers=2)
    trainer = Trainer(model=lm, args=args, train_dataset=features(tok), data_collator=lambda b: pad_collate(b))
    report = check_trainer(trainer)
    (f,) = findings(report, "unpicklable-worker-data")
    assert f.where == "data_collator" and "num_workers=2" in f.message
