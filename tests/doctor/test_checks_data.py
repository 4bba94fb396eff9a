"""The data checks: each broken setup is caught under its code, and its healthy twin is silent (and error-free)."""

from __future__ import annotations

import pytest
import torch

from conftest import WORDS, build_bert_tokenizer, build_tiny_lm, build_tokenizer, qa_rows, sentiment_rows
from surefit.data.collate import PadCollator
from surefit.doctor import check, explain

# ------------------------------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def tok():
    """pad == eos, like SmolLM2 and many Llama-family tokenizers."""
    return build_tokenizer()


@pytest.fixture(scope="module")
def tok_pad():
    """A distinct pad token."""
    return build_tokenizer(pad_is_eos=False)


@pytest.fixture(scope="module")
def bert_tok():
    return build_bert_tokenizer()


def _texts(n: int = 6) -> list[str]:
    return [" ".join(WORDS[i: i + 3 + 2 * i]) for i in range(n)]  # 3, 5, 7, ... words: variable lengths


def _lm_rows(tok, n: int = 6, eos: bool = True, labels: bool = True, mask_prompt: int = 0) -> list[dict]:
    rows = []
    for text in _texts(n):
        ids = tok(text)["input_ids"] + ([tok.eos_token_id] if eos else [])
        row = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if labels:
            row["labels"] = [-100] * mask_prompt + ids[mask_prompt:]
        rows.append(row)
    return rows


def _classifier(bert_tok, num_labels: int = 2, problem_type: str | None = None):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=num_labels, problem_type=problem_type))


def _cls_rows(bert_tok, labels: list) -> list[dict]:
    rows = sentiment_rows(len(labels))
    return [dict(bert_tok(r["sentence"]), label=lab) for r, lab in zip(rows, labels, strict=True)]


def _finding(report, code):
    found = [f for f in report.findings if f.code == code]
    assert found, f"{code} not reported:\n{report}"
    return found[0]


def _healthy(report, code):
    assert code not in report.codes(), str(report)
    assert not report.has_errors, str(report)


# ---------------------------------------------------------------------------------------------- labels-not-padded


def _seed_dataset(tok):
    import datasets

    def tokenize(row):
        ids = tok(row["text"])["input_ids"] + [tok.eos_token_id]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)}

    return datasets.Dataset.from_list([{"text": t} for t in _texts(6)]).map(tokenize, remove_columns=["text"])


def test_seed_lm_collator_with_prebuilt_ragged_labels(tok):
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    ds, model = _seed_dataset(tok), build_tiny_lm(tok)
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    report = check(model, tok, ds, data_collator=collator)
    f = _finding(report, "labels-not-padded")
    assert f.severity == "error"
    assert "DataCollatorForLanguageModeling" in f.message and "`labels`" in f.message
    assert "discarding a prompt mask" in f.message
    assert "DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)" in f.fix and "PadCollator" in f.fix
    assert "collate-failed" not in report.codes() and "ragged-batch" not in report.codes()

    explained = explain(ValueError("expected sequence of length 432 at dim 1 (got 512)"), model=model,
                        train_dataset=ds, data_collator=collator)
    assert explained.code == "labels-not-padded" and "DataCollatorForLanguageModeling" in explained.message

    _healthy(check(model, tok, ds, data_collator=DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)),
             "labels-not-padded")


def test_padding_collator_with_token_labels(tok):
    from transformers import DataCollatorWithPadding

    model = build_tiny_lm(tok)
    f = _finding(check(model, tok, _lm_rows(tok), data_collator=DataCollatorWithPadding(tok)), "labels-not-padded")
    assert "DataCollatorWithPadding" in f.message and "`labels`" in f.message
    _healthy(check(model, tok, _lm_rows(tok), data_collator=PadCollator(tok.pad_token_id)), "labels-not-padded")


def test_ragged_labels_beyond_the_sampled_rows(tok):
    from transformers import DataCollatorForLanguageModeling

    rows = _lm_rows(tok)
    rows = [rows[5]] * 4 + rows[:2]  # the sampled rows (first three + longest) agree; rows 4 and 5 do not
    f = _finding(check(build_tiny_lm(tok), tok, rows, data_collator=DataCollatorForLanguageModeling(tok, mlm=False)),
                 "labels-not-padded")
    assert "row 4: 4 tokens, row 0: 15" in f.message


