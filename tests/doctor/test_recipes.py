"""Standard recipes, rebuilt on tiny local models: the doctor must report no error on any of them.

Each is set up the way its tutorial or reference script does it (the Hugging Face course's text classification,
run_clm's grouped blocks, alpaca-lora, token classification with word_ids(), T5 with DataCollatorForSeq2Seq,
multi-label classification, TRL's SFTTrainer), then checked with check_trainer() or check().
"""

from __future__ import annotations

import importlib.util

import datasets
import pytest
import torch
from torch import nn

from conftest import build_bert_tokenizer, build_tiny_lm, build_tokenizer, sentiment_rows
from surefit.doctor import check, check_trainer

datasets.disable_progress_bars()


def _no_errors(report):
    errors = [f for f in report.findings if f.severity == "error"]
    assert errors == [], str(report)


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=4,
                             **kw)


def _bert(tok, cls_name="BertForSequenceClassification", **config):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, **config)
    return getattr(transformers, cls_name)(cfg)


@pytest.fixture(scope="module")
def bert_tok():
    return build_bert_tokenizer()


def glue(n: int, template: str = "the {filler} was very {word}") -> datasets.Dataset:
    rows = [dict(r, label=int(r["label"] == "pos")) for r in sentiment_rows(n, template=template)]
    return datasets.Dataset.from_list(rows)


# ------------------------------------------------------------------------------ HF course: text classification


def test_course_text_classification(tmp_path, bert_tok):
    """Tokenised with map, the dataset still holds `sentence` and `idx`; the Trainer drops them before collating."""
    from transformers import DataCollatorWithPadding, Trainer

    def tokenize(batch):
        return bert_tok(batch["sentence"], truncation=True)

    train = glue(24).map(tokenize, batched=True)
    val = glue(8, template="a {filler} so {word}").map(tokenize, batched=True)
    assert {"sentence", "idx"} <= set(train.column_names)
    model = _bert(bert_tok, num_labels=2)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=train, eval_dataset=val,
                      data_collator=DataCollatorWithPadding(bert_tok), processing_class=bert_tok)
    report = check_trainer(trainer)
    _no_errors(report)
    # what the Trainer drops is said, not hidden
    assert any(f.code == "unexpected-columns" and "'sentence'" in f.message for f in report.findings), str(report)
    # check() reads the same setting from the arguments
    _no_errors(check(model, bert_tok, train, val, DataCollatorWithPadding(bert_tok), args=_args(tmp_path)))
    # without the column removal the raw items cannot be collated: that is a real error there
    plain = check(model, bert_tok, train, val, DataCollatorWithPadding(bert_tok), args=_args(
        tmp_path, remove_unused_columns=False))
    assert plain.has_errors


# --------------------------------------------------------------------------------------- run_clm grouped blocks


def test_run_clm_grouped_blocks(tmp_path):
    from transformers import Trainer, default_data_collator

    tok = build_tokenizer()
    model = build_tiny_lm(tok)
    raw = datasets.Dataset.from_list([{"text": r["sentence"]} for r in sentiment_rows(40)])
    tokenized = raw.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
    block = 16

    def group_texts(examples):
        joined = {k: sum(examples[k], []) for k in examples}
        total = (len(joined["input_ids"]) // block) * block
        out = {k: [v[i: i + block] for i in range(0, total, block)] for k, v in joined.items()}
        out["labels"] = [list(x) for x in out["input_ids"]]
        return out

    lm = tokenized.map(group_texts, batched=True)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=lm, data_collator=default_data_collator)
    _no_errors(check_trainer(trainer))


# ------------------------------------------------------------------------------------------- alpaca-lora SFT


def test_alpaca_lora_sft(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForSeq2Seq, Trainer

    tok = build_tokenizer(pad_is_eos=False)
    tok.padding_side = "left"
    model = get_peft_model(build_tiny_lm(tok), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.05, bias="none", task_type="CAUSAL_LM"))
    template = "Below is an instruction.\n\n### Instruction:\n{instruction}\n\n### Response:\n"

    def generate_and_tokenize(row):
        prompt = template.format(instruction=row["instruction"])
        full = tok(prompt + row["output"], truncation=True, max_length=256)
        full["input_ids"].append(tok.eos_token_id)
        full["attention_mask"].append(1)
        full["labels"] = list(full["input_ids"])
        n_prompt = len(tok(prompt)["input_ids"])
        full["labels"] = [-100] * n_prompt + full["labels"][n_prompt:]
        return full

    rows = [{"instruction": f"is this positive: {r['sentence']}", "input": "", "output": r["label"]}
            for r in sentiment_rows(16)]
    data = datasets.Dataset.from_list(rows).shuffle(seed=0).map(generate_and_tokenize)
    collator = DataCollatorForSeq2Seq(tok, pad_to_multiple_of=8, return_tensors="pt", padding=True)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=data, data_collator=collator)
    _no_errors(check_trainer(trainer))


# ------------------------------------------------------------------------------ NER aligned with word_ids()


def test_ner_with_word_ids_alignment(tmp_path, bert_tok):
    from transformers import DataCollatorForTokenClassification, Trainer

    rows = [{"id": str(i), "tokens": r["sentence"].split(), "ner_tags": [(i + j) % 3 for j in range(5)]}
            for i, r in enumerate(sentiment_rows(16))]

    def tokenize_and_align_labels(examples):
        enc = bert_tok(examples["tokens"], truncation=True, is_split_into_words=True)
        labels = []
        for i, tags in enumerate(examples["ner_tags"]):
            previous, row = None, []
            for w in enc.word_ids(batch_index=i):
                row.append(-100 if w is None or w == previous else tags[w])
                previous = w
            labels.append(row)
        enc["labels"] = labels
        return enc

    data = datasets.Dataset.from_list(rows).map(tokenize_and_align_labels, batched=True)
    model = _bert(bert_tok, "BertForTokenClassification", num_labels=3)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=data,
                      data_collator=DataCollatorForTokenClassification(bert_tok))
    _no_errors(check_trainer(trainer))


