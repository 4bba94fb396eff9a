"""What a task hands the loop and the memory planner: the training work (examples and how to batch, score and count
them), the planner's extra inputs, and the speed and evaluation switches. A task's ``prepare`` builds them once;
``tasks/common.train`` passes them on unopened.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from surefit.config import TrainConfig

LossFn = Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, int]]
Collate = Callable[[list[Any]], dict[str, torch.Tensor]]


class ActivationStore(Protocol):
    """Within its context, activations autograd saves for the backward pass are stored in another dtype (``pack``
    says how one is stored, ``forget`` drops what it remembers between forwards): a speed-up a task hands in,
    :class:`~surefit.training.speedups.lora_fast.SavedActivationsIn`; the core does not import speed-ups."""

    def __enter__(self) -> Any:
        ...

    def __exit__(self, *exc: Any) -> None:
        ...

    def pack(self, t: torch.Tensor) -> Any:
        ...

    def forget(self) -> None:
        ...


@dataclass
class Evaluation:
    """One evaluation: the metrics (``eval_loss`` and the task's own) and, per validation row, its prediction record
    (``None`` when the task has none, e.g. custom models)."""

    metrics: dict[str, Any]
    records: list[dict[str, Any]] | None = None


@dataclass
class PlanInputs:
    """What the memory planner reads besides the training examples.

    Attributes:
        eval_lengths: tokens per validation example; generate_lengths: prompt + new tokens, when evaluation generates.
        lora: only adapters train (frozen weights may then be stored in 16 bits under mixed precision).
        collate, loss_fn: the probe's own where they differ from training's (``None``: training's).
        measured: measurements taken before the planner runs, in its memo's terms (``saved_activations``: [bytes,
            tokens], ``saved_activations_of``: of what, in words): the doctor's dry run on a CPU counts them
            (``training/plan.py: MeasuringDryRun``), so the planner does not run a forward of its own.
    """

    eval_lengths: Sequence[int] = ()
    generate_lengths: Sequence[int] = ()
    lora: bool = False
    collate: Collate | None = None
    loss_fn: LossFn | None = None
    measured: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainingWork:
    """The examples the loop trains on and the task's hooks around them.

    Attributes:
        features, lengths, counts: the training examples as the collator takes them, their token lengths, and the
            items each carries in the loss (supervised tokens, or 1 per example).
        collate: pads a list of features into a batch (nothing else; see ``data/collate.py``).
        loss_fn: ``(model, batch) -> (loss_sum, n_items)``.
        evaluate: ``(model, epoch, batch_size) -> Evaluation``; prints the epoch's line.
        on_epoch: called with each epoch's complete record before it is logged; it may add keys.
        counters: the task's running counts for the epoch in progress (``state()``, ``load(state)``, e.g. the shared
            prefixes'), kept by checkpoints so that a resumed epoch reports what an uninterrupted one does.
        epoch_batches: ``epoch -> steps`` (lists of example indices), the same on every process; default:
            length-grouped batches (:func:`~surefit.data.sampling.step_batches`).
        where: a training example's index -> its source row in words, for messages (a non-finite loss names rows).
        plan: the memory planner's other inputs.
        activation_store: ``dtype -> ActivationStore``, used when the plan stores saved activations in 16 bits (LoRA
            on 16-bit frozen weights); ``None``: the plan never does.
    """

    features: Sequence[Any]
    lengths: Sequence[int]
    counts: Sequence[int]
    collate: Collate
    loss_fn: LossFn
    evaluate: Callable[[Any, int | float, int], Evaluation] | None = None
    on_epoch: Callable[[dict[str, Any]], None] | None = None
    counters: Any = None
    epoch_batches: Callable[[int], list[list[int]]] | None = None
    where: Callable[[int], str] | None = None
    plan: PlanInputs = field(default_factory=PlanInputs)
    activation_store: Callable[[torch.dtype], ActivationStore] | None = None


@dataclass(frozen=True)
class Switches:
    """The speed and evaluation switches of a run, under their flags' names. Each speed switch changes how fast, never
    what is computed (docs/performance.md); ``eval_generate`` chooses whether an evaluation generates at all.

    Attributes:
        share_prefixes: compute a prompt prefix that rows of a micro-batch share once (training and the eval loss).
        fused_cross_entropy: the LM head and the loss fused, over the supervised tokens only.
        eval_generate: generate answers and score them at each evaluation (false: the validation loss only).
        eval_merge_lora: generate with the adapter merged into a temporary copy of the weights.
        eval_share_prefixes: generate with prompt beginnings shared by several prompts computed once.
        eval_pack_lora: generate with each LoRA layer (or q/k/v, gate/up together) as one packed 16-bit matmul.
        eval_loss_in_prefill: compute the validation loss in the generation's forward over the prompts.
        prompt_lookup_num_tokens: draft tokens copied from the prompt that each decode step may confirm (0: none).
    """

    share_prefixes: bool = True
    fused_cross_entropy: bool = True
    eval_generate: bool = True
    eval_merge_lora: bool = False
    eval_share_prefixes: bool = False
    eval_pack_lora: bool = False
    eval_loss_in_prefill: bool = True
    prompt_lookup_num_tokens: int = 0

    @classmethod
    def of(cls, cfg: TrainConfig) -> Switches:
        """A config's switches (a setting the config lacks keeps its default)."""
        names = ("share_prefixes", "fused_cross_entropy", "eval_generate", "eval_merge_lora", "eval_share_prefixes",
                 "eval_pack_lora", "eval_loss_in_prefill", "prompt_lookup_num_tokens")
        got = {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}
        if got.get("eval_generate", True) is None:  # auto: training resolves it; an explicit evaluation generates
            got["eval_generate"] = True
        return cls(**got)
