"""Seed 004 rebuilt: a classifier whose batches carry GLUE's ``idx`` column.

GLUE/SST-2 rows are ``{sentence, label, idx}``. Tokenizing with ``remove_columns=["sentence"]`` keeps ``idx``;
``DataCollatorWithPadding`` passes every key through, and a model whose ``forward`` names its inputs (a backbone
plus a head, the seeds' shape) fails with ``forward() got an unexpected keyword argument 'idx'``. (The Trainer drops
such columns only with ``remove_unused_columns=True``, and only for the model it can inspect.)

Run: ``python examples/broken/classifier_idx_column.py`` (a tiny BERT built from a config; nothing downloaded).
"""

from __future__ import annotations

import datasets
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch import nn
from torch.utils.data import DataLoader
from transformers import BertConfig, BertModel, DataCollatorWithPadding, PreTrainedTokenizerFast

from surefit.doctor import check, explain

GOOD, BAD = ["good", "great", "lovely", "superb"], ["bad", "awful", "poor", "dull"]
FILLERS = ["movie", "film", "plot", "acting", "story"]


def glue_rows(n: int = 16) -> list[dict]:
    """SST-2-shaped rows: sentence, label, idx."""
    return [{"sentence": f"the {FILLERS[i % 5]} was very {(GOOD if i % 2 == 0 else BAD)[(i // 2) % 4]}",
             "label": 1 - i % 2, "idx": i} for i in range(n)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = sorted(set(GOOD + BAD + FILLERS + ["the", "was", "very"]))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                 ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


class BackboneClassifier(nn.Module):
    """A BERT backbone, mean-pooled over real tokens, then a linear head; forward names exactly what it takes."""

    def __init__(self, vocab_size: int, num_labels: int = 2):
        super().__init__()
        self.backbone = BertModel(BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=64, max_position_embeddings=64))
        self.head = nn.Linear(32, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        states = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state
        mask = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).unsqueeze(-1)
        logits = self.head((states * mask).sum(1) / mask.sum(1).clamp(min=1))
        return {"logits": logits, **({"loss": F.cross_entropy(logits, labels)} if labels is not None else {})}


def main() -> None:
    datasets.disable_progress_bars()
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = BackboneClassifier(len(tok))
    train = datasets.Dataset.from_list(glue_rows()).map(lambda b: tok(b["sentence"]), batched=True,
                                                         remove_columns=["sentence"])  # idx stays
    collator = DataCollatorWithPadding(tok)
    args = {"batch_size": 4, "remove_unused_columns": False}  # a plain training loop: nothing drops columns

    print(f"train columns: {train.column_names}")
    print("1. one training step, raw:")
    error: Exception | None = None
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = next(iter(DataLoader(train, batch_size=4, collate_fn=collator)))
        model(**batch)["loss"].backward()
        optimizer.step()
        print("   (no error)")
    except Exception as exc:  # noqa: BLE001 - shown, then explained
        error = exc
        print(f"   {type(exc).__name__}: {exc}")

    print("\n2. surefit.doctor.check(...):")
    print(check(model, tok, train_dataset=train, data_collator=collator, args=args, task="classify"))

    if error is not None:
        finding = explain(error, model, tok, train_dataset=train, data_collator=collator, args=args,
                          task="classify")
        print(f"\n3. explain(error, ...): [{finding.code}] {finding.message}")
        if finding.fix:
            print(f"   fix: {finding.fix}")


if __name__ == "__main__":
    main()
