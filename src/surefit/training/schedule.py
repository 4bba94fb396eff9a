"""The learning-rate schedule: how many optimizer steps a run takes, its warmup, and the shape after it.

One pure formula (:func:`lr_factor`) serves the loop's scheduler, the plan's printout and the report's drawing, so
the curve a user reads is the one that trained. The warmup matches the Hugging Face schedulers (``step / warmup``,
so the first step runs at 0): with the default cosine shape and ``min_lr`` 0 the factors equal
``transformers.get_cosine_schedule_with_warmup``'s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

SCHEDULERS = ("cosine", "linear", "constant", "wsd")
# wsd (warmup-stable-decay): the decay takes this fraction of the steps at the end.
WSD_DECAY_FRACTION = 0.1


@dataclass(frozen=True)
class Schedule:
    """A run's schedule.

    Attributes:
        kind: cosine, linear, constant or wsd. lr: the peak; min_lr: where cosine, linear and wsd end.
        total_steps: optimizer steps the run takes; warmup_steps: of them, warming up from 0.
        steps_per_epoch: optimizer steps in one pass over the training data; epochs: passes run (the last one
            partial when ``max_steps`` ends it early).
        max_steps: the ``--max_steps`` that set ``total_steps``, or ``None`` (the epochs did).
        warmup_asked: the warmup steps ``--warmup`` asked for when they are more than the run has (then the
            warmup is the whole run and the learning rate never reaches ``lr``); ``None`` otherwise.
    """

    kind: str
    lr: float
    min_lr: float
    total_steps: int
    warmup_steps: int
    steps_per_epoch: int
    epochs: int
    max_steps: int | None = None
    warmup_asked: int | None = None

    def factor(self, step: int) -> float:
        """The multiplier of ``lr`` for optimizer step ``step`` (0-based)."""
        return lr_factor(step, self.kind, self.warmup_steps, self.total_steps, self.min_lr / self.lr if self.lr else 0.0)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        return self.lr * self.factor(step)

    def describe(self) -> str:
        """One line for the run's printout: the shape, warmup and length (and what --max_steps means in epochs)."""
        ends = "" if self.kind == "constant" else f" to {self.min_lr:g}"
        text = (f"schedule: {self.kind}, warmup {self.warmup_steps} of {self.total_steps} optimizer steps, "
                f"lr {self.lr:g}{ends}")
        if self.warmup_asked is not None:
            peak = lr_factor(self.total_steps - 1, self.kind, self.warmup_steps, self.total_steps) * self.lr
            text += (f"; warning: --warmup {self.warmup_asked} is longer than the run ({self.total_steps} optimizer "
                     f"steps), so the learning rate only rises, to {peak:.3g} at the last step (--lr {self.lr:g} is never reached) "
                     f"(fix: --warmup {max(1, self.total_steps // 10)}, or a ratio such as --warmup 0.1)")
        if self.max_steps is not None:
            text += (f"; --max_steps {self.max_steps} = {self.max_steps / max(self.steps_per_epoch, 1):.2f} epochs of "
                     f"{self.steps_per_epoch} steps (overrides --epochs)")
        return text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lr_factor(step: int, kind: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Warmup: ``step / warmup_steps``. After it, with ``p`` the fraction of the remaining steps done and ``r`` =
    min_lr / lr: cosine ``r + (1 - r) * (1 + cos(pi p)) / 2``; linear ``r + (1 - r) * (1 - p)``; constant 1; wsd 1
    until the last 10 percent of the steps, then linear from 1 to ``r`` over them.
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if kind == "constant":
        return 1.0
    if kind == "wsd":
        decay = max(1, round(WSD_DECAY_FRACTION * total_steps))
        start = max(warmup_steps, total_steps - decay)
        if step < start:
            return 1.0
        left = max(0.0, (total_steps - step) / max(1, total_steps - start))
        return min_ratio + (1 - min_ratio) * left
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if kind == "linear":
        return min_ratio + (1 - min_ratio) * max(0.0, 1.0 - progress)
    if kind == "cosine":
        return min_ratio + (1 - min_ratio) * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown scheduler {kind!r}; one of {', '.join(SCHEDULERS)}")


@dataclass(frozen=True)
class Warmup:
    """``--warmup`` (a step count when >= 1, a ratio of the steps below 1; replaces the ratio when given) and
    ``--warmup_ratio``."""

    warmup: float | None = None
    ratio: float = 0.0

    def asked(self, total: int) -> int:
        """The warmup steps asked for, before they are capped at the run's length."""
        if self.warmup is not None and self.warmup >= 1:
            return int(self.warmup)
        return int((self.warmup if self.warmup is not None else self.ratio) * total)

    def steps(self, total: int) -> int:
        return min(self.asked(total), total)


def plan_schedule(*, n_examples: int, batch_size: int, epochs: int, lr: float, kind: str = "cosine",
                  warmup: Warmup = Warmup(), min_lr: float = 0.0, max_steps: int | None = None) -> Schedule:
    """The schedule of a run on ``n_examples`` training examples.

    ``max_steps`` overrides ``epochs``: the run takes exactly that many steps (its last epoch partial, or more
    epochs than ``epochs``).
    """
    steps_per_epoch = max(1, math.ceil(n_examples / batch_size))
    total = max_steps if max_steps else steps_per_epoch * epochs
    run_epochs = math.ceil(total / steps_per_epoch) if max_steps else epochs
    asked = warmup.asked(total)
    return Schedule(kind=kind, lr=lr, min_lr=min_lr, total_steps=total, warmup_steps=warmup.steps(total),
                    steps_per_epoch=steps_per_epoch, epochs=run_epochs, max_steps=max_steps or None,
                    warmup_asked=asked if asked > total else None)


def make_scheduler(optimizer: Any, schedule: Schedule) -> Any:
    """A ``LambdaLR`` following ``schedule`` (its state dict holds only the step count, so checkpoints resume it)."""
    import torch

    def factor(step: int) -> float:
        return schedule.factor(step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
