"""Losses as sums over supervised items plus their count; the loop divides by the count of the whole accumulated
batch (across micro-batches and processes), never by the number of micro-batches.

Why sums: with padded, masked data, averaging each micro-batch and then dividing by the accumulation steps weights a
token in a short micro-batch more than one in a long micro-batch, so batch 8 x accumulation 1 and batch 1 x
accumulation 8 would train differently. Summing and dividing once by the total makes them the same update.
"""

from __future__ import annotations

import inspect
import weakref
from collections import Counter
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from surefit.data.collate import IGNORE_INDEX
from surefit.models import inner_model

# How often each LM-head path ran (tests and the profile read it): "fused", "unfused", "chunked" (unfused in
# recomputed chunks), "no_logits_to_keep" (full logits, then the selection).
HEAD_PATHS: Counter[str] = Counter()


class FusedHead(Protocol):
    """The LM head and the loss run fused, chunk by chunk, with no logits tensor: a speed-up the task hands in (the
    module ``training/speedups/fused_head.py`` is one); the core does not import speed-ups."""

    FUSED_CHUNK_VALUES: int

    def why_not_fused(self, model: Any) -> str | None:
        ...

    def fused_loss(self, model: Any, kwargs: dict[str, Any], keep: torch.Tensor, targets: torch.Tensor,
                   chunk_values: int) -> torch.Tensor | None:
        ...


class BatchPacker(Protocol):
    """Lays a batch out differently for the same loss (e.g. :class:`~surefit.training.speedups.prefixes.PrefixSharing`):
    ``pack`` returns the forward's keyword arguments, the positions to keep and their targets, or ``None``."""

    def pack(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor] | None:
        ...


def count_supervised_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss in a causal-LM batch (labels are shifted by one, so the first position never does)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def base_forward_params(model: Any) -> frozenset[str]:
    """The argument names of the forward of the transformers model inside any DDP / peft wrappers."""
    cls: Any = type(inner_model(model))
    return _params_of(cls)


@lru_cache(maxsize=64)
def _params_of(cls: Any) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


_causal: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attends_causally(model: Any) -> bool:
    """True when the model has attention layers and every one of them is causal (transformers marks each attention
    module with ``is_causal``; a BERT loaded as an LM without ``is_decoder``, for one, is not). Read once per model."""
    try:
        return _causal[model]
    except (KeyError, TypeError):
        pass
    flags = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    causal = bool(flags) and all(flags)
    try:
        _causal[model] = causal
    except TypeError:  # pragma: no cover - every nn.Module can be weakly referenced
        pass
    return causal


