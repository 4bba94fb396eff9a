"""Memory levers shared by the tasks. (The planner that picks them from a budget is a later piece of work.)"""

from __future__ import annotations

from typing import Any


def enable_gradient_checkpointing(model: Any, lora: bool) -> None:
    """Recompute activations in the backward pass instead of storing them.

    Non-reentrant checkpointing works when the inputs do not require grad; with LoRA the embeddings are frozen, so
    nothing entering the first checkpointed block requires grad and the reentrant variant would silently produce no
    gradients for the adapters: ``enable_input_require_grads`` prevents that for either variant.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