def test_labels_built_before_padding_input_ids(tok_pad):
    from transformers import DataCollatorForLanguageModeling

    rows = []
    for r in _lm_rows(tok_pad):  # input_ids padded to max_length by the tokenizer, labels built from the unpadded ids
        n = len(r["input_ids"])
        rows.append({"input_ids": r["input_ids"] + [tok_pad.pad_token_id] * (16 - n),
                     "attention_mask": [1] * n + [0] * (16 - n), "labels": r["labels"]})
    f = _finding(check(build_tiny_lm(tok_pad), tok_pad, rows,
                       data_collator=DataCollatorForLanguageModeling(tok_pad, mlm=False)), "labels-not-padded")
    assert "for 16 input_ids" in f.message and "one entry per input token" in f.fix


def test_lm_collator_discards_prompt_mask(tok_pad):
    from transformers import DataCollatorForLanguageModeling

    model = build_tiny_lm(tok_pad)
    rows = [r for r in _lm_rows(tok_pad, mask_prompt=2) if len(r["input_ids"]) == len(_lm_rows(tok_pad)[2]["input_ids"])]
    rows = rows * 3  # equal lengths: the collator does not crash, it silently replaces the labels
    f = _finding(check(model, tok_pad, rows, data_collator=DataCollatorForLanguageModeling(tok_pad, mlm=False)),
                 "labels-not-padded")
    assert "replaces" in f.message and "prompt mask" in f.message
    _healthy(check(model, tok_pad, rows, data_collator=PadCollator(tok_pad.pad_token_id)), "labels-not-padded")


# ---------------------------------------------------------------------------------------------------- ragged-batch


def test_default_collate_over_variable_lengths(tok):
    model = build_tiny_lm(tok)
    report = check(model, tok, _lm_rows(tok), data_collator=None)
    f = _finding(report, "ragged-batch")
    assert "'input_ids'" in f.message and "default collate" in f.message and "PadCollator" in f.fix
    assert "labels-not-padded" not in report.codes() and "collate-failed" not in report.codes()
    _healthy(check(model, tok, _lm_rows(tok), data_collator=PadCollator(tok.pad_token_id)), "ragged-batch")


def test_default_collate_over_tensor_tuples():
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 2)

        def forward(self, x):
            return self.proj(x).mean(1)

    ragged = [(torch.randn(n, 4), torch.tensor(0)) for n in (3, 5, 7)]
    f = _finding(check(Model(), train_dataset=ragged, task="custom"), "ragged-batch")
    assert "'item[0]'" in f.message
    assert "ragged-batch" not in check(Model(), train_dataset=[(torch.randn(5, 4), torch.tensor(0))] * 3,
                                       task="custom").codes()


# ------------------------------------------------------------------------------------------------------------ EOS


def test_eos_masked_by_lm_collator_when_pad_is_eos(tok, tok_pad):
    from transformers import DataCollatorForLanguageModeling

    f = _finding(check(build_tiny_lm(tok), tok, _lm_rows(tok, labels=False),
                       data_collator=DataCollatorForLanguageModeling(tok, mlm=False)), "eos-masked")
    assert f.severity == "error" and "never learns to stop" in f.message
    assert "DataCollatorForLanguageModeling" in f.message and f"id {tok.eos_token_id}" in f.message
    assert "labels" in f.where
    # the same collator with a pad token distinct from EOS keeps the EOS label
    _healthy(check(build_tiny_lm(tok_pad), tok_pad, _lm_rows(tok_pad, labels=False),
                   data_collator=DataCollatorForLanguageModeling(tok_pad, mlm=False)), "eos-masked")


def test_eos_masked_in_the_data_labels(tok):
    rows = _lm_rows(tok, mask_prompt=1)
    for r in rows:
        r["labels"][-1] = -100  # labels built as [t if t != pad else -100], with pad == eos
    f = _finding(check(build_tiny_lm(tok), tok, rows, data_collator=PadCollator(tok.pad_token_id)), "eos-masked")
    assert "own labels" in f.message
    _healthy(check(build_tiny_lm(tok), tok, _lm_rows(tok, mask_prompt=1), data_collator=PadCollator(tok.pad_token_id)),
             "eos-masked")


