"""Preference losses on chosen / rejected pairs (DPO's sigmoid, IPO, hinge, SimPO, ORPO) and the sequence
log-probabilities they compare.

A pair is one example of the loop: its two sequences are collated together (``data/pairs.PairCollator``: chosen rows
first, then rejected), the loss function returns the SUM of per-pair losses and the number of pairs, and the loop
divides by the pairs of the whole accumulated step, so batch 8 x accumulation 1 and batch 1 x accumulation 8 give the
same update, and an out-of-memory split (which splits a step by examples) never separates a pair.

The reference: precomputed log-probabilities carried by the batch (``reference_logps``), or, for LoRA, the same model
with its adapters switched off for one no-grad forward (peft's ``disable_adapter``): no second copy of the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from surefit.data.collate import IGNORE_INDEX
from surefit.training.loss import base_forward_params, model_attention_mask

Reference = Literal["adapters_off", "precomputed", "none"]


def sequence_logps(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum of log p(token) over its supervised tokens, and how many there are (fp32, ``[rows]`` each).

    The LM head runs at supervised positions only (``logits_to_keep`` with a boolean mask), so the prompt never
    materialises full-vocabulary logits.
    """
    labels = batch["labels"]
    target_mask = labels[:, 1:] != IGNORE_INDEX  # position t predicts token t+1
    targets = labels[:, 1:][target_mask]
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = target_mask
    kwargs = {"input_ids": batch["input_ids"], "use_cache": False,
              "attention_mask": model_attention_mask(model, batch.get("attention_mask"))}
    if "logits_to_keep" in base_forward_params(model):
        logits = model(**kwargs, logits_to_keep=keep).logits
        logits = logits.reshape(-1, logits.shape[-1])
    else:
        logits = model(**kwargs).logits[keep]
    # fp32 for the softmax: bf16 log-probabilities over a large vocabulary lose about 2 digits.
    per_token = -F.cross_entropy(logits.float(), targets, reduction="none")
    rows = target_mask.nonzero()[:, 0]
    sums = torch.zeros(labels.shape[0], dtype=torch.float32, device=labels.device).index_add(0, rows, per_token)
    return sums, target_mask.sum(1).to(torch.float32)


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """The base model for the duration (the LoRA reference), with no second copy of the weights.

    Plain LoRA layers (what surefit's fused forward covers) keep their forward and get a scaling of 0: the adapter adds
    an exact zero, so the reference is the base model computed with the policy's own arithmetic, and before step 1 the
    two log-probabilities are equal to the last bit (under bf16 peft's disabled path rounds the layer outputs to 16
    bits where the fused forward keeps the fp32 sum: 1e-3 apart per token, a step-0 DPO loss of 0.64 instead of
    ln 2 on SmolLM2). Any other adapter (DoRA, several adapters, quantised layers) uses peft's ``disable_adapter``.
    """
    from surefit.models import plain_lora_adapter

    inner = getattr(model, "module", model)
    if not hasattr(inner, "disable_adapter"):
        raise ValueError("the reference 'adapters off' needs a LoRA (peft) model; full fine-tuning precomputes it")
    layers = [m for m in inner.modules() if hasattr(m, "lora_A") and hasattr(m, "scaling")]
    names = [plain_lora_adapter(m) for m in layers]
    if not layers or any(n is None for n in names):
        with inner.disable_adapter():
            yield
        return
    saved = [(m, n, m.scaling[n]) for m, n in zip(layers, names, strict=True)]
    try:
        for m, n, _ in saved:
            m.scaling[n] = 0.0
        yield
    finally:
        for m, n, value in saved:
            m.scaling[n] = value


