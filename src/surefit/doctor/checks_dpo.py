"""The doctor's checks of a preference-tuning setup, through two entry points rather than the registry (they need the
encoded pairs and the loss, which a :class:`~surefit.doctor.core.Setup` does not hold): :func:`check_pairs` on the
pairs and model ``surefit doctor --task dpo`` prepares (a reference that is not the starting policy, or that equals
the policy with the adapters on, the terminator masked), and :func:`check_dpo_trainer` on a user's TRL ``DPOTrainer``
(identical answers, truncation that empties an answer or the prompt or cuts an EOS, a reference sharing the policy's
weights)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from surefit.config.dpo_config import DPOConfig
from surefit.doctor.core import CODES, Finding, Report

DPO_CODES = {
    "dpo-identical-pair": "a pair whose chosen and rejected sequences are the same tokens",
    "dpo-terminator-masked": "an answer whose last token (its terminator: EOS or the end-of-turn token) has label -100",
    "dpo-reference-is-policy": "the reference computes the same log-probabilities as the trained policy (LoRA "
                               "adapters left on for the reference, or a ref_model sharing the policy's weights)",
    "dpo-step0-loss": "the loss before step 1 is not ln 2 (sigmoid) although the reference is the starting policy",
    "dpo-prompt-emptied": "a pair whose prompt truncation emptied (TRL truncation_mode keep_end with an answer as long "
                          "as max_length)",
    "dpo-truncation-empties": "a pair whose answer truncation empties, or whose two answers it makes identical",
}
CODES.update(DPO_CODES)
# Raised by this module's own entry points, not by a registered check (tests/doctor/test_codes_covered.py reads it).
ENTRY_POINT_CODES = frozenset(DPO_CODES)
MAX_SHOWN = 5


def _where(examples: Sequence[Any], bad: list[int]) -> str:
    shown = ", ".join(examples[i].row.where for i in bad[:MAX_SHOWN])
    return shown + (f" and {len(bad) - MAX_SHOWN} more" if len(bad) > MAX_SHOWN else "")


def label_findings(examples: Sequence[Any]) -> list[Finding]:
    """The check that reads only the encoded pairs (``PairExample``). ``encode_pairs`` already refuses identical pairs,
    labels the prompt -100 by construction and excludes a pair whose prompt would be emptied; what a chat template
    renders after the answer is not in its hands."""
    masked = [i for i, e in enumerate(examples) if e.chosen_labels[-1] == -100 or e.rejected_labels[-1] == -100]
    if not masked:
        return []
    return [Finding("dpo-terminator-masked", "error", f"{len(masked)} pairs end with a masked last token: the "
                    "terminator of the answer is not in the labels, so the answers' lengths are not compared",
                    "keep EOS / the end-of-turn token in the labels", _where(examples, masked))]


def check_pairs(model: Any, tokenizer: Any, examples: Sequence[Any], features: Sequence[dict[str, Any]], collate: Any,
                loss_fn: Any, accelerator: Any, cfg: DPOConfig) -> Report:
    """Every dpo check on the setup training will use (nothing is trained; every change is put back)."""
    import torch

    from surefit.training.precision import autocast_where
    from surefit.training.preference import adapters_off, sequence_logps

    findings = label_findings(examples)
    checks = 3
    if not features:
        return Report(findings, checks)
    device = next((p.device for p in model.parameters()), accelerator.device)  # a sharded run's is on the CPU
    batch = {k: v.to(device) for k, v in collate(features[:2]).items()}
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast_where(model, accelerator):
            if loss_fn.reference != "none" and cfg.loss == "sigmoid":
                finding = step0_finding(loss_fn.score(model, batch), batch, precision_is_fp32(accelerator))
                if finding is not None:
                    findings.append(finding)
            if loss_fn.reference == "adapters_off":
                policy, ref = _with_nonzero_adapters(model, lambda: (sequence_logps(model, batch)[0],
                                                                     _off(model, batch, adapters_off, sequence_logps)))
                if torch.allclose(policy, ref):
                    findings.append(Finding(
                        "dpo-reference-is-policy", "error", "with the adapters changed, the reference's "
                        "log-probabilities still equal the policy's: the adapters stay on for the reference",
                        "compute the reference inside peft's disable_adapter()", "reference forward"))
    finally:
        model.train(was)
    return Report(sorted(findings, key=lambda f: f.severity != "error"), checks)


# Per token, the most 16-bit rounding moves a log-probability computed in another batch shape (a precomputed
# reference): measured ~0.004 nats on SmolLM2-135M under bf16. A reference that is another model is 0.1 or more away.
ROUNDING_NATS_PER_TOKEN = 0.02


def step0_finding(scores: Any, batch: dict, fp32: bool) -> Finding | None:
    """The sigmoid loss before step 1 must be ln 2: the reference is the starting policy. In fp32 that holds to 1e-4;
    under 16-bit precision a precomputed reference was computed in other batch shapes, so the policy's and the
    reference's log-probabilities may differ by rounding: the check then allows ``ROUNDING_NATS_PER_TOKEN`` per token."""
    labels = batch["labels"]
    n = (labels[:, 1:] != -100).sum(1).float().clamp(min=1)
    pairs = labels.shape[0] // 2
    drift = float(((scores.chosen - scores.ref_chosen).abs() / n[:pairs]).mean()
                  + ((scores.rejected - scores.ref_rejected).abs() / n[pairs:]).mean()) / 2
    loss = float(scores.losses.mean())
    if (fp32 and math.isclose(loss, math.log(2), abs_tol=1e-4)) or (not fp32 and drift <= ROUNDING_NATS_PER_TOKEN):
        return None
    allowed = "" if fp32 else f" (16-bit rounding alone stays under {ROUNDING_NATS_PER_TOKEN})"
    return Finding("dpo-step0-loss", "error", f"the sigmoid loss before step 1 is {loss:.6f}, not ln 2 = "
                   f"{math.log(2):.6f}: the policy's and the reference's log-probabilities differ by {drift:.4f} nats "
                   f"per token{allowed}, so the reference is not the starting policy", "use a fresh adapter (LoRA "
                   "starts at zero), or --precompute_ref on the model as it starts", "first 2 training pairs")