def test_eos_missing(tok):
    model = build_tiny_lm(tok)
    f = _finding(check(model, tok, _lm_rows(tok, eos=False, mask_prompt=1), data_collator=PadCollator(tok.pad_token_id)),
                 "eos-missing")
    assert "6 of 6" in f.message and f"EOS (id {tok.eos_token_id}" in f.message and "eos_token_id" in f.fix
    assert f.where == "train_dataset column 'input_ids'"
    _healthy(check(model, tok, _lm_rows(tok, mask_prompt=1), data_collator=PadCollator(tok.pad_token_id)),
             "eos-missing")


# -------------------------------------------------------------------------------------------- no-supervised-tokens


def test_rows_without_supervised_tokens(tok):
    import datasets

    rows = _lm_rows(tok, mask_prompt=1)
    for i in (2, 4):
        rows[i]["labels"] = [-100] * len(rows[i]["input_ids"])  # the answer was truncated away
    ds = datasets.Dataset.from_list(rows)
    model = build_tiny_lm(tok)
    f = _finding(check(model, tok, ds, data_collator=PadCollator(tok.pad_token_id)), "no-supervised-tokens")
    assert "2 of 6 rows" in f.message and "rows 2, 4" in f.message and "row 2" in f.where
    healthy = datasets.Dataset.from_list(_lm_rows(tok, mask_prompt=1))
    _healthy(check(model, tok, healthy, data_collator=PadCollator(tok.pad_token_id)), "no-supervised-tokens")


def test_batch_without_supervised_tokens(tok):
    pad = PadCollator(tok.pad_token_id)

    def completion_only(items):  # like a completion-only collator that does not find its response template
        batch = pad(items)
        batch["labels"][:] = -100
        return batch

    f = _finding(check(build_tiny_lm(tok), tok, _lm_rows(tok), data_collator=completion_only), "no-supervised-tokens")
    assert "collated batch" in f.message and "completion_only" in f.message
    _healthy(check(build_tiny_lm(tok), tok, _lm_rows(tok), data_collator=pad), "no-supervised-tokens")


def test_labels_preshifted(tok):
    rows = _lm_rows(tok)
    shifted = [dict(r, labels=r["input_ids"][1:] + [-100]) for r in rows]
    model = build_tiny_lm(tok)
    f = _finding(check(model, tok, shifted, data_collator=PadCollator(tok.pad_token_id)), "labels-preshifted")
    assert "shifted left by one" in f.message and "LlamaForCausalLM" in f.message
    _healthy(check(model, tok, rows, data_collator=PadCollator(tok.pad_token_id)), "labels-preshifted")


# ----------------------------------------------------------------------------------------------- class labels


def test_label_out_of_range(bert_tok):
    from transformers import DataCollatorWithPadding

    model, collate = _classifier(bert_tok), DataCollatorWithPadding(bert_tok)
    report = check(model, bert_tok, _cls_rows(bert_tok, [0, 1, 2, -1, 1, 0, -100, 1]), data_collator=collate)
    f = _finding(report, "label-out-of-range")
    assert "num_labels=2" in f.message and "column 'label'" in f.message
    assert "-1 in row 3" in f.message and "2 in row 2" in f.message and "-100 in row 6" in f.message
    assert "-100 is not a class" in f.message and "num_labels=3" in f.fix
    _healthy(check(model, bert_tok, _cls_rows(bert_tok, [0, 1, 1, 0]), data_collator=collate), "label-out-of-range")


def test_token_label_out_of_range(bert_tok):
    from transformers import BertConfig, BertForTokenClassification, DataCollatorForTokenClassification

    model = BertForTokenClassification(BertConfig(vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=4, intermediate_size=64, num_labels=3))
    rows = []
    for i, r in enumerate(sentiment_rows(4)):
        enc = bert_tok(r["sentence"])
        rows.append(dict(enc, labels=[-100] + [i % 3] * (len(enc["input_ids"]) - 2) + [-100]))
    collate = DataCollatorForTokenClassification(bert_tok)
    _healthy(check(model, bert_tok, rows, data_collator=collate), "label-out-of-range")  # -100 is ignored per token
    rows[2]["labels"][1] = -1
    f = _finding(check(model, bert_tok, rows, data_collator=collate), "label-out-of-range")
    assert "-1 in row 2" in f.message and "-100" in f.fix