def model_attention_mask(model: Any, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The attention mask to give a causal LM: None when padding only ends rows and the model attends causally.

    Why: with padding only after the last real token of each row, causal attention already keeps every real token
    from seeing a pad, so the mask changes no real position's output (the pads' own outputs change, but they carry
    no loss and nothing reads them). Without it, transformers hands SDPA ``is_causal`` instead of a materialised
    [batch, 1, T, T] mask: the kernel skips the blocks above the diagonal (half the attention work), grouped-query
    attention runs without copying k and v per query head, and on a GPU the flash kernel becomes eligible.
    Measured on SmolLM2-135M (batch 4 x 251 tokens, bf16, 2-core CPU, in-process A/B): 2-3% of a training step.
    """
    if mask is None or mask.dim() != 2 or mask.shape[1] < 2:
        return mask
    if not bool((mask[:, 1:] <= mask[:, :-1]).all()) or not attends_causally(model):
        return mask  # left padding, holes, or an attention that is not causal: the mask is needed
    return None


def causal_lm_dry_run(model: Any, batch: Mapping[str, Any]) -> Any:
    """The doctor's dry run of a causal-LM training step: the model called as :func:`causal_lm_loss_sum` calls it
    (no labels passed in, the attention mask as :func:`model_attention_mask` gives it), then the next-token
    cross-entropy of the supervised positions, as the run computes it (a label the head cannot score fails here).

    Returns the model's output (its full logits, which the doctor's checks read). Why not ``model(**batch)``: that
    runs transformers' own loss, over every position's fp32 logits, which surefit's training never calls, and
    attends through a materialised padding mask the run does not use; on SmolLM2-135M (4 x 199 tokens) it is 20-25%
    slower and checks another path than step 1's.
    """
    out = model(input_ids=batch["input_ids"], attention_mask=model_attention_mask(model, batch.get("attention_mask")),
                use_cache=False)
    labels = batch["labels"]
    supervised = labels[:, 1:] != IGNORE_INDEX
    F.cross_entropy(out.logits[:, :-1][supervised].float(), labels[:, 1:][supervised], reduction="sum")
    return out


# Logits of at most this many values (supervised tokens x vocabulary) are computed in one piece; beyond it the LM head
# and the loss run in chunks whose logits are recomputed in the backward pass. 2**26 values are 256 MiB in fp32:
# a 152k vocabulary gets ~440 supervised tokens per chunk, SmolLM2's 49k about 1,350.
CHUNK_VALUES = 2**26


def _lm_head_owner(model: Any) -> tuple[Any, str] | None:
    """The module holding a plain ``nn.Linear`` output layer, and its attribute name (None if there is no such).

    Models that transform logits after the head (Gemma's soft-capping, Cohere's logit scale) or whose head is
    wrapped (e.g. a LoRA adapter on ``lm_head``) are left alone: the chunked path would compute different logits.
    """
    from torch import nn

    inner = inner_model(model)
    cfg = getattr(inner, "config", None)
    if cfg is None or getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return None
    name = next((n for n, m in inner.named_children() if m is head), None)
    return (inner, name) if name else None


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor) -> torch.Tensor:
    # fp32 for the softmax: bf16 log-probabilities over a large vocabulary lose about 2 digits.
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="sum")


def causal_lm_loss_sum(model: Any, batch: dict[str, torch.Tensor], chunk_values: int = CHUNK_VALUES,
                       share: BatchPacker | None = None, fused: FusedHead | None = None,
                       fused_chunk_values: int | None = None) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies over supervised positions, and how many there are.

    The LM head runs only at positions whose next token is supervised (``logits_to_keep`` with a boolean mask), so a
    prompt-heavy batch (SQuAD: ~4% of tokens carry loss) never materialises full-vocabulary logits for the prompt.
    With ``fused`` given the model returns the supervised hidden states instead (its head is swapped out
    during the forward only) and the head and the loss run fused, chunk by chunk
    (``fused_linear_cross_entropy``): no full logits tensor exists in the forward or the backward pass, whatever
    the share of supervised tokens (chat data: most of them). Models it does not cover (``why_not_fused``) take
    the unfused path. Unfused, when even the supervised logits would be large (more than ``chunk_values`` values: long completions, big
    vocabularies), the model returns the supervised hidden states instead (its head is swapped for an identity
    during the forward only) and the head and loss run in chunks under activation checkpointing, so at most one
    chunk of logits exists at a time, in the forward and in the backward. Models whose forward lacks
    ``logits_to_keep`` get full logits, then the same selection.

    Args:
        model: a causal LM (possibly wrapped by peft or DDP); it is called through its own ``forward`` (DDP's
            gradient synchronisation and peft's adapters depend on that).
        batch: ``input_ids``, ``attention_mask``, ``labels`` (-100 where there is no loss), shape ``[B, T]``. A
            right-padded mask is not passed on to a causal model (see :func:`model_attention_mask`).
        chunk_values: logits size above which the head runs in chunks.
        share: when given, rows of the batch that begin with the same prompt tokens have that prefix computed once
            (see :class:`PrefixSharing`); the loss is the same.
        fused: the fused head and loss (``fused_cross_entropy`` in the config: the task hands in
            ``training/speedups/fused_head``); ``None``: the unfused head.
        fused_chunk_values: logits values per chunk of the fused head (``None``: its own default).

    Returns:
        ``(loss_sum, n_tokens)``; ``loss_sum`` is a float32 scalar tensor.
    """
    from torch.utils.checkpoint import checkpoint

    packed = share.pack(model, batch) if share is not None else None
    if packed is None:
        labels = batch["labels"]
        target_mask = labels[:, 1:] != IGNORE_INDEX  # [B, T-1]: position t predicts token t+1
        targets = labels[:, 1:][target_mask]
        keep = torch.zeros_like(labels, dtype=torch.bool)
        keep[:, :-1] = target_mask
        kwargs = {"input_ids": batch["input_ids"],
                  "attention_mask": model_attention_mask(model, batch.get("attention_mask")), "use_cache": False}
    else:
        kwargs, keep, targets = packed
    n = int(targets.numel())
    if "logits_to_keep" not in base_forward_params(model):
        HEAD_PATHS["no_logits_to_keep"] += 1
        logits = model(**kwargs).logits[keep]
        return F.cross_entropy(logits.float(), targets, reduction="sum"), n
    if fused is not None and n and fused.why_not_fused(model) is None:
        chunk = fused.FUSED_CHUNK_VALUES if fused_chunk_values is None else fused_chunk_values
        loss = fused.fused_loss(model, kwargs, keep, targets, chunk)
        if loss is not None:
            return loss, n
    owner = _lm_head_owner(model) if n else None
    if owner is None or n * owner[0].get_output_embeddings().out_features <= chunk_values:
        HEAD_PATHS["unfused"] += 1
        logits = model(**kwargs, logits_to_keep=keep).logits  # [n, V], in (batch, position) order
        return _chunk_loss_from_logits(logits, targets), n
    HEAD_PATHS["chunked"] += 1
    inner, name = owner
    head = getattr(inner, name)
    setattr(inner, name, torch.nn.Identity())
    try:
        hidden = model(**kwargs, logits_to_keep=keep).logits  # the head's input: [n, hidden]
    finally:
        setattr(inner, name, head)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    step = max(1, chunk_values // head.out_features)
    loss = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, n, step):
        loss = loss + checkpoint(_chunk_loss, hidden[i : i + step], head.weight, head.bias, targets[i : i + step],
                                 use_reentrant=False)
    return loss, n


