"""The one training loop, on accelerate. Tasks give it examples, a loss-sum function and an evaluation hook.

Loss normalisation (DESIGN principle 5): each optimizer step's gradient is the mean over every supervised item
(token, for language models) in the whole accumulated batch, across micro-batches and processes. Each micro-batch's
loss sum is divided by the step's global count before ``backward``; DDP averages gradients over processes, so the
loss is also multiplied by the number of processes to turn that average back into the global sum.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from surefit.data.sampling import micro_batches, step_batches
from surefit.errors import Problem, SurefitError
from surefit.training.memory import OOMGuard, free_memory, is_oom, shrink_on_oom

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

    def bytes_written(self) -> int:
        self._fh.flush()
        return self._fh.tell()

    def truncate(self, size: int) -> None:
        """Cut the log back to ``size`` bytes (the length it had when a checkpoint was written)."""
        self._fh.flush()
        self._fh.truncate(size)
        self._fh.seek(size)

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


@dataclass
class Checkpointing:
    """Where and when the loop saves, and what it resumes from.

    Attributes:
        folder: ``OUTPUT/checkpoints``.
        save_every: also save every N optimizer steps (0: only at epoch ends).
        keep: keep the newest K checkpoints (0: all).
        export: writes the model in its ecosystem format into a folder (epoch-end checkpoints carry it).
        resume_from: a verified checkpoint folder to continue from, or ``None``.
        resume_command: shown when a run is interrupted.
        before_commit: test hook passed to :func:`~surefit.training.checkpoint.save_checkpoint`.
    """

    folder: Path
    save_every: int = 0
    keep: int = 0
    export: Callable[[Any, Path], None] | None = None
    resume_from: Path | None = None
    resume_command: str = ""
    before_commit: Callable[[Path], None] | None = None


class TrainingInterrupted(SurefitError):
    """SIGINT/SIGTERM: the current step was finished and saved; the message shows how to resume."""

    exit_code = 130
    title = "training interrupted"

    def render(self) -> str:
        return "\n".join(p.what + (f"\n  {p.fix}" if p.fix else "") for p in self.problems)


class _StopSignal:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current step; a second one stops at once."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(f"\n{self.requested}: finishing the current step, then saving a checkpoint (again to stop at once)",
              file=sys.stderr)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


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
    checkpointing: Checkpointing,
    log: MetricsLog,
    say: Callable[[str], None] = print,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Train for ``settings.epochs``, evaluating before the first epoch and after each one, with checkpoints.

    A checkpoint is written every ``checkpointing.save_every`` optimizer steps, at each epoch end (after its
    evaluation) and when SIGINT/SIGTERM arrives (after the current step). Resuming restores the model's trainable
    state, optimizer, scheduler, every RNG and the position in the epoch, so the rest of the run is the same as if it
    had never stopped.

    Args:
        model: the model to train.
        features: encoded examples the collator accepts; lengths: their token lengths; counts: supervised items
            per example (tokens for a language model, 1 for a classifier) used to normalise the loss.
        loss_fn: ``(model, batch) -> (loss_sum, n_items)``.
        evaluate: ``(model, epoch) -> metrics``; called for epoch 0 (before training) and each epoch.
        on_epoch: called with each epoch's complete record (training and evaluation figures) before it is logged;
            it may add keys.

    Returns:
        One record per evaluation (epoch 0 first).

    Raises:
        TrainingInterrupted: after saving, when a stop signal arrived.
    """
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    from surefit.training.checkpoint import load_checkpoint, prune, save_checkpoint

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    steps_per_epoch = math.ceil(len(features) / settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    warmup = int(settings.warmup_ratio * total_steps)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)

    # Position and running sums of the epoch in progress; a checkpoint stores them so a resumed epoch reports the
    # same train_loss as an uninterrupted one.
    pos: dict[str, Any] = {"epoch": 1, "step_in_epoch": 0, "global_step": 0, "loss_sum": 0.0, "items": 0,
                           "tokens": 0, "seconds": 0.0, "window_loss": 0.0, "window_items": 0, "examples": 0}
    guard = OOMGuard()
    history: list[dict[str, Any]] = []
    if checkpointing.resume_from is not None:
        state = load_checkpoint(checkpointing.resume_from, model=accelerator.unwrap_model(model), optimizer=optimizer,
                                scheduler=scheduler, scaler=getattr(accelerator, "scaler", None))
        history, pos = state["history"], state["position"]
        guard.load(state.get("oom", {}))
        log.truncate(state["metrics_bytes"])  # lines written after this checkpoint would be written twice
        say(f"resumed from {checkpointing.resume_from}: epoch {pos['epoch']}, step {pos['step_in_epoch']} of "
            f"{steps_per_epoch} (global step {pos['global_step']})")
    else:
        record = {"type": "epoch", "epoch": 0, **evaluate(model, 0)}
        log.write(record)
        history.append(record)

    def checkpoint(name: str, export: bool) -> Path:
        folder = save_checkpoint(
            checkpointing.folder / name,
            model=accelerator.unwrap_model(model),
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=getattr(accelerator, "scaler", None),  # fp16 loss scaling state (None otherwise)
            # Checkpoints are only taken between optimizer steps (mid-accumulation gradients are not state worth
            # saving), so the micro-step of the position is always 0.
            state={"global_step": pos["global_step"], "position": pos, "micro_step": 0, "history": history,
                   "oom": guard.state(),
                   "metrics_bytes": log.bytes_written(),
                   "plan": {"batch_size": settings.batch_size, "micro_batch_size": settings.micro_batch_size,
                            "grad_accum": settings.batch_size // settings.micro_batch_size,
                            "mixed_precision": str(accelerator.mixed_precision),
                            "processes": accelerator.num_processes}},
            export=(lambda d: checkpointing.export(model, d)) if export and checkpointing.export else None,
            before_commit=checkpointing.before_commit,
        )
        prune(checkpointing.folder, checkpointing.keep, say)
        return folder

    with _StopSignal() as stop:
        while pos["epoch"] <= settings.epochs:
            epoch = pos["epoch"]
            model.train()
            batches = step_batches(lengths, settings.batch_size, settings.seed, epoch)
            # In a log file (not a terminal) a bar redrawn every step is noise: redraw at most every 30 s there.
            tty = sys.stderr.isatty()
            bar = tqdm(total=len(batches), initial=pos["step_in_epoch"], desc=f"epoch {epoch}/{settings.epochs}",
                       unit="step", dynamic_ncols=True, mininterval=0.5 if tty else 30.0)
            for step_indices in batches[pos["step_in_epoch"] :]:
                t0 = time.perf_counter()
                n_local = sum(counts[i] for i in step_indices)
                step_loss = accumulate_step(
                    model, features, step_indices, lengths, counts,
                    micro_batch_size=settings.micro_batch_size, loss_fn=loss_fn, collate=collate,
                    accelerator=accelerator, guard=guard, say=say,
                )
                grad_norm = None
                if settings.max_grad_norm > 0:
                    grad_norm = float(accelerator.clip_grad_norm_(params, settings.max_grad_norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                tokens = sum(lengths[i] for i in step_indices)
                dt = time.perf_counter() - t0
                pos["global_step"] += 1
                pos["step_in_epoch"] += 1
                pos["loss_sum"] += step_loss
                pos["items"] += n_local
                pos["tokens"] += tokens
                pos["examples"] += len(step_indices)
                pos["seconds"] += dt
                pos["window_loss"] += step_loss
                pos["window_items"] += n_local
                bar.set_postfix(loss=f"{step_loss / max(n_local, 1):.4f}", tok_s=f"{tokens / max(dt, 1e-9):.0f}",
                                refresh=False)
                bar.update(1)
                if pos["global_step"] % settings.log_every == 0:
                    log.write({"type": "step", "step": pos["global_step"], "epoch": epoch,
                               "loss": pos["window_loss"] / max(pos["window_items"], 1),
                               "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                               "tokens_per_s": tokens / max(dt, 1e-9), "oom_splits": guard.splits})
                    pos["window_loss"], pos["window_items"] = 0.0, 0
                last_of_epoch = pos["step_in_epoch"] == len(batches)
                if stop.requested and not last_of_epoch:
                    bar.close()
                    folder = checkpoint(f"step-{pos['global_step']:07d}", export=False)
                    raise TrainingInterrupted(Problem(
                        f"stopped by {stop.requested} after epoch {epoch}, step {pos['step_in_epoch']} of "
                        f"{len(batches)}; checkpoint saved to {folder}",
                        fix=f"resume with: {checkpointing.resume_command}"))
                if checkpointing.save_every and pos["global_step"] % checkpointing.save_every == 0 and not last_of_epoch:
                    checkpoint(f"step-{pos['global_step']:07d}", export=False)
            bar.close()
            record = {
                "type": "epoch",
                "epoch": epoch,
                "step": pos["global_step"],
                "train_loss": pos["loss_sum"] / max(pos["items"], 1),
                "train_tokens_per_s": pos["tokens"] / max(pos["seconds"], 1e-9),
                "time_per_epoch": pos["seconds"],
                "examples_seen": pos["examples"],
                "oom_splits": guard.splits,
            }
            record.update(evaluate(model, epoch))
            if on_epoch is not None:
                on_epoch(record)
            log.write(record)
            history.append(record)
            pos.update(epoch=epoch + 1, step_in_epoch=0, loss_sum=0.0, items=0, tokens=0, seconds=0.0, examples=0)
            folder = checkpoint(f"epoch-{epoch}", export=True)
            if stop.requested and epoch < settings.epochs:
                raise TrainingInterrupted(Problem(
                    f"stopped by {stop.requested} at the end of epoch {epoch}; checkpoint saved to {folder}",
                    fix=f"resume with: {checkpointing.resume_command}"))
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
    guard: OOMGuard | None = None,
    say: Callable[[str], None] = print,
) -> float:
    """Forward and backward every micro-batch of one optimizer step; gradients are left in ``.grad``.

    The gradient equals that of (sum of per-item losses over the whole step, on all processes) / (their count), so
    it does not depend on how the step is split into micro-batches. That is also what makes out-of-memory recovery
    exact: a micro-batch that runs out of memory is split in halves and the step is redone from zero gradients
    (an error mid-backward can leave half-accumulated gradients, so they are discarded rather than trusted).

    Returns:
        The step's loss sum on this process (divide by the step's item count for the mean).
    """
    guard = guard or OOMGuard(inject=set())
    world = accelerator.num_processes
    n_global = sum(counts[i] for i in step_indices)
    if world > 1:
        n_global = int(accelerator.reduce(torch.tensor(n_global, device=accelerator.device), "sum"))
    parts = guard.plan(micro_batches(step_indices, micro_batch_size, lengths), lengths)
    while True:
        step_loss, failed, batch = 0.0, None, None
        for j, part in enumerate(parts):
            try:
                guard.tick()
                batch = _to_device(collate([features[i] for i in part]), accelerator.device)
                # Gradients are only all-reduced on the last micro-batch of a step.
                sync = nullcontext() if j == len(parts) - 1 else accelerator.no_sync(model)
                with sync, accelerator.autocast():
                    loss_sum, _ = loss_fn(model, batch)
                accelerator.backward(loss_sum * (world / max(n_global, 1)))
                step_loss += loss_sum.item()  # note: a device->host sync, once per micro-batch
            except Exception as e:  # noqa: BLE001 - out-of-memory is recovered below; anything else is re-raised
                if not is_oom(e):
                    raise
                failed = j
                break
        if failed is None:
            return step_loss
        # Outside the except block: the exception and the frames holding this micro-batch's activations are gone.
        batch = None
        model.zero_grad(set_to_none=True)
        free_memory()
        parts = guard.plan(parts[:failed] + guard.failed(parts[failed], lengths, say) + parts[failed + 1 :], lengths)


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
    say: Callable[[str], None] = print,
) -> float:
    """Mean loss per supervised item over the whole set (token-weighted, not a mean of batch means).

    Out of memory shrinks only this evaluation's batch (halving until it fits); training is unaffected.
    """
    was_training = model.training
    model.eval()
    order = sorted(range(len(features)), key=lambda i: -lengths[i])

    def run(bs: int) -> float:
        total, items = 0.0, 0
        for start in range(0, len(order), bs):
            part = order[start : start + bs]
            batch = _to_device(collate([features[i] for i in part]), accelerator.device)
            with accelerator.autocast():
                loss_sum, n = loss_fn(model, batch)
            total += loss_sum.item()
            items += n
        return total / max(items, 1)

    try:
        return shrink_on_oom(run, batch_size, "evaluation", say)
    finally:
        model.train(was_training)