def test_label_out_of_range_in_eval_split(bert_tok):
    from transformers import DataCollatorWithPadding

    model, collate = _classifier(bert_tok), DataCollatorWithPadding(bert_tok)
    f = _finding(check(model, bert_tok, _cls_rows(bert_tok, [0, 1, 1, 0]), _cls_rows(bert_tok, [0, -1]),
                       data_collator=collate), "label-out-of-range")
    assert "eval_dataset" in f.message and f.where.startswith("eval_dataset")


@pytest.mark.parametrize("num_labels,problem_type,labels,expected", [
    (2, None, [0.0, 1.0, 1.0, 0.0], "float labels"),
    (2, "single_label_classification", [0.0, 1.0, 1.0, 0.0], "expected target dtype to be Long"),
    (2, "multi_label_classification", [[0, 1], [1, 0], [1, 1], [0, 1]], "BCEWithLogitsLoss needs float"),
    (2, "multi_label_classification", [0, 1, 1, 0], "multi-hot"),
    (1, None, [0, 1, 1, 0], "num_labels=1 as regression"),
])
def test_label_dtype(bert_tok, num_labels, problem_type, labels, expected):
    from transformers import DataCollatorWithPadding

    model = _classifier(bert_tok, num_labels, problem_type)
    f = _finding(check(model, bert_tok, _cls_rows(bert_tok, labels), data_collator=DataCollatorWithPadding(bert_tok)),
                 "label-dtype")
    assert expected in f.message and "column 'label'" in f.where


@pytest.mark.parametrize("num_labels,problem_type,labels", [
    (2, None, [0, 1, 1, 0]),
    (2, "multi_label_classification", [[0.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]),
    (1, "regression", [0.5, 1.5, 2.0, 0.1]),
])
def test_label_dtype_healthy(bert_tok, num_labels, problem_type, labels):
    from transformers import DataCollatorWithPadding

    model = _classifier(bert_tok, num_labels, problem_type)
    _healthy(check(model, bert_tok, _cls_rows(bert_tok, labels), data_collator=DataCollatorWithPadding(bert_tok)),
             "label-dtype")


def test_label_not_numeric(bert_tok):
    from transformers import DataCollatorWithPadding

    model, collate = _classifier(bert_tok), DataCollatorWithPadding(bert_tok)
    texts = ["the movie was good", "bad", "the plot was very very dull", "great film"]  # variable lengths
    rows = [dict(bert_tok(t), label=lab) for t, lab in zip(texts, ["pos", "neg", "neg", "pos"], strict=True)]
    report = check(model, bert_tok, rows, data_collator=collate)
    f = _finding(report, "label-not-numeric")
    assert "'neg', 'pos'" in f.message and "column 'label'" in f.message and "label2id = {'neg': 0, 'pos': 1}" in f.fix
    # one cause, one finding: not a padding problem, not a generic collate failure
    assert not {"collate-failed", "labels-not-padded", "ragged-batch"} & set(report.codes()), str(report)
    healthy = [dict(r, label=int(r["label"] == "pos")) for r in rows]
    _healthy(check(model, bert_tok, healthy, data_collator=collate), "label-not-numeric")


def test_token_labels_not_numeric(bert_tok):
    from transformers import BertConfig, BertForTokenClassification, DataCollatorForTokenClassification

    model = BertForTokenClassification(BertConfig(vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=4, intermediate_size=64, num_labels=2))
    rows = [dict(bert_tok(t)) for t in ["the movie was good", "bad film"]]
    for r in rows:
        r["labels"] = ["O"] * len(r["input_ids"])
    report = check(model, bert_tok, rows, data_collator=DataCollatorForTokenClassification(bert_tok))
    f = _finding(report, "label-not-numeric")
    assert "[label2id[t] for t in r['labels']]" in f.fix
    assert not {"collate-failed", "labels-not-padded", "ragged-batch"} & set(report.codes()), str(report)


def test_label_one_hot(bert_tok):
    from transformers import DataCollatorWithPadding

    model, collate = _classifier(bert_tok), DataCollatorWithPadding(bert_tok)
    f = _finding(check(model, bert_tok, _cls_rows(bert_tok, [[0, 1], [1, 0], [1, 0], [0, 1]]), data_collator=collate),
                 "label-one-hot")
    assert "one-hot vectors of length 2" in f.message and "row 0: [0, 1]" in f.message and ".index(1)" in f.fix
    _healthy(check(model, bert_tok, _cls_rows(bert_tok, [1, 0, 0, 1]), data_collator=collate), "label-one-hot")


# ------------------------------------------------------------------------------------------------------- no-labels


def test_no_labels(tok_pad):
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    model, rows = build_tiny_lm(tok_pad), _lm_rows(tok_pad, labels=False)
    f = _finding(check(model, tok_pad, rows, data_collator=DataCollatorWithPadding(tok_pad)), "no-labels")
    assert "no labels" in f.message and "LlamaForCausalLM" in f.message and "cannot return a loss" in f.message
    _healthy(check(model, tok_pad, rows, data_collator=DataCollatorForLanguageModeling(tok_pad, mlm=False)),
             "no-labels")


# -------------------------------------------------------------------------------------------- dry-run failures


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict], broken: int | None = None):
        self.rows, self.broken = rows, broken

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        if i == self.broken:
            raise KeyError("text")
        return self.rows[i]


