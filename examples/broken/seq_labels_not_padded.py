"""Seeds 000-002 rebuilt: pre-built, variable-length ``labels`` + ``DataCollatorForLanguageModeling``.

The rows were tokenized one by one with ``labels = input_ids`` (a common recipe), so every row has its own length.
``DataCollatorForLanguageModeling`` pads ``input_ids`` and ``attention_mask`` with the tokenizer, but a ``labels``
key already present is handed to ``tokenizer.pad`` as is, and turning ragged lists into one tensor fails with
``expected sequence of length 9 at dim 1 (got 14)``, which names neither the key nor the collator.

Run: ``python examples/broken/seq_labels_not_padded.py`` (a tiny Llama built from a config; nothing downloaded).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader
from transformers import DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from surefit.doctor import check, explain

TEXTS = [
    "the capital of France is Paris",
    "the cat sat on the mat near the river",
    "Berlin is the capital of Germany",
    "the dog ran to the park and the bird flew over the big green tree",
    "what is the capital of Germany ? Berlin",
    "the small red bird sat on the tree",
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the example's words, with separate pad, BOS and EOS tokens."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = sorted({w for t in TEXTS for w in t.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def build_model(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))


def main() -> None:
    tok = build_tokenizer()
    model = build_model(tok)
    rows = []
    for text in TEXTS:  # the seeds' recipe: tokenize each row, copy input_ids into labels, no padding yet
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": list(ids)})
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    args = {"batch_size": 4}

    print("1. one training step, raw:")
    error: Exception | None = None
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = next(iter(DataLoader(rows, batch_size=4, collate_fn=collator)))
        model(**batch).loss.backward()
        optimizer.step()
        print("   (no error)")
    except Exception as exc:  # noqa: BLE001 - shown, then explained
        error = exc
        print(f"   {type(exc).__name__}: {exc}")
        if exc.__cause__ is not None:
            print(f"   caused by {type(exc.__cause__).__name__}: {exc.__cause__}")

    print("\n2. surefit.doctor.check(...):")
    print(check(model, tok, train_dataset=rows, data_collator=collator, args=args, task="sft"))

    if error is not None:
        finding = explain(error, model, tok, train_dataset=rows, data_collator=collator, args=args, task="sft")
        print(f"\n3. explain(error, ...): [{finding.code}] {finding.message}")
        if finding.fix:
            print(f"   fix: {finding.fix}")


if __name__ == "__main__":
    main()