def _chunk_loss_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # fp32 for the softmax: bf16 log-probabilities over a large vocabulary lose about 2 digits.
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets, reduction="sum")


# --------------------------------------------------------------------------------------------- classification losses

ClassLoss = Literal["cross_entropy", "bce", "mse"]
# The loss each kind of classification trains with (--problem_type of the classify task).
PROBLEM_LOSS: dict[str, ClassLoss] = {"single": "cross_entropy", "multi": "bce", "regression": "mse"}


def classification_loss_sum(logits: torch.Tensor, labels: torch.Tensor, kind: ClassLoss) -> torch.Tensor:
    """Sum over examples of each example's mean loss; the loop divides by the example count of the whole step.

    ``cross_entropy``: class ids ``[B]`` (or ``[B, ...]`` for per-position classes) against logits ``[B, ..., C]``;
    ``bce``: multi-hot or probability targets of the logits' shape; ``mse``: values of the logits' shape (a trailing
    dimension of 1 is squeezed). The loss is computed in fp32 under mixed precision.
    """
    logits = logits.float()
    if kind == "cross_entropy":
        per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(), reduction="none")
        return per.reshape(labels.shape[0], -1).mean(1).sum()
    if logits.shape != labels.shape and logits.shape[-1] == 1:
        logits = logits.squeeze(-1)
    fn = F.mse_loss if kind == "mse" else F.binary_cross_entropy_with_logits
    per = fn(logits, labels.float().reshape(logits.shape), reduction="none")
    return per.reshape(labels.shape[0], -1).mean(1).sum()
