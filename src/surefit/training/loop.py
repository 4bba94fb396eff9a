"""The one training loop, on accelerate. Tasks give it examples, a loss-sum function and an evaluation hook.

Loss normalisation (DESIGN principle 5): each optimizer step's gradient is the mean over every supervised item
(token, for language models) in the whole accumulated batch, across micro-batches and processes. Each micro-batch's
loss sum is divided by the step's global count before ``backward``; DDP averages gradients over processes, so the
loss is also multiplied by the number of processes to turn that average back into the global sum.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from surefit.data.sampling import micro_batches, step_batches

LossFn = Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, int]]


@dataclass
class LoopSettings:
    """What the loop needs from a task's config."""

    epochs: int
    batch_size: int
    micro_batch_size: int
    lr: float
    weight_decay: float
    warmup_ratio: float
    max_grad_norm: float
    seed: int
    log_every: int


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, flushed as written so a crashed run keeps what it logged."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")
        self._t0 = time.time()

    def write(self, record: dict[str, Any]) -> None:
        record = {**record, "time": round(time.time() - self._t0, 3)}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def resolve_precision(precision: str) -> str:
    """``auto`` -> bf16 on GPUs that support it, fp16 on other GPUs, fp32 on CPU. Returns accelerate's name."""
    if precision == "auto":
        if torch.cuda.is_available():
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "no"
    return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]


