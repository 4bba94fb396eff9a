"""Label checks for any model (derived from the logits of a dry forward, confirmed by probes), and the causes that
used to go unnamed: padding trained as labels, word-level tags against sub-word tokens, frozen new heads under PEFT,
per-token labels for a sequence classifier, a masked chat turn terminator. Each broken setup is caught under its
code, and its healthy twin is error-free."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import build_bert_tokenizer, build_tiny_lm, build_tokenizer, sentiment_rows
from surefit.doctor import check, explain


@pytest.fixture(scope="module")
def bert_tok():
    return build_bert_tokenizer()


def _finding(report, code):
    found = [f for f in report.findings if f.code == code]
    assert found, f"{code} not reported:\n{report}"
    return found[0]


def _no_errors(report):
    assert not report.has_errors, str(report)


def _rows(bert_tok, labels: list) -> list[dict]:
    rows = sentiment_rows(len(labels))
    return [dict(bert_tok(r["sentence"]), label=lab) for r, lab in zip(rows, labels, strict=True)]


def _collate(bert_tok):
    from transformers import DataCollatorWithPadding

    return DataCollatorWithPadding(bert_tok)


# ------------------------------------------------------------------------------- a user's own nn.Module classifier


class MeanPool(nn.Module):
    """A plain classifier: embedding, mean, a linear head; the loss is chosen by the user."""

    def __init__(self, vocab: int, outputs: int, loss: str = "ce"):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, outputs)
        self.loss = loss

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        logits = self.head(self.emb(input_ids).mean(1))
        if labels is None:
            return {"logits": logits}
        if self.loss == "ce":
            loss = nn.functional.cross_entropy(logits, labels)
        else:
            loss = nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1) if logits.shape[-1] == 1
                                                                  else logits, labels)
        return {"loss": loss, "logits": logits}


def test_plain_module_class_id_out_of_range(bert_tok):
    model = MeanPool(len(bert_tok), 3)
    report = check(model, bert_tok, _rows(bert_tok, [0, 1, 2, -1, 3, 1]), data_collator=_collate(bert_tok))
    f = _finding(report, "label-out-of-range")
    assert f.severity == "error" and "[0, 3)" in f.message
    assert "-1 in row 3" in f.message and "3 in row 4" in f.message
    assert "forward-failed" not in report.codes()
    _no_errors(check(model, bert_tok, _rows(bert_tok, [0, 1, 2, 0, 2, 1]), data_collator=_collate(bert_tok)))


def test_plain_module_float_labels_for_cross_entropy(bert_tok):
    model = MeanPool(len(bert_tok), 3)
    report = check(model, bert_tok, _rows(bert_tok, [0.0, 1.0, 2.0, 1.0]), data_collator=_collate(bert_tok))
    f = _finding(report, "label-dtype")
    assert f.severity == "error" and "float labels" in f.message and "cross-entropy" in f.message
    assert "rows [0, 1, 2]: [0.0, 1.0, 2.0]" in f.message and "int(r['labels'])" in f.fix
    assert "forward-failed" not in report.codes(), str(report)
    raw = RuntimeError("expected scalar type Long but found Float")
    assert explain(raw, model, bert_tok, _rows(bert_tok, [0.0, 1.0, 2.0, 1.0]),
                   data_collator=_collate(bert_tok)).code == "label-dtype"


def test_plain_module_one_hot_labels(bert_tok):
    model = MeanPool(len(bert_tok), 3)
    one_hot = [[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 1, 0]]
    report = check(model, bert_tok, _rows(bert_tok, one_hot), data_collator=_collate(bert_tok))
    f = _finding(report, "label-one-hot")
    assert "one-hot labels (tensor [3, 3] int64" in f.message and ".index(1)" in f.fix
    assert "forward-failed" not in report.codes(), str(report)


def test_plain_module_integer_labels_for_bce(bert_tok):
    binary = MeanPool(len(bert_tok), 1, loss="bce")
    report = check(binary, bert_tok, _rows(bert_tok, [0, 1, 1, 0]), data_collator=_collate(bert_tok))
    f = _finding(report, "label-dtype")
    assert "integer labels" in f.message and "float" in f.fix
    _no_errors(check(binary, bert_tok, _rows(bert_tok, [0.0, 1.0, 1.0, 0.0]), data_collator=_collate(bert_tok)))
    multi = MeanPool(len(bert_tok), 3, loss="bce")
    hot = [[1, 0, 1], [0, 1, 0], [0, 0, 1], [1, 1, 0]]
    f = _finding(check(multi, bert_tok, _rows(bert_tok, hot), data_collator=_collate(bert_tok)), "label-dtype")
    assert "integer multi-hot labels" in f.message
    floats = [[float(x) for x in r] for r in hot]
    _no_errors(check(multi, bert_tok, _rows(bert_tok, floats), data_collator=_collate(bert_tok)))


# ------------------------------------------------------------------------------------------------ label-shape


def _bert_seq_cls(bert_tok, num_labels=2, **config):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=num_labels, **config))


def test_mlm_collator_labels_for_sequence_classifier(bert_tok):
    from transformers import DataCollatorForLanguageModeling

    model = _bert_seq_cls(bert_tok)
    rows = [dict(bert_tok(r["sentence"])) for r in sentiment_rows(6)]
    collate = DataCollatorForLanguageModeling(bert_tok, mlm=True, mlm_probability=0.5, seed=0)
    report = check(model, bert_tok, rows, data_collator=collate, args={"batch_size": 3})
    f = _finding(report, "label-shape")
    assert f.severity == "error" and "per token" in f.message and "mlm=True" in f.message
    assert "logits [3, 2]" in f.message and "DataCollatorWithPadding" in f.fix
    assert "forward-failed" not in report.codes() and "label-one-hot" not in report.codes(), str(report)
    # the error text alone used to be read as one-hot labels; with the setup the confirmed cause wins
    raw = ValueError("Expected input batch_size (4) to match target batch_size (28).")
    assert explain(raw, model, bert_tok, rows, data_collator=collate, args={"batch_size": 3}).code == "label-shape"


def test_sequence_labels_for_token_classifier(bert_tok):
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    model = BertForTokenClassification(BertConfig(vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=4, intermediate_size=64, num_labels=3))
    report = check(model, bert_tok, _rows(bert_tok, [0, 1, 2, 1]), data_collator=_collate(bert_tok))
    f = _finding(report, "label-shape")
    assert "one label per row" in f.message and "word_ids()" in f.fix


# ------------------------------------------------------------------------------------------- labels-pad-trained


def _t5(tok):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id))


def _seq2seq_rows(tok, pad_targets: bool) -> list[dict]:
    rows = []
    for i, r in enumerate(sentiment_rows(6)):
        enc = tok(r["sentence"])
        target = tok(" ".join([r["label"]] * (1 + i % 3)))["input_ids"] + [tok.eos_token_id]
        if pad_targets:  # the bug: targets tokenized with padding="max_length", pad ids kept in labels
            target = target + [tok.pad_token_id] * (12 - len(target))
        rows.append({"input_ids": enc["input_ids"] + [tok.eos_token_id], "labels": target})
    return rows


def test_seq2seq_labels_padded_with_pad_id():
    from transformers import DataCollatorForSeq2Seq

    tok = build_tokenizer(pad_is_eos=False)
    model = _t5(tok)
    collate = DataCollatorForSeq2Seq(tok, model=model)
    report = check(model, tok, _seq2seq_rows(tok, pad_targets=True), data_collator=collate)
    f = _finding(report, "labels-pad-trained")
    assert f.severity == "error" and f"pad id {tok.pad_token_id} ('<pad>')" in f.message
    assert "rows of train_dataset" in f.message and "row 0" in f.where and "-100" in f.fix
    _no_errors(check(model, tok, _seq2seq_rows(tok, pad_targets=False), data_collator=collate))
    # the collator pads labels with the pad id
    bad_collate = DataCollatorForSeq2Seq(tok, model=model, label_pad_token_id=tok.pad_token_id)
    f = _finding(check(model, tok, _seq2seq_rows(tok, pad_targets=False), data_collator=bad_collate),
                 "labels-pad-trained")
    assert f"label_pad_token_id={tok.pad_token_id}" in f.message and "label_pad_token_id=-100" in f.fix


def test_causal_labels_copied_from_padded_input_ids():
    tok = build_tokenizer(pad_is_eos=False)
    model = build_tiny_lm(tok)
    enc = tok([r["sentence"] + tok.eos_token for r in sentiment_rows(4)], padding="max_length", max_length=32)
    rows = [{"input_ids": ids, "attention_mask": m, "labels": list(ids)}
            for ids, m in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
    f = _finding(check(model, tok, rows), "labels-pad-trained")
    assert "4 rows of train_dataset" in f.message
    # a collator that rebuilds labels from input_ids (padding masked) makes the column's pads harmless
    from transformers import DataCollatorForLanguageModeling

    rebuilt = check(model, tok, rows, data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    assert "labels-pad-trained" not in rebuilt.codes(), str(rebuilt)
    for r in rows:
        r["labels"] = [t if m else -100 for t, m in zip(r["input_ids"], r["attention_mask"], strict=True)]
    assert "labels-pad-trained" not in check(model, tok, rows).codes()


# -------------------------------------------------------------------------------------- token-labels-misaligned


def _ner_model(bert_tok, num_labels=3):
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    return BertForTokenClassification(BertConfig(vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=1,
                                                 num_attention_heads=4, intermediate_size=64,
                                                 max_position_embeddings=64, num_labels=num_labels))


def ner_rows(bert_tok, aligned: bool) -> list[dict]:
    rows = []
    for i, r in enumerate(sentiment_rows(6)):
        words = r["sentence"].split()
        tags = [(i + j) % 3 for j in range(len(words))]
        enc = bert_tok(words, is_split_into_words=True)
        if aligned:
            previous, labels = None, []
            for w in enc.word_ids():
                labels.append(-100 if w is None or w == previous else tags[w])
                previous = w
        else:
            labels = tags  # the bug: word-level tags kept as they are
        rows.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels})
    return rows


def test_word_level_tags_not_aligned_to_tokens(bert_tok):
    from transformers import DataCollatorForTokenClassification

    model, collate = _ner_model(bert_tok), DataCollatorForTokenClassification(bert_tok)
    report = check(model, bert_tok, ner_rows(bert_tok, aligned=False), data_collator=collate)
    f = _finding(report, "token-labels-misaligned")
    assert f.severity == "error" and "row 0: 5 labels for 7 tokens" in f.message
    assert "pads the shorter labels with -100" in f.message and "word_ids()" in f.fix
    assert "labels-not-padded" not in report.codes(), str(report)
    _no_errors(check(model, bert_tok, ner_rows(bert_tok, aligned=True), data_collator=collate))


# ---------------------------------------------------------------------------------------------- new-head-frozen


def test_new_classifier_frozen_under_lora(bert_tok):
    from peft import LoraConfig, get_peft_model

    rows = _rows(bert_tok, [0, 1, 1, 0])

    def loaded():
        model = _bert_seq_cls(bert_tok)
        model.config.architectures = ["BertModel"]  # as from_pretrained of a base checkpoint leaves it
        return model

    frozen = get_peft_model(loaded(), LoraConfig(target_modules=["query", "value"]))
    f = _finding(check(frozen, bert_tok, rows, data_collator=_collate(bert_tok)), "new-head-frozen")
    assert f.severity == "error" and f.where == "layer 'classifier'" and "BertModel" in f.message
    assert "modules_to_save=['classifier']" in f.fix
    saved = get_peft_model(loaded(), LoraConfig(target_modules=["query", "value"], task_type="SEQ_CLS"))
    assert "new-head-frozen" not in check(saved, bert_tok, rows, data_collator=_collate(bert_tok)).codes()
    # a LoRA config about to be applied
    f = _finding(check(loaded(), bert_tok, rows, data_collator=_collate(bert_tok),
                       peft_config=LoraConfig(target_modules=["query", "value"])), "new-head-frozen")
    assert "classifier" in f.where
    ok = LoraConfig(target_modules=["query", "value"], modules_to_save=["classifier"])
    assert "new-head-frozen" not in check(loaded(), bert_tok, rows, data_collator=_collate(bert_tok),
                                          peft_config=ok).codes()
    # a checkpoint saved from this very class carries its head: freezing it is a choice
    trained = _bert_seq_cls(bert_tok)
    trained.config.architectures = ["BertForSequenceClassification"]
    assert "new-head-frozen" not in check(get_peft_model(trained, LoraConfig(target_modules=["query"])), bert_tok,
                                          rows, data_collator=_collate(bert_tok)).codes()


# ---------------------------------------------------------------------------------------------- turn-end-masked

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer():
    tok = build_tokenizer(pad_is_eos=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def chat_rows(tok, train_terminator: bool) -> list[dict]:
    """Prompt masked, answer trained; the answer's terminator trained or not (labels built by position)."""
    rows = []
    for r in sentiment_rows(4):
        messages = [{"role": "user", "content": r["sentence"]}, {"role": "assistant", "content": r["label"]}]
        prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(messages, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"]
        answer = len(tok(r["label"], add_special_tokens=False)["input_ids"])
        trained = answer + (1 if train_terminator else 0)
        labels = [-100] * len(p_ids) + ids[len(p_ids):len(p_ids) + trained]
        labels += [-100] * (len(ids) - len(labels))
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return rows


def test_chat_terminator_masked_after_answer():
    from surefit.data.collate import PadCollator

    tok = chat_tokenizer()
    model = build_tiny_lm(tok)
    collate = PadCollator(tok.pad_token_id)
    report = check(model, tok, chat_rows(tok, train_terminator=False), data_collator=collate)
    f = _finding(report, "turn-end-masked")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert f.severity == "error" and f"'<|im_end|>' (id {end})" in f.message and "rows 0, 1, 2, 3" in f.message
    assert "Appending EOS does not fix this" in f.fix
    assert "eos-missing" not in report.codes(), str(report)  # "append EOS" would be the wrong advice here
    _no_errors(check(model, tok, chat_rows(tok, train_terminator=True), data_collator=collate))


# ------------------------------------------------------------------------------------------------------ explain


def test_explain_says_when_text_and_setup_disagree(bert_tok):
    model = MeanPool(len(bert_tok), 3)
    rows = _rows(bert_tok, [0.0, 1.0, 2.0, 1.0])
    raw = RuntimeError("CUDA error: device-side assert triggered")  # read alone: nothing to go on
    f = explain(raw, model, bert_tok, rows, data_collator=_collate(bert_tok))
    assert f.code == "label-dtype"
    other = IndexError("Target 7 is out of bounds.")
    f = explain(other, model, bert_tok, rows, data_collator=_collate(bert_tok))
    assert f.code == "label-dtype" and "does not show that" in f.message and "label-out-of-range" in f.message
    # printed as the docs show it: "[code] where: message" and "  fix: ...", not the dataclass repr
    text = str(f)
    assert text.startswith(f"[label-dtype] {f.where}: ") and f"\n  fix: {f.fix}" in text and "Finding(" not in text


def test_explain_unknown_cause_keeps_the_raw_error(bert_tok):
    model = MeanPool(len(bert_tok), 3)
    rows = _rows(bert_tok, [0, 1, 2, 1])
    raw = RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu")
    f = explain(raw, model, bert_tok, rows, data_collator=_collate(bert_tok))
    assert f.message.startswith("unknown cause: raw error `RuntimeError: Expected all tensors to be on the same")
    assert "runs without error" in f.message
    ambiguous = ValueError("Expected input batch_size (4) to match target batch_size (28).")
    f = explain(ambiguous, model, bert_tok, rows, data_collator=_collate(bert_tok))
    assert f.message.startswith("unknown cause") and "label-shape" in f.message and "label-one-hot" in f.message


# ------------------------------------------------------------------------------ more shapes of the same bugs


class LogitsOnly(nn.Module):
    """Returns logits only: the user's training loop computes the loss outside the model."""

    def __init__(self, vocab: int, outputs: int):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, 16), nn.Linear(16, outputs)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        return self.head(self.emb(input_ids).mean(1))