@dataclass
class PairLogps:
    """What a preference loss compares, per pair (``[pairs]`` tensors).

    Attributes:
        chosen, rejected: summed log-probabilities of each answer under the policy;
        ref_chosen, ref_rejected: the same under the reference (None for the reference-free SimPO and ORPO);
        n_chosen, n_rejected: supervised tokens of each answer (IPO, SimPO and ORPO average per token).
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    n_chosen: torch.Tensor
    n_rejected: torch.Tensor


def pair_losses(kind: str, logps: PairLogps, *, beta: float, gamma: float = 0.5,
                orpo_lambda: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the implicit rewards of both answers, as TRL defines them.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``[pairs]``.

    - sigmoid (DPO): ``-log sigmoid(beta * ((c - c_ref) - (r - r_ref)))``;
    - hinge: ``relu(1 - beta * ((c - c_ref) - (r - r_ref)))``;
    - ipo: ``((c - c_ref) / n_c - (r - r_ref) / n_r - 1 / (2 beta))^2`` (per-token log-ratios, as TRL);
    - simpo: ``-log sigmoid(beta * (c / n_c - r / n_r) - gamma)``;
    - orpo: ``-c / n_c - lambda * log sigmoid(log odds(c / n_c) - log odds(r / n_r))``,
      with ``log odds(p) = p - log(1 - exp(p))``.
    """
    chosen, rejected, ref_chosen, ref_rejected = logps.chosen, logps.rejected, logps.ref_chosen, logps.ref_rejected
    n_chosen, n_rejected = logps.n_chosen, logps.n_rejected
    if kind in ("simpo", "orpo"):
        c_avg, r_avg = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        if kind == "simpo":
            losses = -F.logsigmoid(beta * (c_avg - r_avg) - gamma)
            return losses, beta * c_avg.detach(), beta * r_avg.detach()
        log_odds = (c_avg - r_avg) - (torch.log1p(-torch.exp(c_avg)) - torch.log1p(-torch.exp(r_avg)))
        losses = -c_avg - orpo_lambda * F.logsigmoid(log_odds)
        return losses, orpo_lambda * c_avg.detach(), orpo_lambda * r_avg.detach()
    assert ref_chosen is not None and ref_rejected is not None, f"--loss {kind} needs a reference"
    c_ratio, r_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = c_ratio - r_ratio
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif kind == "ipo":
        losses = (c_ratio / n_chosen.clamp(min=1) - r_ratio / n_rejected.clamp(min=1) - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}")
    return losses, beta * c_ratio.detach(), beta * r_ratio.detach()


@dataclass
class PairScores:
    """One batch of pairs scored: per pair, the policy's (and the reference's) log-probabilities, the loss and the
    rewards (``[pairs]`` tensors; the reference ones None when the loss needs none)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


@dataclass
class PreferenceLoss:
    """The loop's loss function for pairs: ``(model, batch) -> (sum of per-pair losses, pairs)``.

    Attributes:
        kind: sigmoid | ipo | hinge | simpo | orpo; beta, gamma, orpo_lambda: its settings.
        reference: ``"precomputed"`` (the batch carries ``reference_logps``), ``"adapters_off"`` (LoRA: one no-grad
            forward with the adapters off), ``"none"`` (SimPO, ORPO).
    """

    kind: str
    beta: float
    reference: Reference
    gamma: float = 0.5
    orpo_lambda: float = 0.1

    def reference_logps(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.reference == "none":
            return None
        if "reference_logps" in batch:
            ref = batch["reference_logps"].to(torch.float32)
            return ref[:, 0], ref[:, 1]
        if self.reference == "precomputed":
            raise ValueError("the batch carries no reference_logps although the reference is precomputed")
        with torch.no_grad(), adapters_off(model):
            logps, _ = sequence_logps(model, batch)
        pairs = logps.shape[0] // 2
        return logps[:pairs], logps[pairs:]

    def score(self, model: Any, batch: dict[str, torch.Tensor]) -> PairScores:
        """The policy's and reference's log-probabilities of each pair, its loss and rewards."""
        logps, counts = sequence_logps(model, batch)
        pairs = logps.shape[0] // 2
        ref = self.reference_logps(model, batch)
        ref_c, ref_r = ref if ref is not None else (None, None)
        compared = PairLogps(logps[:pairs], logps[pairs:], ref_c, ref_r, counts[:pairs], counts[pairs:])
        losses, c_rew, r_rew = pair_losses(self.kind, compared, beta=self.beta, gamma=self.gamma,
                                           orpo_lambda=self.orpo_lambda)
        return PairScores(logps[:pairs], logps[pairs:], ref_c, ref_r, losses, c_rew, r_rew)

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        scores = self.score(model, batch)
        return scores.losses.sum(), int(scores.losses.shape[0])


@torch.no_grad()
def compute_reference(model: Any, features: Sequence[dict[str, Any]], collate: Any, batch_size: int, accelerator: Any,
                      adapters: bool) -> list[list[float]]:
    """``[chosen, rejected]`` reference log-probabilities of every pair, computed once (before step 1): the model as
    it is (full fine-tuning, before any step) or with its adapters off (``adapters``)."""
    was = model.training
    model.eval()
    out: list[list[float]] = []
    try:
        for start in range(0, len(features), batch_size):
            batch = collate(features[start:start + batch_size])
            batch = {k: v.to(accelerator.device) for k, v in batch.items() if k != "reference_logps"}
            with accelerator.autocast(), (adapters_off(model) if adapters else contextlib.nullcontext()):
                logps, _ = sequence_logps(model, batch)
            pairs = logps.shape[0] // 2
            out += [[float(c), float(r)] for c, r in zip(logps[:pairs].tolist(), logps[pairs:].tolist(), strict=True)]
    finally:
        model.train(was)
    return out
