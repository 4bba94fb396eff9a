"""Losses as sums over supervised items plus their count; the loop divides by the count of the whole accumulated
batch (across micro-batches and processes), never by the number of micro-batches.

Why sums: with padded, masked data, averaging each micro-batch and then dividing by the accumulation steps weights a
token in a short micro-batch more than one in a long micro-batch, so batch 8 x accumulation 1 and batch 1 x
accumulation 8 would train differently. Summing and dividing once by the total makes them the same update.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

from surefit.data.collate import IGNORE_INDEX


def count_supervised_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss in a causal-LM batch (labels are shifted by one, so the first position never does)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _base_forward_params(model: Any) -> frozenset[str]:
    inner = model
    # peft (PeftModel -> LoraModel -> transformers model) and DDP (`module`) wrap the real model.
    for attr in ("get_base_model",):
        if hasattr(inner, attr):
            inner = inner.get_base_model()
    inner = getattr(inner, "module", inner)
    return _params_of(type(inner))


@lru_cache(maxsize=64)
def _params_of(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def causal_lm_loss_sum(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies over supervised positions, and how many there are.

    The LM head runs only at positions whose next token is supervised (``logits_to_keep`` with a boolean mask), so a
    prompt-heavy batch (SQuAD: ~4% of tokens carry loss) never materialises full-vocabulary logits for the prompt.
    Models whose forward lacks ``logits_to_keep`` get full logits, then the same selection.

    Args:
        model: a causal LM (possibly wrapped by peft or DDP); it is called through its own ``forward``.
        batch: ``input_ids``, ``attention_mask``, ``labels`` (-100 where there is no loss), shape ``[B, T]``.

    Returns:
        ``(loss_sum, n_tokens)``; ``loss_sum`` is a float32 scalar tensor.
    """
    labels = batch["labels"]
    target_mask = labels[:, 1:] != IGNORE_INDEX  # [B, T-1]: position t predicts token t+1
    targets = labels[:, 1:][target_mask]
    n = int(targets.numel())
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"), "use_cache": False}
    if "logits_to_keep" in _base_forward_params(model):
        keep = torch.zeros_like(labels, dtype=torch.bool)
        keep[:, :-1] = target_mask
        logits = model(**kwargs, logits_to_keep=keep).logits  # [n, V], in (batch, position) order
        logits = logits.reshape(-1, logits.shape[-1])
    else:
        logits = model(**kwargs).logits[:, :-1][target_mask]
    # fp32 for the softmax: bf16 log-probabilities over a large vocabulary lose about 2 digits.
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    return loss, n
