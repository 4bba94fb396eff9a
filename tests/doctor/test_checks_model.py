"""The model-side checks: each broken setup is reported with its offending value and place; its healthy twin is not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import build_bert_tokenizer, build_tiny_lm, build_tokenizer, qa_rows, sentiment_rows
from surefit.data.collate import PadCollator
from surefit.doctor import Report, check, explain


def codes_of(report: Report, code: str) -> list:
    return [f for f in report.findings if f.code == code]


def only(report: Report, code: str):
    found = codes_of(report, code)
    assert len(found) == 1, str(report)
    return found[0]


def healthy(report: Report, code: str) -> None:
    assert not codes_of(report, code), str(report)
    assert not report.has_errors, str(report)


# ------------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(pad_is_eos=False)


@pytest.fixture(scope="module")
def lm(tok):
    return build_tiny_lm(tok)


def lm_items(tok, n: int = 6, bos: int = 0) -> list[dict]:
    """Causal-LM items of varying length that end with EOS (optionally starting with ``bos`` BOS tokens)."""
    items = []
    for row in qa_rows(n):
        ids = [tok.bos_token_id] * bos + tok(row["input"] + " " + row["target"]).input_ids[: 10 + len(items)]
        ids += [tok.eos_token_id]
        items.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)})
    return items


@pytest.fixture(scope="module")
def bert_tok():
    return build_bert_tokenizer()


def bert_classifier(bert_tok, type_vocab_size: int = 2, positions: int = 64):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=len(bert_tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=positions, type_vocab_size=type_vocab_size, num_labels=2))


def cls_items(tokenizer, n: int = 6, idx: bool = False) -> list[dict]:
    items = []
    for row in sentiment_rows(n, labels=(0, 1)):
        enc = tokenizer(row["sentence"] + " very" * (len(items) % 3))
        item = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "labels": row["label"]}
        if idx:
            item["idx"] = row["idx"]
        items.append(item)
    return items


def llama_classifier(tok, pad_token_id):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_labels=2, pad_token_id=pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id))


def test_healthy_causal_lm_has_no_model_findings(tok, lm):
    report = check(lm, tok, lm_items(tok), data_collator=PadCollator(tok.pad_token_id), args={"batch_size": 4})
    assert not report.has_errors, str(report)
    assert not report.findings, str(report)


# ------------------------------------------------------------------------------------------- input-dim-mismatch


class Projection(nn.Module):
    """The seed: features projected by nn.Linear(271 -> 256), a GRU, a 3-class head."""

    def __init__(self, vocab: int = 271):
        super().__init__()
        self.projection = nn.Linear(vocab, 256)
        self.encoder = nn.GRU(256, 32, batch_first=True)
        self.head = nn.Linear(32, 3)

    def forward(self, inputs_embeds, labels=None):
        out, _ = self.encoder(self.projection(inputs_embeds))
        logits = self.head(out.mean(1))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def feature_items(features: int, dtype=torch.float32) -> list[dict]:
    torch.manual_seed(0)
    return [{"inputs_embeds": torch.randn(20, features).to(dtype), "labels": i % 3} for i in range(4)]


def test_input_dim_mismatch_names_layer_expectation_and_cause():
    report = check(Projection(), train_dataset=feature_items(4000), args={"batch_size": 2})
    f = only(report, "input-dim-mismatch")
    assert f.severity == "error"
    assert f.where == "layer 'projection', input 'inputs_embeds'"
    assert "shape mismatch at layer 'projection' (nn.Linear(271 -> 256)): 'inputs_embeds' arrives as [B, 20, 4000]" \
        in f.message
    assert "expects a last dimension of 271" in f.message
    assert "likely cause: wrong feature (vocabulary) size: 'inputs_embeds' has 4000 features per position" in f.message
    assert "forward-failed" not in report.codes()  # explained, not reported twice
    raw = RuntimeError("mat1 and mat2 shapes cannot be multiplied (40x4000 and 271x256)")
    assert explain(raw, model=Projection(), train_dataset=feature_items(4000), args={"batch_size": 2}) == f


def test_input_dtype_mismatch_is_reported():
    f = only(check(Projection(), train_dataset=feature_items(271, torch.float64)), "input-dim-mismatch")
    assert "dtype mismatch at layer 'projection'" in f.message and "float64" in f.message
    assert "float32" in f.fix


def test_input_dims_healthy_twin():
    healthy(check(Projection(), train_dataset=feature_items(271), args={"batch_size": 2}), "input-dim-mismatch")


# ------------------------------------------------------------------------------------------- unexpected-columns


class Classifier(nn.Module):
    """A plain classifier whose forward takes no **kwargs."""

    def __init__(self, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.emb(input_ids).mean(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_unexpected_idx_column_explains_the_seed_error(bert_tok):
    model, items, collate = Classifier(len(bert_tok)), cls_items(bert_tok, idx=True), PadCollator(0)
    f = only(check(model, bert_tok, items, data_collator=collate), "unexpected-columns")
    assert f.severity == "error" and f.where == "batch keys 'idx'"
    assert "forward() got an unexpected keyword argument 'idx'" in f.message
    assert "attention_mask, input_ids, labels" in f.message
    assert "remove_unused_columns=True" in f.fix and "remove_columns" in f.fix
    raw = TypeError("forward() got an unexpected keyword argument 'idx'")
    assert explain(raw, model=model, train_dataset=items, data_collator=collate) == f


def test_transformers_classifier_with_idx_column(bert_tok):
    model, items, collate = bert_classifier(bert_tok), cls_items(bert_tok, idx=True), PadCollator(0)
    report = check(model, bert_tok, items, data_collator=collate, args={"batch_size": 4})
    f = only(report, "unexpected-columns")
    assert "'idx'" in f.message and "swallows it silently" in f.message
    raw = TypeError("BertForSequenceClassification.forward() got an unexpected keyword argument 'idx'")
    assert explain(raw, model=model, train_dataset=items, data_collator=collate).code == "unexpected-columns"
    dropped = only(check(model, bert_tok, items, data_collator=collate, args={"remove_unused_columns": True}),
                   "unexpected-columns")
    assert dropped.severity == "info" and "drops them silently" in dropped.message


def test_unexpected_columns_healthy_twin(bert_tok):
    healthy(check(Classifier(len(bert_tok)), bert_tok, cls_items(bert_tok), data_collator=PadCollator(0)),
            "unexpected-columns")
    healthy(check(bert_classifier(bert_tok), bert_tok, cls_items(bert_tok), data_collator=PadCollator(0)),
            "unexpected-columns")


# ------------------------------------------------------------------------------------------ token-id-out-of-range


def test_token_added_without_resizing(tok):
    grown = copy.deepcopy(tok)
    model = build_tiny_lm(grown)  # built before the token is added
    grown.add_tokens(["<tool>"])
    new_id = grown.convert_tokens_to_ids("<tool>")
    items = lm_items(grown)
    items[3]["input_ids"][1] = new_id
    report = check(model, grown, items, data_collator=PadCollator(grown.pad_token_id))
    f = only(report, "token-id-out-of-range")
    assert f.severity == "error"
    assert f"token id {new_id} (train_dataset row 3, key 'input_ids') is >= the {new_id} rows" in f.message
    assert f.where == "train_dataset row 3, key 'input_ids'"
    assert "resize_token_embeddings(len(tokenizer))" in f.fix
    assert "forward-failed" not in report.codes()

    model.resize_token_embeddings(len(grown))
    healthy(check(model, grown, items, data_collator=PadCollator(grown.pad_token_id)), "token-id-out-of-range")


def test_token_ids_scanned_in_a_datasets_column_and_tokenizer_size(tok, lm):
    from datasets import Dataset

    items = lm_items(tok)
    items[5]["input_ids"][2] = len(tok) + 7
    f = only(check(lm, tok, Dataset.from_list(items), data_collator=PadCollator(tok.pad_token_id)),
             "token-id-out-of-range")
    assert f"token id {len(tok) + 7}" in f.message and f.where == "train_dataset row 5, key 'input_ids'"
    grown = copy.deepcopy(tok)
    grown.add_tokens(["<x>"])
    warning = only(check(lm, grown, lm_items(tok), data_collator=PadCollator(tok.pad_token_id)),
                   "token-id-out-of-range")
    assert warning.severity == "warning" and f"{len(grown)} tokens" in warning.message


# --------------------------------------------------------------------------- sequence-too-long / no-max-length


def test_sequence_longer_than_positions(bert_tok):
    items = cls_items(bert_tok)
    items[2] = {"input_ids": [2] + [10] * 78 + [3], "attention_mask": [1] * 80, "labels": 1}
    report = check(bert_classifier(bert_tok), bert_tok, items, data_collator=PadCollator(0))
    f = only(report, "sequence-too-long")
    assert "the longest sequence has 80 tokens (train_dataset row 2, key 'input_ids')" in f.message
    assert "64 positions (config.max_position_embeddings)" in f.message and "max_length=64" in f.fix
    assert "forward-failed" not in report.codes()
    items[2] = {"input_ids": [2] + [10] * 62 + [3], "attention_mask": [1] * 64, "labels": 1}
    healthy(check(bert_classifier(bert_tok), bert_tok, items, data_collator=PadCollator(0)), "sequence-too-long")


def test_truncation_without_max_length(tok, lm):
    settings = {"column": "text", "truncation": True, "padding": False, "max_length": None}
    report = check(lm, tok, lm_items(tok), data_collator=PadCollator(tok.pad_token_id), args={"tokenize": settings})
    f = only(report, "no-max-length")
    assert f.where == "tokenize column 'text'" and "max_length=None" in f.message and "1e+30" in f.message
    assert "max_length=512 (the model's config.max_position_embeddings)" in f.fix
    settings["max_length"] = 128
    healthy(check(lm, tok, lm_items(tok), data_collator=PadCollator(tok.pad_token_id), args={"tokenize": settings}),
            "no-max-length")


# ------------------------------------------------------------------------------------------ token-type-out-of-range


def test_segment_ids_beyond_type_vocabulary(bert_tok):
    pairs = [bert_tok("the movie was good", "very good" + " very" * i) for i in range(4)]
    items = [{"input_ids": p.input_ids, "token_type_ids": p.token_type_ids, "attention_mask": p.attention_mask,
              "labels": i % 2} for i, p in enumerate(pairs)]
    report = check(bert_classifier(bert_tok, type_vocab_size=1), bert_tok, items, data_collator=PadCollator(0))
    f = only(report, "token-type-out-of-range")
    assert "token_type_ids value 1" in f.message and "type_vocab_size 1" in f.message
    assert f.where.endswith("key 'token_type_ids'") and "return_token_type_ids=False" in f.fix
    assert "forward-failed" not in report.codes()
    healthy(check(bert_classifier(bert_tok, type_vocab_size=2), bert_tok, items, data_collator=PadCollator(0)),
            "token-type-out-of-range")


# ----------------------------------------------------------------------------------------------- padding


def test_padding_without_pad_token(tok, lm):
    from transformers import DataCollatorForLanguageModeling

    no_pad = copy.deepcopy(tok)
    no_pad.pad_token = None
    items = [{"input_ids": it["input_ids"]} for it in lm_items(tok)]
    report = check(lm, no_pad, items, data_collator=DataCollatorForLanguageModeling(no_pad, mlm=False))
    f = only(report, "no-pad-token")
    assert f.where == "tokenizer.pad_token" and "item lengths vary from" in f.message
    assert "tokenizer.pad_token = tokenizer.eos_token" in f.fix
    healthy(check(lm, tok, items, data_collator=DataCollatorForLanguageModeling(tok, mlm=False)), "no-pad-token")


def test_decoder_classifier_without_pad_id(tok):
    items = cls_items(tok)
    report = check(llama_classifier(tok, None), tok, items, data_collator=PadCollator(tok.pad_token_id),
                   args={"batch_size": 4})
    f = only(report, "classifier-no-pad-id")
    assert f.where == "model.config.pad_token_id" and "is None" in f.message and "batches of 4" in f.message
    assert f"model.config.pad_token_id = tokenizer.pad_token_id (= {tok.pad_token_id})" == f.fix
    assert "forward-failed" not in report.codes()
    other = (tok.pad_token_id + 1) % len(tok)
    wrong = only(check(llama_classifier(tok, other), tok, items, data_collator=PadCollator(tok.pad_token_id)),
                 "classifier-no-pad-id")
    assert f"config.pad_token_id = {other}" in wrong.message and f"padded with id {tok.pad_token_id}" in wrong.message
    healthy(check(llama_classifier(tok, tok.pad_token_id), tok, items, data_collator=PadCollator(tok.pad_token_id),
                  args={"batch_size": 4}), "classifier-no-pad-id")
    one = check(llama_classifier(tok, None), tok, items, data_collator=PadCollator(tok.pad_token_id),
                args={"batch_size": 1})  # batches of one never need the pad id (the dry run's pair is no evidence)
    assert not {"classifier-no-pad-id", "forward-failed"} & set(one.codes()), str(one)


def test_double_bos(tok, lm):
    report = check(lm, tok, lm_items(tok, bos=2), data_collator=PadCollator(tok.pad_token_id))
    f = only(report, "double-bos")
    assert f.severity == "warning" and f"6 of 6 row(s) start with the BOS token (id {tok.bos_token_id}) twice" \
        in f.message
    assert f.where == "train_dataset row 0, key 'input_ids'" and "add_special_tokens=False" in f.fix
    healthy(check(lm, tok, lm_items(tok, bos=1), data_collator=PadCollator(tok.pad_token_id)), "double-bos")


def test_generation_with_right_padding(tok, lm):
    side = copy.deepcopy(tok)
    side.padding_side = "right"
    report = check(lm, side, lm_items(tok), data_collator=PadCollator(tok.pad_token_id), args={"generation": True})
    f = only(report, "generation-right-padding")
    assert f.where == "tokenizer.padding_side" and "'right'" in f.message and "padding_side = 'left'" in f.fix
    side.padding_side = "left"
    healthy(check(lm, side, lm_items(tok), data_collator=PadCollator(tok.pad_token_id), args={"generation": True}),
            "generation-right-padding")


def test_padded_batch_without_attention_mask(tok, lm):
    def pad_ids_and_labels(items):  # pads input_ids and labels, forgets the mask
        width = max(len(it["input_ids"]) for it in items)
        return {"input_ids": torch.tensor([it["input_ids"] + [tok.pad_token_id] * (width - len(it["input_ids"]))
                                           for it in items]),
                "labels": torch.tensor([it["labels"] + [-100] * (width - len(it["labels"])) for it in items])}

    items = [{"input_ids": it["input_ids"], "labels": it["labels"]} for it in lm_items(tok)]
    f = only(check(lm, tok, items, data_collator=pad_ids_and_labels), "missing-attention-mask")
    assert f.where == "batch key 'attention_mask'" and "item lengths vary from 11 to" in f.message
    assert "input_ids, labels" in f.message and "attention_mask" in f.fix
    healthy(check(lm, tok, items, data_collator=PadCollator(tok.pad_token_id)), "missing-attention-mask")


# ------------------------------------------------------------------------------------------------------- LoRA


def test_lora_targets_missing(tok, lm):
    from peft import LoraConfig

    items, collate = lm_items(tok), PadCollator(tok.pad_token_id)
    f = only(check(lm, tok, items, data_collator=collate, peft_config=LoraConfig(target_modules=["query", "value"])),
             "lora-targets-missing")
    assert f.severity == "error" and "['query', 'value']" in f.message and f.where == "peft_config.target_modules"
    assert "q_proj, k_proj, v_proj, o_proj" in f.message and "'all-linear'" in f.fix
    regex = only(check(lm, tok, items, data_collator=collate, peft_config=LoraConfig(target_modules=r".*\.query")),
                 "lora-targets-missing")
    assert "regex '.*\\\\.query'" in regex.message
    partial = only(check(lm, tok, items, data_collator=collate,
                         peft_config=LoraConfig(target_modules=["q_proj", "query"])), "lora-targets-missing")
    assert partial.severity == "warning" and "['query']" in partial.message
    for targets in (["q_proj", "v_proj"], r".*\.(q_proj|v_proj)", "all-linear"):
        healthy(check(lm, tok, items, data_collator=collate, peft_config=LoraConfig(target_modules=targets)),
                "lora-targets-missing")


# ---------------------------------------------------------------------------------------------------- forward


class Broken(nn.Module):
    """Pools by a functional matmul outside any layer, with the wrong operand order when ``broken``."""

    def __init__(self, vocab: int, broken: bool):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.weight = nn.Parameter(torch.randn(2, 16))
        self.broken = broken

    def forward(self, input_ids, attention_mask=None, labels=None):
        pooled = self.emb(input_ids).mean(1)
        logits = self.weight @ pooled if self.broken else pooled @ self.weight.T
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_unexplained_forward_failure(bert_tok):
    items = cls_items(bert_tok)
    report = check(Broken(len(bert_tok), broken=True), bert_tok, items, data_collator=PadCollator(0))
    f = only(report, "forward-failed")
    assert f.severity == "error" and f.where == "model.forward"
    assert "the dry-run forward pass of Broken failed: RuntimeError: mat1 and mat2 shapes" in f.message
    assert "input_ids: tensor [" in f.message and "int64" in f.message and "labels: tensor [" in f.message
    assert "Traceback" not in f.message and "\n" not in f.message
    healthy(check(Broken(len(bert_tok), broken=False), bert_tok, items, data_collator=PadCollator(0)),
            "forward-failed")


# ------------------------------------------------------------------------------------------- nonfinite-weights


def test_nan_and_inf_weights_of_the_model_are_named_not_blamed_on_rows(tok, tmp_path):
    from transformers import AutoModelForCausalLM

    # A real damaged file: NaN norm values and an infinite weight saved to safetensors, then loaded back.
    broken = build_tiny_lm(tok)
    with torch.no_grad():
        broken.model.layers[1].post_attention_layernorm.weight[3] = float("nan")
        broken.model.layers[0].mlp.up_proj.weight[0, :2] = float("inf")
    broken.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    found = only(check(model, tok, lm_items(tok), data_collator=PadCollator(tok.pad_token_id)), "nonfinite-weights")
    assert found.severity == "error"
    assert "LlamaForCausalLM holds NaN or infinite weights as loaded (2 tensors): " in found.message
    assert "model.layers.0.mlp.up_proj.weight: 2 of " in found.message
    assert "model.layers.1.post_attention_layernorm.weight: 1 of 32 values" in found.message
    assert "whatever the rows" in found.message and "download or export the model again" in found.fix


def test_finite_weights_are_not_reported(tok, lm):
    healthy(check(lm, tok, lm_items(tok), data_collator=PadCollator(tok.pad_token_id)), "nonfinite-weights")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_one_pass_finiteness_test_agrees_with_counting_every_value(dtype):
    from surefit.doctor.checks_model import all_finite

    for shape in [(), (1,), (7, 5), (3, 1, 4097)]:
        clean = torch.randn(shape).to(dtype)
        assert all_finite(clean)
        n = clean.numel()
        for bad in (float("nan"), float("inf"), -float("inf")):
            for at in {0, n // 2, n - 1}:
                t = clean.clone().reshape(-1)
                t[at] = bad
                t = t.reshape(shape)
                assert not all_finite(t) and not bool(torch.isfinite(t).all()), (shape, bad, at)
    # finite values whose sum overflows are still finite (no sum is taken)
    assert all_finite(torch.full((4,), torch.finfo(dtype).max, dtype=dtype))


# ------------------------------------------------------------------------------------------- the run's own call


def test_a_dry_run_through_the_runs_own_call_is_the_forward_step_1_runs(tok, lm):
    """sft's dry run (Setup.call = causal_lm_dry_run): the model gets no labels and, for right padding, no mask, as
    in training; the logits the checks read are the model's own; a label the head cannot score is found before
    step 1 as the run's loss would fail on it."""
    from surefit.doctor.core import Setup, run_checks
    from surefit.training.loss import causal_lm_dry_run

    seen: list[dict] = []
    handle = lm.register_forward_pre_hook(lambda m, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    try:
        setup = Setup(lm, tok, lm_items(tok), None, PadCollator(tok.pad_token_id), {"batch_size": 4}, task="sft",
                      call=causal_lm_dry_run)
        healthy(run_checks(setup), "forward-failed")
        assert seen and "labels" not in seen[0] and seen[0]["attention_mask"] is None
        batch, _ = setup.batch()
        with torch.no_grad():
            plain = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert setup.logits().shape == plain.shape
        real = batch["attention_mask"].bool()  # right padding: the mask changes no real position's output
        assert torch.allclose(setup.logits()[real], plain[real], atol=1e-5)

        items = lm_items(tok)
        items[1]["labels"][-1] = lm.config.vocab_size + 5  # a supervised target outside the head's rows
        bad = Setup(lm, tok, items, None, PadCollator(tok.pad_token_id), {"batch_size": 4}, task="sft",
                    call=causal_lm_dry_run)
        found = only(run_checks(bad), "forward-failed")
        assert found.severity == "error" and "dry-run forward pass" in found.message
    finally:
        handle.remove()
