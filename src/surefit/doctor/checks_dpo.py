"""The doctor's checks of a preference-tuning setup (``--task dpo``), on the encoded pairs and the model as training
will use them: identical answers, prompt tokens trained, the terminator masked, a reference that is not the starting
policy (or that equals the policy with the adapters on), and prompts emptied by truncation."""

from __future__ import annotations

import math
from typing import Any

from surefit.config.dpo_config import DPOConfig
from surefit.doctor.core import CODES, Finding, Report

DPO_CODES = {
    "dpo-identical-pair": "a pair whose chosen and rejected sequences are the same tokens",
    "dpo-prompt-trained": "a pair's prompt tokens carry loss (labels other than -100 before the answer)",
    "dpo-terminator-masked": "an answer whose last token (its terminator: EOS or the end-of-turn token) has label -100",
    "dpo-reference-is-policy": "the reference computes the same log-probabilities as the trained policy (LoRA "
                               "adapters left on for the reference)",
    "dpo-step0-loss": "the loss before step 1 is not ln 2 (sigmoid) although the reference is the starting policy",
    "dpo-prompt-emptied": "a pair whose prompt truncation emptied",
    "dpo-truncation-empties": "a pair whose answer truncation empties, or whose two answers it makes identical",
}
CODES.update(DPO_CODES)
MAX_SHOWN = 5


def _where(examples: list[Any], bad: list[int]) -> str:
    shown = ", ".join(examples[i].row.where for i in bad[:MAX_SHOWN])
    return shown + (f" and {len(bad) - MAX_SHOWN} more" if len(bad) > MAX_SHOWN else "")


def label_findings(examples: list[Any], terminators: set[int] | None = None) -> list[Finding]:
    """The checks that read only the encoded pairs (``PairExample``: ids, labels and the shared prompt length)."""
    out: list[Finding] = []
    same = [i for i, e in enumerate(examples) if e.chosen_ids == e.rejected_ids]
    if same:
        out.append(Finding("dpo-identical-pair", "error", f"{len(same)} pairs have identical chosen and rejected "
                           "sequences: their loss is a constant and their gradient zero", "remove them from the data",
                           _where(examples, same)))
    trained = [i for i, e in enumerate(examples)
               if any(t != -100 for t in e.chosen_labels[:e.prompt_len] + e.rejected_labels[:e.prompt_len])]
    if trained:
        out.append(Finding("dpo-prompt-trained", "error", f"{len(trained)} pairs train on prompt tokens: the "
                           "preference would compare the prompt too", "labels must be -100 over the prompt",
                           _where(examples, trained)))
    masked = [i for i, e in enumerate(examples) if e.chosen_labels[-1] == -100 or e.rejected_labels[-1] == -100]
    if masked:
        out.append(Finding("dpo-terminator-masked", "error", f"{len(masked)} pairs end with a masked last token: the "
                           "terminator of the answer is not in the labels, so the answers' lengths are not compared",
                           "keep EOS / the end-of-turn token in the labels", _where(examples, masked)))
    empty = [i for i, e in enumerate(examples) if e.prompt_len == 0]
    if empty:
        out.append(Finding("dpo-prompt-emptied", "warning", f"{len(empty)} pairs have no prompt tokens left",
                           "raise --max_seq_length, or --truncation exclude", _where(examples, empty)))
    return out


def check_pairs(model: Any, tokenizer: Any, examples: list[Any], features: list[dict[str, Any]], collate: Any,
                loss_fn: Any, accelerator: Any, cfg: DPOConfig) -> Report:
    """Every dpo check on the setup training will use (nothing is trained; every change is put back)."""
    import torch

    from surefit.training.preference import adapters_off, sequence_logps

    findings = label_findings(examples)
    checks = len(DPO_CODES)
    if not features:
        return Report(findings, checks)
    batch = {k: v.to(accelerator.device) for k, v in collate(features[:2]).items()}
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), accelerator.autocast():
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
    cuts the end of the sequence), and a reference model that is the trained model itself.

    >>> print(check_dpo_trainer(trainer))  # doctest: +SKIP
    """
    findings: list[Finding] = []
    data = trainer.train_dataset
    args = trainer.args
    limit = getattr(args, "max_length", None)
    keep_end = getattr(args, "truncation_mode", "keep_start") == "keep_end"
    same, emptied, cut = [], [], []
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
    ref = getattr(trainer, "ref_model", None)
    if ref is not None and ref is getattr(trainer, "model", None):
        findings.append(Finding("dpo-reference-is-policy", "error", "ref_model is the trained model itself: the "
                                "log-ratios are always 0", "pass ref_model=None (a copy is made, or the adapter is "
                                "switched off under peft) or a separate model", "ref_model"))
    return Report(findings, 4)
