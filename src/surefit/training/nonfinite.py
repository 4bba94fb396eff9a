"""A non-finite loss, gradient norm or weights, described for the user: the step, the rows whose own loss is not
finite, the likely cause and the last good checkpoint (the loop stops, or skips the step with --on_nonfinite
skip_step; training/loop.py)."""

from __future__ import annotations

import math
from typing import Any

import torch

from surefit.errors import Problem


def nonfinite_problem(run: Any, step_indices: list[int], loss_sum: float, grad_norm: float | None,
                      weights_only: bool = False) -> Problem:
    """What went non-finite at this step of ``run`` (the loop's ``_Fit``), the rows of the step whose own loss is not
    finite, the likely causes, and the last good checkpoint (nothing non-finite is applied or saved).

    ``weights_only``: the step's update itself made the weights non-finite (found before saving a checkpoint).
    """
    from surefit.training.checkpoint import latest_checkpoint

    p, s = run.progress, run.settings
    largest = max((float(q.detach().abs().max()) for q in run.params if q.numel()), default=0.0)
    step = p.global_step + (0 if weights_only else 1)
    where = (f"step {step} (epoch {p.epoch})" if weights_only else
             f"step {step} (epoch {p.epoch}, step {p.step_in_epoch + 1} of {run.steps_per_epoch})")
    lr_cause = (f"the learning rate is far too high (--lr {s.lr:g}); lower it (e.g. 10x) and keep --max_grad_norm "
                f"on (now {s.max_grad_norm:g})")
    if weights_only:
        what = f"the update of step {step} made the weights non-finite"
        causes, rows = [lr_cause], ""
        fix = "train again with a lower --lr (a resumed run keeps the run's --lr)"
    else:
        items = max(sum(run.counts[i] for i in step_indices), 1)
        what = (f"the loss is {loss_sum / items:.4g}"
                + (f", the gradient norm is {grad_norm:.4g}" if grad_norm is not None else ""))
        bad = _nonfinite_examples(run, run.accelerator.unwrap_model(run.model), step_indices)
        if not math.isfinite(largest):
            causes = [f"the weights were already non-finite before this step: {lr_cause}"]
        elif bad and len(bad) == len(step_indices) and largest > 1e4:
            causes = [f"every row of the step gives a non-finite loss alone and the weights reach {largest:.3g}: "
                      f"earlier updates were far too large: {lr_cause}"]
        elif bad:
            causes = ["these rows give a non-finite loss on their own: values that overflow in the model (extreme "
                      "inputs, labels out of range for the loss, a division by zero or log of a non-positive "
                      "value in a custom forward)"]
        else:
            causes = [f"each row's loss is finite alone: the gradient overflowed; lower --lr (now {s.lr:g}) or "
                      f"set --max_grad_norm (now {s.max_grad_norm:g})"]
        shown = bad or step_indices
        rows = ", ".join(run.describe(i) for i in shown[:8]) + (f" and {len(shown) - 8} more"
                                                                  if len(shown) > 8 else "")
        rows = f"; {'rows with a non-finite loss' if bad else 'the step held rows'}: {rows}"
        fix = ("fix the cause above, then train again or resume; or pass --on_nonfinite skip_step to skip such "
               "steps (each skip is counted and reported)")
    if str(getattr(run.accelerator, "mixed_precision", "no")) == "fp16":
        causes.append("fp16 overflows above 65504: train with --precision bf16 or fp32")
    last = latest_checkpoint(run.checkpointing.folder, say=lambda *_: None) if run.main else None
    kept = (f"the last good checkpoint {last} is kept (resume with: {run.checkpointing.resume_command})"
            if last else "no checkpoint had been written yet")
    applied = "nothing was saved" if weights_only else "this step was not applied"
    return Problem(f"{what}{rows}. Likely cause: {'; '.join(causes)}. {applied.capitalize()}; {kept}", where, fix)


def _nonfinite_examples(run: Any, model: Any, step_indices: list[int]) -> list[int]:
    """The step's examples whose loss alone is not finite (forward only; the random generators are put back)."""
    device = torch.device(run.accelerator.device)
    bad = []
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), torch.no_grad():
        for i in step_indices:
            batch = {k: v.to(device) for k, v in run.collate([run.features[i]]).items()}
            with run.accelerator.autocast():
                loss, _ = run.loss_fn(model, batch)
            if not bool(torch.isfinite(loss).all()):
                bad.append(i)
    return bad