def test_loss_outside_the_model_float_and_one_hot_labels(bert_tok):
    model = LogitsOnly(len(bert_tok), 3)
    f = _finding(check(model, bert_tok, _rows(bert_tok, [0.0, 2.0, 1.0, 1.0]), data_collator=_collate(bert_tok)),
                 "label-dtype")
    assert "class index" in f.message and "torch.long" in f.fix
    one_hot = [[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 1, 0]]
    f = _finding(check(model, bert_tok, _rows(bert_tok, one_hot), data_collator=_collate(bert_tok)), "label-one-hot")
    assert "fit neither" in f.message
    # (unexpected-columns still says that model(**batch) would get `labels`: true for a Trainer, not for this loop)
    for healthy in ([0, 2, 1, 1], [[float(x) for x in r] for r in one_hot]):
        codes = check(model, bert_tok, _rows(bert_tok, healthy), data_collator=_collate(bert_tok)).codes()
        assert not {"label-dtype", "label-one-hot", "label-out-of-range", "label-shape"} & set(codes), codes


class Regressor(nn.Module):
    def __init__(self, vocab: int, squeeze: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.squeeze = nn.Embedding(vocab, 16), nn.Linear(16, 1), squeeze

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        logits = self.head(self.emb(input_ids).mean(1))
        pred = logits.squeeze(-1) if self.squeeze else logits
        return {"loss": nn.functional.binary_cross_entropy_with_logits(pred, labels), "logits": logits}


def test_one_label_per_row_against_one_column_of_logits(bert_tok):
    rows = _rows(bert_tok, [0.0, 1.0, 1.0, 0.0])
    report = check(Regressor(len(bert_tok), squeeze=False), bert_tok, rows, data_collator=_collate(bert_tok))
    f = _finding(report, "label-shape")
    assert "logits.squeeze(-1)" in f.fix and "forward-failed" not in report.codes()
    _no_errors(check(Regressor(len(bert_tok), squeeze=True), bert_tok, rows, data_collator=_collate(bert_tok)))


def test_causal_lm_collator_for_sequence_classifier(bert_tok):
    from transformers import DataCollatorForLanguageModeling

    rows = [dict(bert_tok(r["sentence"])) for r in sentiment_rows(6)]
    report = check(_bert_seq_cls(bert_tok), bert_tok, rows,
                   data_collator=DataCollatorForLanguageModeling(bert_tok, mlm=False))
    f = _finding(report, "label-shape")
    assert "a copy of input_ids" in f.message


def test_word_level_tags_with_a_collator_that_does_not_pad_labels(bert_tok):
    report = check(_ner_model(bert_tok), bert_tok, ner_rows(bert_tok, aligned=False), data_collator=_collate(bert_tok))
    _finding(report, "token-labels-misaligned")
    assert not {"labels-not-padded", "collate-failed"} & set(report.codes()), str(report)


def test_label_column_dropped_by_remove_unused_columns(bert_tok):
    from transformers import DataCollatorWithPadding

    model = _bert_seq_cls(bert_tok)
    rows = [dict(bert_tok(r["sentence"]), target=int(r["label"] == "pos")) for r in sentiment_rows(6)]
    report = check(model, bert_tok, rows, data_collator=DataCollatorWithPadding(bert_tok),
                   args={"remove_unused_columns": True})
    f = _finding(report, "no-labels")
    assert "dropped the columns 'target'" in f.message
    renamed = [{("label" if k == "target" else k): v for k, v in r.items()} for r in rows]
    _no_errors(check(model, bert_tok, renamed, data_collator=DataCollatorWithPadding(bert_tok),
                     args={"remove_unused_columns": True}))


class MSERegressor(nn.Module):
    def __init__(self, vocab: int, squeeze: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.squeeze = nn.Embedding(vocab, 16), nn.Linear(16, 1), squeeze

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        logits = self.head(self.emb(input_ids).mean(1))
        pred = logits.squeeze(-1) if self.squeeze else logits
        return {"loss": nn.functional.mse_loss(pred, labels), "logits": logits}


def test_regression_labels_broadcast_silently(bert_tok):
    rows = _rows(bert_tok, [0.5, 1.5, 2.0, 0.0])
    report = check(MSERegressor(len(bert_tok), squeeze=False), bert_tok, rows, data_collator=_collate(bert_tok))
    f = _finding(report, "label-shape")
    assert "broadcasts them to [3, 3]" in f.message and "squeeze(-1)" in f.fix
    _no_errors(check(MSERegressor(len(bert_tok), squeeze=True), bert_tok, rows, data_collator=_collate(bert_tok)))


class Features(nn.Module):
    """A plain PyTorch classifier on feature vectors: forward(x) -> logits; the loop computes the loss."""

    def __init__(self, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, classes))

    def forward(self, x):
        return self.net(x)


def test_tensor_dataset_targets_out_of_range_and_float():
    from torch.utils.data import TensorDataset

    x = torch.randn(10, 6)
    one_based = TensorDataset(x, torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 3, 1]))
    f = _finding(check(Features(), train_dataset=one_based), "label-out-of-range")
    assert "3 in items 2, 5, 8" in f.message and "subtract 1" in f.fix
    floats = TensorDataset(x, torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0, 2.0, 1.0, 0.0, 2.0, 1.0]))
    assert "label-dtype" in check(Features(), train_dataset=floats).codes()
    _no_errors(check(Features(), train_dataset=TensorDataset(x, torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0]))))