# ------------------------------------------------------------------------------ T5 with DataCollatorForSeq2Seq


def test_t5_with_seq2seq_collator(tmp_path):
    from transformers import (
        DataCollatorForSeq2Seq,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        T5Config,
        T5ForConditionalGeneration,
    )

    tok = build_tokenizer(pad_is_eos=False)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id))
    rows = [{"document": r["sentence"], "summary": " ".join([r["label"]] * (1 + i % 3))}
            for i, r in enumerate(sentiment_rows(16))]

    def preprocess(examples):
        inputs = ["summarize: " + d for d in examples["document"]]
        enc = tok(inputs, max_length=64, truncation=True)
        enc["input_ids"] = [ids + [tok.eos_token_id] for ids in enc["input_ids"]]
        enc["attention_mask"] = [m + [1] for m in enc["attention_mask"]]
        targets = tok(text_target=examples["summary"], max_length=16, truncation=True)
        enc["labels"] = [ids + [tok.eos_token_id] for ids in targets["input_ids"]]
        return enc

    data = datasets.Dataset.from_list(rows).map(preprocess, batched=True)
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                    per_device_train_batch_size=4, predict_with_generate=True)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=data,
                             data_collator=DataCollatorForSeq2Seq(tok, model=model), processing_class=tok)
    _no_errors(check_trainer(trainer))


# --------------------------------------------------------------------------- multi-label with float vectors


def test_multi_label_float_vectors(tmp_path, bert_tok):
    from transformers import DataCollatorWithPadding, Trainer

    vectors = [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    data = glue(16).map(lambda r, i: dict(bert_tok(r["sentence"]), labels=vectors[i % 4]), with_indices=True,
                        remove_columns=["label"])
    model = _bert(bert_tok, num_labels=3, problem_type="multi_label_classification")
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=data,
                      data_collator=DataCollatorWithPadding(bert_tok))
    _no_errors(check_trainer(trainer))

    class MultiLabel(nn.Module):
        """The same recipe with a user's own module and BCEWithLogitsLoss."""

        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(len(bert_tok), 16), nn.Linear(16, 3)

        def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
            logits = self.head(self.emb(input_ids).mean(1))
            loss = nn.functional.binary_cross_entropy_with_logits(logits, labels) if labels is not None else None
            return {"loss": loss, "logits": logits}

    items = [dict(bert_tok(r["sentence"]), labels=vectors[i % 4]) for i, r in enumerate(sentiment_rows(8))]
    report = check(MultiLabel(), bert_tok, items, data_collator=DataCollatorWithPadding(bert_tok))
    _no_errors(report)
    assert "labels-not-padded" not in report.codes()


# --------------------------------------------------------------------------------- TRL SFTTrainer, prompt/completion


@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="TRL is not installed in this environment (the stand-in below covers its batch shape)")
def test_trl_sft_trainer_prompt_completion(tmp_path):
    from trl import SFTConfig, SFTTrainer

    tok = build_tokenizer(pad_is_eos=False)
    rows = [{"prompt": f"is this positive: {r['sentence']}\n", "completion": r["label"]} for r in sentiment_rows(16)]
    trainer = SFTTrainer(model=build_tiny_lm(tok), processing_class=tok, train_dataset=datasets.Dataset.from_list(rows),
                         args=SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                        per_device_train_batch_size=4, max_length=64))
    _no_errors(check_trainer(trainer))


class CompletionCollator:
    """TRL's collator for tokenised prompt/completion rows: pads, and trains only where completion_mask is 1."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, items):
        n = max(len(it["input_ids"]) for it in items)
        ids = torch.full((len(items), n), self.pad_token_id)
        mask = torch.zeros((len(items), n), dtype=torch.long)
        labels = torch.full((len(items), n), -100)
        for r, it in enumerate(items):
            k = len(it["input_ids"])
            ids[r, :k] = torch.tensor(it["input_ids"])
            mask[r, :k] = 1
            keep = torch.tensor(it["completion_mask"]).bool()
            labels[r, :k] = torch.where(keep, torch.tensor(it["input_ids"]), -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class SFTTrainer:
    """A stand-in with TRL SFTTrainer's surface: a prepared (tokenised) dataset and its own signature columns."""

    def __init__(self, model, tok, dataset, args):
        self.model, self.processing_class, self.args = model, tok, args
        self.train_dataset, self.eval_dataset = dataset, None
        self.data_collator = CompletionCollator(tok.pad_token_id)
        self._signature_columns = None
        self.label_names = ["labels"]

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "labels", "seq_lengths", "completion_mask", "assistant_masks"]


def test_trl_style_trainer_uses_its_own_signature_columns(tmp_path):
    """The trainer's own column list decides (a model's forward takes no `completion_mask`, TRL keeps it)."""
    tok = build_tokenizer(pad_is_eos=False)
    rows = []
    for r in sentiment_rows(12):
        prompt = tok(f"is this positive: {r['sentence']}\n")["input_ids"]
        completion = tok(r["label"])["input_ids"] + [tok.eos_token_id]
        rows.append({"prompt": r["sentence"], "completion": r["label"], "input_ids": prompt + completion,
                     "completion_mask": [0] * len(prompt) + [1] * len(completion)})
    trainer = SFTTrainer(build_tiny_lm(tok), tok, datasets.Dataset.from_list(rows), _args(tmp_path))
    report = check_trainer(trainer)
    _no_errors(report)
    assert trainer._signature_columns[3] == "completion_mask"