def test_dataset_item_failed(tok):
    model, collate = build_tiny_lm(tok), PadCollator(tok.pad_token_id)
    report = check(model, tok, _Rows(_lm_rows(tok), broken=1), data_collator=collate)
    f = _finding(report, "dataset-item-failed")
    assert "train_dataset[1]" in f.message and "KeyError: 'text'" in f.message and "Traceback" not in f.message
    assert "_Rows, 6 rows" in f.message
    _healthy(check(model, tok, _Rows(_lm_rows(tok)), data_collator=collate), "dataset-item-failed")


def test_collate_failed(tok):
    model, pad = build_tiny_lm(tok), PadCollator(tok.pad_token_id)
    rows = [dict(r, source="wiki") for r in _lm_rows(tok)]

    def strict(items):
        if any("source" in it for it in items):
            raise TypeError("unsupported key 'source'")
        return pad(items)

    f = _finding(check(model, tok, rows, data_collator=strict), "collate-failed")
    assert "TypeError: unsupported key 'source'" in f.message and "input_ids: list[" in f.message
    assert "source: str" in f.message and "strict" in f.where
    _healthy(check(model, tok, _lm_rows(tok), data_collator=strict), "collate-failed")


# ------------------------------------------------------------------------------------------- surefit's own pipeline


def test_surefit_sft_pipeline_has_no_errors():
    from surefit.data.encode import build_prompt_format, encode_rows
    from surefit.data.rows import Row

    tok = build_tokenizer()  # pad == eos
    tok.padding_side = "left"  # as tasks/sft/train_sft.py sets it before the doctor runs
    rows = [Row(r, f"qa.jsonl line {i + 1}", i) for i, r in enumerate(qa_rows(12))]
    examples, _ = encode_rows(rows, tok, build_prompt_format(tok), max_seq_length=128)
    feats = [e.features() for e in examples]
    report = check(build_tiny_lm(tok), tok, feats[:8], feats[8:], PadCollator(tok.pad_token_id),
                   args={"batch_size": 4, "max_length": 128, "generation": True}, task="sft")
    assert not report.has_errors, str(report)
    assert not {"eos-masked", "eos-missing", "labels-not-padded", "no-supervised-tokens"} & set(report.codes())


def test_surefit_classify_pipeline_has_no_errors(bert_tok):
    model = _classifier(bert_tok, 2, "single_label_classification")
    feats = [{k: list(v) for k, v in bert_tok(r["sentence"]).items()} | {"labels": i % 2}
             for i, r in enumerate(sentiment_rows(8))]
    report = check(model, bert_tok, feats[:6], feats[6:], PadCollator(bert_tok.pad_token_id), args={"batch_size": 4},
                   task="classify")
    assert not report.has_errors, str(report)