def test_label_columns_shaped_for_the_other_head(bert_tok):
    rows = [dict(bert_tok(r["sentence"])) for r in sentiment_rows(6)]
    for r in rows:
        r["labels"] = list(r["input_ids"])  # copied from a language-model script
    rows[1]["labels"] = rows[1]["input_ids"] = rows[1]["input_ids"][:-2] + [3]
    report = check(_bert_seq_cls(bert_tok), bert_tok, rows, data_collator=_collate(bert_tok))
    f = _finding(report, "label-shape")
    assert "one label per token in 6 of 6 rows" in f.message
    assert "collate-failed" not in report.codes(), str(report)
    from transformers import DataCollatorForTokenClassification

    report = check(_ner_model(bert_tok), bert_tok, _rows(bert_tok, [0, 1, 2, 1]),
                   data_collator=DataCollatorForTokenClassification(bert_tok))
    f = _finding(report, "label-shape")
    assert "one label per row in 4 of 4 rows" in f.message and "collate-failed" not in report.codes(), str(report)


def test_multi_label_vectors_are_not_token_labels_even_without_logits(bert_tok):
    class Opaque(nn.Module):
        """Its head is no nn.Linear, so no logits can be read: the labels' form alone must not look ragged."""

        def __init__(self):
            super().__init__()
            self.emb, self.w = nn.Embedding(len(bert_tok), 3), nn.Parameter(torch.zeros(3))

        def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
            logits = self.emb(input_ids).mean(1) + self.w
            return {"loss": nn.functional.binary_cross_entropy_with_logits(logits, labels)}

    vectors = [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    report = check(Opaque(), bert_tok, _rows(bert_tok, vectors), data_collator=_collate(bert_tok))
    assert "labels-not-padded" not in report.codes(), str(report)


# ------------------------------------------------- padded positions trained, whatever the pad id (issue 36)


def _max_length_rows(tok, eos_in_text: bool = False, n: int = 6, length: int = 32) -> list[dict]:
    """The common recipe: padding="max_length", labels = input_ids copied after padding."""
    texts = [r["sentence"] + (tok.eos_token if eos_in_text else "") for r in sentiment_rows(n)]
    enc = tok(texts, padding="max_length", max_length=length)
    return [{"input_ids": ids, "attention_mask": m, "labels": list(ids)}
            for ids, m in zip(enc["input_ids"], enc["attention_mask"], strict=True)]


def _padded(rows) -> int:
    return sum(m.count(0) for m in (r["attention_mask"] for r in rows))


@pytest.mark.parametrize("pad_is_eos", [True, False])
def test_labels_on_padding_found_by_position_through_check_trainer(tmp_path, pad_is_eos):
    import datasets
    from transformers import Trainer, TrainingArguments, default_data_collator

    from surefit.doctor import check_trainer

    tok = build_tokenizer(pad_is_eos=pad_is_eos)
    model = build_tiny_lm(tok)
    rows = _max_length_rows(tok)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=4)
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                      data_collator=default_data_collator)
    report = check_trainer(trainer)
    f = _finding(report, "labels-pad-trained")
    # pad == eos: the first pad position of each row is the row's EOS (labelled: the model learns to stop), the rest
    # is padding; pad != eos: every pad position is padding
    expected = _padded(rows) - (len(rows) if pad_is_eos else 0)
    assert f.severity == "error" and f"{expected} of {32 * len(rows)} label positions" in f.message, f.message
    assert f"in {len(rows)} rows of train_dataset" in f.message and f.where == "train_dataset column 'labels', row 0"
    assert "[t if m else -100 for t, m in zip(input_ids, attention_mask)]" in f.fix
    assert ("tokenizer.eos_token" in f.fix) == pad_is_eos
    # pad == eos: the EOS is labelled at its first occurrence, so "append EOS" would be the wrong advice; with a
    # distinct pad token these rows really have no EOS
    assert ("eos-missing" in report.codes()) != pad_is_eos, str(report)


