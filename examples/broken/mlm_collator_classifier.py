"""A sequence classifier fed by a masked-LM collator: per-token labels where one label per row is needed.

Rebuilt from public issue reports: a classifier is fine-tuned with ``DataCollatorForLanguageModeling`` (copied
from a pretraining script). The collator builds labels of shape ``[batch, tokens]`` (-100 except at the masked
positions) and training fails with ``Expected input batch_size (4) to match target batch_size (28)``, an error
that reads like one-hot labels. The doctor reads the logits (``[batch, 2]``) against the labels and names the
collator.

Run: ``python examples/broken/mlm_collator_classifier.py`` (a tiny BERT built from a config; nothing downloaded).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch.utils.data import DataLoader
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
)

from surefit.doctor import check, explain

GOOD, BAD = ["good", "great", "lovely", "superb"], ["bad", "awful", "poor", "dull"]
FILLERS = ["movie", "film", "plot", "acting", "story"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted(set(GOOD + BAD + FILLERS + ["the", "was", "very"]))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                 ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def main() -> None:
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=64,
                                                     max_position_embeddings=64, num_labels=2))
    rows = [dict(tok(f"the {FILLERS[i % 5]} was very {(GOOD if i % 2 == 0 else BAD)[(i // 2) % 4]}"))
            for i in range(16)]
    collator = DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3, seed=0)
    args = {"batch_size": 4}

    print("1. one training step, raw:")
    error: Exception | None = None
    try:
        batch = next(iter(DataLoader(rows, batch_size=4, collate_fn=collator)))
        model(**batch).loss.backward()
        print("   (no error)")
    except Exception as exc:  # noqa: BLE001 - shown, then explained
        error = exc
        print(f"   {type(exc).__name__}: {exc}")

    print("\n2. surefit.doctor.check(...):")
    print(check(model, tok, train_dataset=rows, data_collator=collator, args=args))

    if error is not None:
        finding = explain(error, model, tok, train_dataset=rows, data_collator=collator, args=args)
        print(f"\n3. explain(error, ...): [{finding.code}] {finding.message}")
        if finding.fix:
            print(f"   fix: {finding.fix}")


if __name__ == "__main__":
    main()
