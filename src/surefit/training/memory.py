"""Memory levers shared by the tasks, and recovery from running out of memory without losing an example.

The planner that fits micro-batch, checkpointing and precision to a budget before step 1 is ``training/plan.py``.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from surefit.errors import Problem, SurefitError


def enable_gradient_checkpointing(model: Any, lora: bool) -> None:
    """Recompute activations in the backward pass instead of storing them.

    Non-reentrant checkpointing works when the inputs do not require grad; with LoRA the embeddings are frozen, so
    nothing entering the first checkpointed block requires grad and the reentrant variant would silently produce no
    gradients for the adapters: ``enable_input_require_grads`` prevents that for either variant.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


# --------------------------------------------------------------------------------------------------- out of memory


def is_oom(e: BaseException) -> bool:
    """A GPU out-of-memory error (caught by type) or a CPU allocation failure."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)


class OutOfMemoryAtOneExample(SurefitError):
    title = "out of memory on a single example"


def free_memory() -> None:
    """Release cached blocks; called after an except block has ended, so its frames no longer hold activations."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


INJECT_ENV = "SUREFIT_INJECT_OOM"


class OOMGuard:
    """Splits micro-batches that ran out of memory, and remembers the size that did.

    Attributes:
        limit_tokens: padded tokens (examples x longest length) of the smallest micro-batch that ran out of memory;
            later micro-batches at least that large are split before they are tried.
        splits: how many splits happened (reported in metrics.jsonl).
        micro_step: micro-batches attempted so far (fault injection counts these).
        inject: micro-steps at which to raise a real ``torch.OutOfMemoryError``: fault injection for tests, set by
            the environment variable ``SUREFIT_INJECT_OOM=3,7`` (documented in the README's testing section).
    """

    def __init__(self, inject: set[int] | None = None):
        self.limit_tokens = math.inf
        self.splits = 0
        self.micro_step = 0
        if inject is None:
            raw = os.environ.get(INJECT_ENV, "")
            inject = {int(x) for x in raw.split(",") if x.strip()}
        self.inject = inject

    def tick(self) -> None:
        self.micro_step += 1
        if self.micro_step in self.inject:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {INJECT_ENV} at micro-step {self.micro_step})")

    @staticmethod
    def tokens(part: list[int], lengths: Sequence[int]) -> int:
        return len(part) * max(lengths[i] for i in part)

    def plan(self, parts: list[list[int]], lengths: Sequence[int]) -> list[list[int]]:
        """Split, in halves, every part at least as large as one that already ran out of memory."""
        out: list[list[int]] = []
        queue = list(parts)
        while queue:
            part = queue.pop(0)
            if len(part) > 1 and self.tokens(part, lengths) >= self.limit_tokens:
                half = len(part) // 2
                queue[0:0] = [part[:half], part[half:]]
            else:
                out.append(part)
        return out

    def failed(self, part: list[int], lengths: Sequence[int], say: Callable[[str], None]) -> list[list[int]]:
        """Record an out-of-memory on ``part`` and return its halves (or raise if it is a single example)."""
        longest = max(lengths[i] for i in part)
        if len(part) == 1:
            raise OutOfMemoryAtOneExample(Problem(
                f"a single example of {longest} tokens does not fit in memory (after {self.splits} splits of larger "
                "micro-batches)",
                "--max_seq_length",
                "shorten --max_seq_length, turn on --gradient_checkpointing, train LoRA adapters (--lora_r 16) "
                "instead of the full model, or compute in bf16/fp16 (--precision)"))
        self.limit_tokens = min(self.limit_tokens, self.tokens(part, lengths))
        self.splits += 1
        half = len(part) // 2
        say(f"out of memory on a micro-batch of {len(part)} examples x {longest} tokens: split into {half} + "
            f"{len(part) - half} and the step redone with the same examples and loss (split {self.splits})")
        return [part[:half], part[half:]]

    def state(self) -> dict[str, Any]:
        return {"limit_tokens": None if math.isinf(self.limit_tokens) else self.limit_tokens, "splits": self.splits}

    def load(self, state: dict[str, Any]) -> None:
        self.limit_tokens = math.inf if state.get("limit_tokens") is None else state["limit_tokens"]
        self.splits = int(state.get("splits", 0))


def shrink_on_oom(run: Callable[[int], Any], batch_size: int, what: str, say: Callable[[str], None]) -> Any:
    """``run(batch_size)``; on out-of-memory, halve the batch and run again (evaluation and generation only)."""
    while True:
        try:
            return run(batch_size)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is handled; anything else is re-raised
            if not is_oom(e) or batch_size == 1:
                raise
        free_memory()
        batch_size = max(1, batch_size // 2)
        say(f"out of memory during {what}: retrying with batch size {batch_size} (training is unaffected)")