@pytest.mark.parametrize("pad_is_eos", [True, False])
def test_labels_on_padding_masked_by_position_is_clean(pad_is_eos):
    tok = build_tokenizer(pad_is_eos=pad_is_eos)
    model = build_tiny_lm(tok)
    rows = _max_length_rows(tok, eos_in_text=True)
    for r in rows:  # the fix as the finding gives it
        r["labels"] = [t if m else -100 for t, m in zip(r["input_ids"], r["attention_mask"], strict=True)]
    from transformers import default_data_collator

    report = check(model, tok, rows, data_collator=default_data_collator)
    _no_errors(report)
    assert not {"labels-pad-trained", "eos-missing", "eos-masked"} & set(report.codes()), str(report)


def test_labels_on_left_padding_are_found():
    tok = build_tokenizer(pad_is_eos=True)
    tok.padding_side = "left"
    rows = _max_length_rows(tok, eos_in_text=True)
    f = _finding(check(build_tiny_lm(tok), tok, rows), "labels-pad-trained")
    assert f"{_padded(rows)} of {32 * len(rows)} label positions" in f.message, f.message


def test_collator_that_labels_padding_is_named_with_its_fix():
    """A hand-written collator copying input_ids into labels after padding with EOS (no mask applied)."""
    tok = build_tokenizer(pad_is_eos=True)
    rows = [{"input_ids": tok(r["sentence"] + tok.eos_token)["input_ids"]} for r in sentiment_rows(6)]

    def collate(items):
        n = max(len(it["input_ids"]) for it in items)
        ids = torch.tensor([it["input_ids"] + [tok.pad_token_id] * (n - len(it["input_ids"])) for it in items])
        mask = torch.tensor([[1] * len(it["input_ids"]) + [0] * (n - len(it["input_ids"])) for it in items])
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    f = _finding(check(build_tiny_lm(tok), tok, rows, data_collator=collate), "labels-pad-trained")
    assert "the batch's `labels` trains" in f.message and "collate leaves them trained" in f.message
    assert "attention_mask is 0" in f.fix and "data_collator (collate)" in f.where