def precision_is_fp32(accelerator: Any) -> bool:
    return getattr(accelerator, "mixed_precision", "no") in ("no", None)


def _off(model: Any, batch: dict, adapters_off: Any, sequence_logps: Any) -> Any:
    with adapters_off(model):
        return sequence_logps(model, batch)[0]


def _with_nonzero_adapters(model: Any, fn: Any) -> Any:
    """``fn()`` with every LoRA B matrix set to small non-zero values (a fresh adapter is zero, so its policy equals
    the reference by design), then the weights put back."""
    import torch

    saved = []
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            saved.append((p, p.detach().clone()))
            with torch.no_grad():
                p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    try:
        return fn()
    finally:
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)


def check_dpo_trainer(trainer: Any) -> Report:
    """The pair checks on a user's own TRL ``DPOTrainer``, read from its tokenised dataset and its settings: identical
    pairs, answers its ``max_length`` truncation empties, makes identical or cuts before their EOS (``keep_start``
    cuts the end of the sequence), prompts it empties (``keep_end`` cuts the start), and a reference model that
    shares the trained model's weights.

    >>> print(check_dpo_trainer(trainer))  # doctest: +SKIP
    """
    findings: list[Finding] = []
    data = trainer.train_dataset
    args = trainer.args
    limit = getattr(args, "max_length", None)
    keep_end = getattr(args, "truncation_mode", "keep_start") == "keep_end"
    same, emptied, cut, no_prompt = [], [], [], []
    for i in range(len(data)):
        row = data[i]
        prompt, chosen, rejected = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
        if chosen == rejected:
            same.append(i)
            continue
        if limit is None:
            continue
        if keep_end:  # the start of the prompt goes first, then the answer's start
            kept = [(prompt + a)[-limit:][max(0, len(prompt) - max(0, len(prompt) + len(a) - limit)):]
                    for a in (chosen, rejected)]
        else:
            kept = [a[: max(0, limit - len(prompt))] for a in (chosen, rejected)]
        if keep_end and prompt and max(len(chosen), len(rejected)) >= limit:  # the answer alone fills max_length
            no_prompt.append(i)
        if not kept[0] or not kept[1] or kept[0] == kept[1]:
            emptied.append(i)
        elif not keep_end and len(prompt) + max(len(chosen), len(rejected)) > limit:
            cut.append(i)

    def rows(idx: list[int]) -> str:
        return "train_dataset rows " + ", ".join(map(str, idx[:MAX_SHOWN])) + (
            f" and {len(idx) - MAX_SHOWN} more" if len(idx) > MAX_SHOWN else "")

    if same:
        findings.append(Finding("dpo-identical-pair", "error", f"{len(same)} pairs have identical chosen and rejected "
                                "answers: their loss is a constant and their gradient zero", "remove them", rows(same)))
    if emptied:
        findings.append(Finding("dpo-truncation-empties", "error", f"{len(emptied)} pairs lose a whole answer, or are "
                                f"left with two identical answers, to max_length={limit} truncation: a zero gradient "
                                "or NaN", "raise max_length, or drop pairs whose prompt fills it", rows(emptied)))
    if cut:
        findings.append(Finding("dpo-terminator-masked", "warning", f"{len(cut)} pairs have an answer cut by "
                                f"max_length={limit} (truncation_mode keep_start cuts the end): its EOS is not "
                                "trained, so the pair no longer compares whole answers", "raise max_length",
                                rows(cut)))
    if no_prompt:
        findings.append(Finding("dpo-prompt-emptied", "warning", f"{len(no_prompt)} pairs lose their whole prompt to "
                                f"max_length={limit} truncation (truncation_mode keep_end keeps the end of prompt + "
                                "answer): the answers are compared with no question", "raise max_length, or use "
                                "truncation_mode keep_start", rows(no_prompt)))
    ref = getattr(trainer, "ref_model", None)
    shared = _shared_weights(getattr(trainer, "model", None), ref)
    if shared:
        findings.append(Finding("dpo-reference-is-policy", "error", f"ref_model shares {shared} weight tensors with the "
                                "trained model (e.g. the base model that get_peft_model wrapped in place, its LoRA "
                                "layers now on): the reference moves with the policy, so the log-ratios stay 0",
                                "pass ref_model=None (a copy is made, or the adapter is switched off under peft) or "
                                "a separately loaded model", "ref_model"))
    return Report(findings, 5)


def _shared_weights(model: Any, ref: Any) -> int:
    """How many parameter tensors ``ref`` shares (the same storage) with ``model``; 0 when either is absent."""
    if model is None or ref is None or not hasattr(ref, "parameters") or not hasattr(model, "parameters"):
        return 0
    mine = {p.data_ptr() for p in model.parameters()}
    return sum(p.data_ptr() in mine for p in ref.parameters())