def make_accelerator(precision: str) -> Any:
    from accelerate import Accelerator

    return Accelerator(mixed_precision=resolve_precision(precision))


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def fit(
    model: Any,
    features: Sequence[dict[str, Any]],
    lengths: list[int],
    counts: list[int],
    *,
    loss_fn: LossFn,
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    settings: LoopSettings,
    accelerator: Any,
    evaluate: Callable[[Any, int], dict[str, Any]],
    on_epoch_end: Callable[[Any, int, dict[str, Any]], None],
    log: MetricsLog,
    say: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train for ``settings.epochs`` and evaluate before the first epoch and after each one.

    Args:
        model: the model to train (already on the right device via ``accelerator.prepare`` is not required).
        features: encoded examples the collator accepts; lengths: their token lengths; counts: supervised items
            per example (tokens for a language model, 1 for a classifier) used to normalise the loss.
        loss_fn: ``(model, batch) -> (loss_sum, n_items)``.
        evaluate: ``(model, epoch) -> metrics``; called for epoch 0 (before training) and each epoch.
        on_epoch_end: ``(model, epoch, epoch_record)``: checkpointing and the like.

    Returns:
        One record per evaluation (epoch 0 first).
    """
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    steps_per_epoch = math.ceil(len(features) / settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    warmup = int(settings.warmup_ratio * total_steps)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)

    history: list[dict[str, Any]] = []
    record = {"type": "epoch", "epoch": 0, **evaluate(model, 0)}
    log.write(record)
    history.append(record)

    step = 0
    for epoch in range(1, settings.epochs + 1):
        model.train()
        batches = step_batches(lengths, settings.batch_size, settings.seed, epoch)
        # In a log file (not a terminal) a bar redrawn every step is noise: redraw at most every 30 s there.
        tty = sys.stderr.isatty()
        bar = tqdm(
            total=len(batches), desc=f"epoch {epoch}/{settings.epochs}", unit="step", dynamic_ncols=True,
            mininterval=0.5 if tty else 30.0,
        )
        epoch_loss_sum, epoch_items, epoch_tokens, t_epoch = 0.0, 0, 0, time.perf_counter()
        window_loss, window_items = 0.0, 0
        for step_indices in batches:
            t0 = time.perf_counter()
            n_local = sum(counts[i] for i in step_indices)
            step_loss = accumulate_step(
                model, features, step_indices, lengths, counts,
                micro_batch_size=settings.micro_batch_size, loss_fn=loss_fn, collate=collate, accelerator=accelerator,
            )
            grad_norm = None
            if settings.max_grad_norm > 0:
                grad_norm = float(accelerator.clip_grad_norm_(params, settings.max_grad_norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens = sum(lengths[i] for i in step_indices)
            epoch_loss_sum += step_loss
            epoch_items += n_local
            epoch_tokens += tokens
            window_loss += step_loss
            window_items += n_local
            dt = time.perf_counter() - t0
            bar.set_postfix(loss=f"{step_loss / max(n_local, 1):.4f}", tok_s=f"{tokens / max(dt, 1e-9):.0f}", refresh=False)
            bar.update(1)
            if step % settings.log_every == 0:
                log.write(
                    {
                        "type": "step",
                        "step": step,
                        "epoch": epoch,
                        "loss": window_loss / max(window_items, 1),
                        "lr": scheduler.get_last_lr()[0],
                        "grad_norm": grad_norm,
                        "tokens_per_s": tokens / max(dt, 1e-9),
                    }
                )
                window_loss, window_items = 0.0, 0
        bar.close()
        elapsed = time.perf_counter() - t_epoch
        record = {
            "type": "epoch",
            "epoch": epoch,
            "step": step,
            "train_loss": epoch_loss_sum / max(epoch_items, 1),
            "train_tokens_per_s": epoch_tokens / max(elapsed, 1e-9),
            "time_per_epoch": elapsed,
        }
        record.update(evaluate(model, epoch))
        log.write(record)
        history.append(record)
        on_epoch_end(model, epoch, {"optimizer": optimizer, "scheduler": scheduler, "step": step, "record": record})
    return history


def accumulate_step(
    model: Any,
    features: Sequence[dict[str, Any]],
    step_indices: list[int],
    lengths: list[int],
    counts: list[int],
    *,
    micro_batch_size: int,
    loss_fn: LossFn,
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    accelerator: Any,
) -> float:
    """Forward and backward every micro-batch of one optimizer step; gradients are left in ``.grad``.

    The gradient equals that of (sum of per-item losses over the whole step, on all processes) / (their count), so
    it does not depend on how the step is split into micro-batches.

    Returns:
        The step's loss sum on this process (divide by the step's item count for the mean).
    """
    world = accelerator.num_processes
    n_global = sum(counts[i] for i in step_indices)
    if world > 1:
        n_global = int(accelerator.reduce(torch.tensor(n_global, device=accelerator.device), "sum"))
    step_loss = 0.0
    parts = micro_batches(step_indices, micro_batch_size, lengths)
    for j, part in enumerate(parts):
        batch = _to_device(collate([features[i] for i in part]), accelerator.device)
        # Gradients are only all-reduced on the last micro-batch of a step.
        sync = nullcontext() if j == len(parts) - 1 else accelerator.no_sync(model)
        with sync, accelerator.autocast():
            loss_sum, _ = loss_fn(model, batch)
        accelerator.backward(loss_sum * (world / max(n_global, 1)))
        step_loss += loss_sum.item()  # note: a device->host sync, once per micro-batch
    return step_loss


@torch.no_grad()
def evaluate_loss(
    model: Any,
    features: Sequence[dict[str, Any]],
    lengths: list[int],
    *,
    loss_fn: LossFn,
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    batch_size: int,
    accelerator: Any,
) -> float:
    """Mean loss per supervised item over the whole set (token-weighted, not a mean of batch means)."""
    was_training = model.training
    model.eval()
    total, items = 0.0, 0
    order = sorted(range(len(features)), key=lambda i: -lengths[i])
    for start in range(0, len(order), batch_size):
        part = order[start : start + batch_size]
        batch = _to_device(collate([features[i] for i in part]), accelerator.device)
        with accelerator.autocast():
            loss_sum, n = loss_fn(model, batch)
        total += loss_sum.item()
        items += n
    model.train(was_training)
    return total / max(items, 1)