@pytest.mark.parametrize("pad_is_eos", [True, False])
def test_standard_lm_recipes_stay_clean_for_both_pad_forms(tmp_path, pad_is_eos):
    """DataCollatorForLanguageModeling, DataCollatorForSeq2Seq and a TRL completion mask: no padding trained."""
    import datasets
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    tok = build_tokenizer(pad_is_eos=pad_is_eos)
    model = build_tiny_lm(tok)
    texts = [r["sentence"] for r in sentiment_rows(8)]
    plain = [{"input_ids": tok(t)["input_ids"]} for t in texts]
    report = check(model, tok, plain, data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    assert "labels-pad-trained" not in report.codes(), str(report)
    # DataCollatorForSeq2Seq over unpadded rows with prompt-masked labels and EOS
    rows = []
    for t in texts:
        prompt, answer = tok("is this positive: ")["input_ids"], tok(t)["input_ids"] + [tok.eos_token_id]
        rows.append({"input_ids": prompt + answer, "attention_mask": [1] * (len(prompt) + len(answer)),
                     "labels": [-100] * len(prompt) + answer})
    report = check(model, tok, datasets.Dataset.from_list(rows), data_collator=DataCollatorForSeq2Seq(tok))
    _no_errors(report)
    assert "labels-pad-trained" not in report.codes() and "eos-missing" not in report.codes(), str(report)
    # TRL's completion-mask collator (padding never labelled)
    from doctor.test_recipes import CompletionCollator

    trl_rows = [{"input_ids": r["input_ids"], "completion_mask": [int(x != -100) for x in r["labels"]]}
                for r in rows]
    report = check(model, tok, trl_rows, data_collator=CompletionCollator(tok.pad_token_id))
    _no_errors(report)
    assert "labels-pad-trained" not in report.codes(), str(report)
