"""The one training loop, on accelerate. Tasks give it examples, a loss-sum function and an evaluation hook.

Loss normalisation (DESIGN principle 5): each optimizer step's gradient is the mean over every supervised item
(token, for language models) in the whole accumulated batch, across micro-batches and processes. Each micro-batch's
loss sum is divided by the step's global count before ``backward``; DDP averages gradients over processes, so the
loss is also multiplied by the number of processes to turn that average back into the global sum.

Several processes (DDP): every process walks the same global steps (``--batch_size`` is the global batch) and trains
on its share of each step (:func:`~surefit.data.sampling.deal`), in micro-batches of at most the settings' size, so
micro-batch x accumulation x processes covers each step exactly and the run is the same run as on one process. Only
the main process evaluates, logs and writes checkpoints; ``training/distributed.py`` says who waits where.

``--sharding fsdp`` (FSDP2, applied by ``training/distributed.shard_model`` rather than accelerate): the same steps,
with sharded gradients (their norm is summed over processes), every process running the same number of
micro-batches (every forward is a collective), and evaluation on parameters gathered to the main process; each
process writes its own shard of a checkpoint (torch.distributed.checkpoint), which any number of processes resumes.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

import surefit.startup.walltime as walltime
from surefit.config import TrainConfig
from surefit.data.collate import length_parts, part_cost
from surefit.data.sampling import SAMPLER_VERSION, SAMPLERS, as_int_array, deal, epoch_steps, micro_batches
from surefit.errors import Problem, SurefitError
from surefit.threads import check_threads
from surefit.training.distributed import (
    clip_grad_norm,
    describe_processes,
    gather_on_main,
    gathered,
    gradient_sync,
    load_full_optimizer_state,
    load_full_weights,
    load_sharded,
    local,
    process_micro_batches,
    refuse_fsdp_fp16,
    refuse_sharded,
    shard_model,
    tell_ddp_about_unused,
)
from surefit.training.dropout import UNKEYED, training_rows
from surefit.training.heap import release_free_memory, training_begins
from surefit.training.memory import OOMGuard, free_memory, is_oom, shrink_on_oom
from surefit.training.precision import device_settings, saved_activations_in
from surefit.training.processes import barrier, max_over_processes, share_from_main, sum_over_processes, world_size
from surefit.training.schedule import Schedule, Warmup, make_scheduler, plan_schedule
from surefit.training.selection import Selection
from surefit.training.work import LossFn, TrainingWork

if TYPE_CHECKING:
    from surefit.training.checkpoint import TrainerState
    from surefit.training.plan import Plan


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
    # "bf16": activations saved for the backward pass are stored in bf16 (LoRA on 16-bit frozen weights; see
    # training/speedups/lora_fast.SavedActivationsIn). None: as autograd saves them.
    saved_activations: str | None = None
    # A non-finite loss or gradient norm: "stop" the run (the last good checkpoint stays), or "skip_step" (counted).
    on_nonfinite: str = "stop"
    # Training control (training/schedule.py): stop after max_steps (overrides epochs), the scheduler's shape,
    # warmup as steps (>= 1) or a ratio (replaces warmup_ratio), the decay's floor; evaluate every N steps too.
    max_steps: int | None = None
    lr_scheduler: str = "cosine"
    warmup: float | None = None
    min_lr: float = 0.0
    eval_every: int = 0
    # Best-model selection and early stopping: "METRIC" and "METRIC:PATIENCE" (config.parse_metric_goal).
    keep_best: str | None = None
    early_stopping: str | None = None
    # "fsdp": the model is sharded over the processes (FSDP2, training/distributed.shard_model); "none": DDP.
    sharding: str = "none"

    @classmethod
    def from_config(cls, cfg: TrainConfig, plan: Plan) -> LoopSettings:
        """A task config's settings, with the micro-batch and activation storage the memory plan chose."""
        return cls(epochs=cfg.epochs, batch_size=cfg.batch_size, micro_batch_size=plan.micro_batch_size, lr=cfg.lr,
                   weight_decay=cfg.weight_decay, warmup_ratio=cfg.warmup_ratio, max_grad_norm=cfg.max_grad_norm,
                   seed=cfg.seed, log_every=cfg.log_every, saved_activations=plan.saved_activations,
                   on_nonfinite=cfg.on_nonfinite, sharding=cfg.sharding,
                   **{name: getattr(cfg, name) for name in CONTROL})

    def schedule(self, n_examples: int) -> Schedule:
        """The learning-rate schedule and run length for ``n_examples`` training examples."""
        return plan_schedule(n_examples=n_examples, batch_size=self.batch_size, epochs=self.epochs, lr=self.lr,
                             kind=self.lr_scheduler, warmup=Warmup(self.warmup, self.warmup_ratio), min_lr=self.min_lr,
                             max_steps=self.max_steps)


# On a CPU, when to give the C heap's free pages back (see _Fit.__init__): "phases" before and after each evaluation
# once a training step has run; "steps" after every optimizer step too (a chat run's peak -0.13 GB, but each step
# faults its memory in again: about +9% CPU, benchmarks/results/step_memory.md); "never".
RELEASE_HEAP: Literal["steps", "phases", "never"] = "phases"

# The task configs' training-control settings, passed to the loop under the same names.
CONTROL = ("max_steps", "lr_scheduler", "warmup", "min_lr", "eval_every", "keep_best", "early_stopping")


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
    before_commit: Callable[[Path], object] | None = None


@dataclass
class LoopHooks:
    """What the loop reports to and saves through, beside the model and its work.

    Attributes:
        accelerator: the run's accelerator (device, autocast, processes).
        checkpointing: where and when to save, and what to resume from.
        log: the run's :class:`~surefit.training.trackers.MetricsLog`.
        evaluate: ``(model, epoch, step=None) -> metrics``; called for epoch 0 (before training) and each epoch;
            ``None``: no validation data, no evaluation.
        say: prints a line (the main process's).
    """

    accelerator: Any
    checkpointing: Checkpointing
    log: Any
    evaluate: Callable[..., dict[str, Any]] | None = None
    say: Callable[[str], None] = print


@dataclass
class StepPlan:
    """How one optimizer step is cut and run (see :func:`accumulate_step`).

    Attributes:
        micro_batch_size: the most examples per forward on this process.
        guard: out-of-memory splits remembered across steps (``None``: a fresh one, no injected failures).
        saved_activations: ``"bf16"``: activations saved for the backward pass stored in bf16; ``None``: as saved.
        dropout_key: ``(run seed, optimizer step)``: dropout masks drawn per example; ``None``: torch's generator.
        lockstep: FSDP: every process runs the same number of micro-batches, and none can be split.
        say: prints a line.
    """

    micro_batch_size: int
    guard: OOMGuard | None = None
    saved_activations: str | None = None
    dropout_key: tuple[int, int] | None = None
    lockstep: bool = False
    say: Callable[[str], None] = print


class OutOfMemoryInSync(SurefitError):
    title = "out of memory"


class NonFiniteLoss(SurefitError):
    """A non-finite loss, gradient norm or weights: the run stops before the step is applied or saved."""

    title = "non-finite loss"


class TrainingInterrupted(SurefitError):
    """SIGINT/SIGTERM: the current step was finished and saved; the message shows how to resume."""

    exit_code = 130
    title = "training interrupted"

    def render(self) -> str:
        return "\n".join(p.what + (f"\n  {p.fix}" if p.fix else "") for p in self.problems)


class _StopSignal:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current step; a second one stops at once.

    With several processes, the launcher (torchrun) passes a signal on to every process once; the processes agree
    after each step whether any of them was asked to stop (see ``fit``), so they stop at the same step.
    """

    def __init__(self, announce: bool = True) -> None:
        self.requested: str | None = None
        self.announce = announce
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
        if self.announce:
            print(f"\n{self.requested}: finishing the current step, then saving a checkpoint (again to stop at once)",
                  file=sys.stderr)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        if exc is not None and self._old and world_size() > 1:
            # Leaving on an error with other processes (one lost: the launcher's SIGTERM follows at once): the process
            # is on its way out, and the signal's default action must not cut off the report it unwinds to (cli).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_adamw(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, with torch's fused kernel where it runs (CPU and CUDA floating-point parameters), else foreach.

    The same update; the fused kernel does each parameter's whole step in one pass, several times faster than
    foreach on a CPU (docs/performance.md). The Trainer's default is fused too.
    """
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16,
                                                                                  torch.bfloat16, torch.float64)
                                 for p in params)
    extra: dict[str, Any] = {"fused": True} if fused else {}
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **extra)


@dataclass
class Progress:
    """Where the run is and the running sums of the epoch in progress; a checkpoint stores it so that a resumed epoch
    reports the same ``train_loss`` as an uninterrupted one.

    Attributes:
        epoch: the epoch in progress (1-based); step_in_epoch: optimizer steps done in it; global_step: in the run.
        loss_sum, items, tokens, examples, seconds: sums over the epoch's steps so far.
        window_loss, window_items: sums since the last ``step`` record of metrics.jsonl.
    """

    epoch: int = 1
    step_in_epoch: int = 0
    global_step: int = 0
    loss_sum: float = 0.0
    items: int = 0
    tokens: int = 0
    seconds: float = 0.0
    window_loss: float = 0.0
    window_items: int = 0
    examples: int = 0
    nonfinite_skipped: int = 0  # optimizer steps skipped under --on_nonfinite skip_step, in the whole run
    # The length-grouped sampler's version (data/sampling.py): a run keeps the one it started with, so a resumed
    # run's order is its own. Checkpoints written before versions existed hold none: version 1.
    sampler: int = SAMPLER_VERSION

    def add(self, step: StepResult) -> None:
        self.global_step += 1
        self.step_in_epoch += 1
        self.tokens += step.tokens
        self.examples += step.examples
        self.seconds += step.seconds
        if step.skipped:  # its loss is not a number: the epoch's loss is over the steps that were applied
            self.nonfinite_skipped += 1
            return
        self.loss_sum += step.loss_sum
        self.items += step.items
        self.window_loss += step.loss_sum
        self.window_items += step.items

    def next_epoch(self) -> None:
        self.epoch += 1
        self.step_in_epoch = self.items = self.tokens = self.examples = 0
        self.loss_sum = self.seconds = 0.0


@dataclass
class StepResult:
    """One optimizer step: its loss summed over every process's share, its counts, and whether to stop after it."""

    loss_sum: float
    items: int
    tokens: int
    examples: int
    seconds: float
    grad_norm: float | None
    stop: bool
    skipped: bool = False


class _Fit:
    """The state of one ``fit`` call: model, optimizer and schedule as prepared by accelerate, the progress, and the
    steps the loop takes (see :func:`fit` for what each argument means)."""

    def __init__(self, model: Any, work: TrainingWork, settings: LoopSettings, hooks: LoopHooks) -> None:
        self.work, self.settings = work, settings
        self.features, self.lengths, self.counts = work.features, work.lengths, work.counts
        self.loss_fn, self.collate, self.counters, self.where = work.loss_fn, work.collate, work.counters, work.where
        accelerator, say = hooks.accelerator, hooks.say
        self.accelerator, self.evaluate_fn, self.checkpointing = accelerator, hooks.evaluate, hooks.checkpointing
        self.log, self.say = hooks.log, say
        features, collate, loss_fn = work.features, work.collate, work.loss_fn
        refuse_sharded(accelerator, settings.sharding)
        self.sharded = settings.sharding == "fsdp"
        if self.sharded:
            refuse_fsdp_fp16(accelerator)
            # Before the optimizer exists: it must hold the sharded parameters.
            model = shard_model(model, accelerator.device, say)
        self.params = [p for p in model.parameters() if p.requires_grad]
        optimizer = make_adamw(self.params, lr=settings.lr, weight_decay=settings.weight_decay)
        self.steps_per_epoch = math.ceil(len(features) / settings.batch_size)
        # The schedule is built for the steps the run takes (--max_steps, else the epochs'); cosine with min_lr 0 is
        # transformers' get_cosine_schedule_with_warmup, step for step.
        self.schedule = settings.schedule(len(features))
        self.scheduler = make_scheduler(optimizer, self.schedule)
        # A sharded model skips accelerate's prepare, which would wrap it in DDP (or accelerate's own FSDP).
        if not self.sharded and world_size() > 1 and features:
            tell_ddp_about_unused(model, lambda: collate([features[0]]), loss_fn, accelerator, say)
        self.optimizer: torch.optim.Optimizer
        self.model, self.optimizer = (model, optimizer) if self.sharded else accelerator.prepare(model, optimizer)
        self.world, self.main = accelerator.num_processes, accelerator.is_main_process
        if self.world != world_size():
            raise SurefitError(Problem(
                f"the launcher started {world_size()} processes (WORLD_SIZE), but accelerate formed a group of "
                f"{self.world}: each process would train alone", "accelerate config",
                "launch with torchrun, accelerate launch, or surefit train --num_processes N, with a matching config"))
        self.micro, self.accum = process_micro_batches(settings.batch_size, settings.micro_batch_size, self.world)
        if self.world > 1:
            say(describe_processes(settings.batch_size, settings.micro_batch_size, self.world))
        self.progress = Progress(sampler=SAMPLER_VERSION)
        self.guard = OOMGuard()
        UNKEYED.clear()  # dropout modules that could not key their masks by example (training/dropout.py)
        self.unkeyed_said = False
        self.history: list[dict[str, Any]] = []
        self.selection = Selection(settings.keep_best, settings.early_stopping)
        self.stopped_early = False
        # On a CPU activations live in the C heap: its freed pages go back between training and evaluation, so
        # neither phase's peak holds the other's leftovers (training/heap.py). Not before the first step: what the
        # set-up and the evaluation before training free, that step reuses (its peak is the larger); given back, it
        # was only faulted in again (docs/performance.md).
        on_cpu = accelerator.device.type == "cpu"
        self.release_heap = on_cpu and RELEASE_HEAP != "never"
        self.release_heap_steps = on_cpu and RELEASE_HEAP == "steps"
        self.stepped = False  # a training step has run in this process

    # -- evaluation and resume

    def evaluate(self, epoch: int | float, **step: int) -> dict[str, Any]:
        """The task's evaluation, on the main process only (the DDP wrapper's forward is a collective: called on one
        process it would wait for the others forever); the others receive its result. ``step=N`` (evaluations
        between epoch ends) is passed on to the task's hook. A run without an evaluation hook returns ``{}``."""
        if self.evaluate_fn is None:
            return {}
        t0 = time.perf_counter()
        release = self.release_heap and self.stepped
        if release:  # what the training steps left
            release_free_memory()
        if self.world == 1 and not self.sharded:
            metrics = self.evaluate_fn(self.model, epoch, **step)
        else:
            unwrapped = self.model if self.sharded else self.accelerator.unwrap_model(self.model)
            with gathered(self.model):  # FSDP: the main process evaluates (and generates) on the full parameters
                metrics = share_from_main(self.evaluate_fn(unwrapped, epoch, **step) if self.main else None)
        if release:
            release_free_memory()
        return {**metrics, "eval_seconds": round(time.perf_counter() - t0, 3)}

    def evaluate_mid_epoch(self) -> Path | None:
        """``--eval_every``: an ``eval`` record at this step, with the epoch-end metrics. The RNG states are put back
        afterwards, so the evaluation changes nothing the training draws (dropout masks, shuffles): a run resumes
        exactly whatever was evaluated. With a best-model goal, a checkpoint carrying the model follows."""
        from surefit.training.checkpoint import capture_rng, restore_rng

        p = self.progress
        rng = capture_rng()
        try:
            record: dict[str, Any] = {"type": "eval", "epoch": p.epoch, "step": p.global_step,
                      "epoch_progress": round((p.epoch - 1) + p.step_in_epoch / max(self.steps_per_epoch, 1), 4)}
            record.update(self.evaluate(record["epoch_progress"], step=p.global_step))
        finally:
            restore_rng(rng)
            self.model.train()
        name = f"step-{p.global_step:07d}"
        if self.selection.goal is not None:
            self.selection.judge(record, name)
        self.record(record)
        if self.selection.goal is None:
            return None
        return self.checkpoint(name, export=True)

    def start(self) -> None:
        """Resume from the checkpoint named, or evaluate the model before the first step (epoch 0)."""
        from surefit.training.checkpoint import ShardedLoad, load_checkpoint

        folder = self.checkpointing.resume_from
        self.say(self.selection.describe())
        if folder is None:
            if self.evaluate_fn is None:
                return  # no validation data: no evaluation before training (said once by the task runner)
            record = {"type": "epoch", "epoch": 0, **self.evaluate(0)}
            if self.selection.goal is not None:
                self.selection.value(record)  # a metric the task does not report is refused before step 1
            self.record(record)
            return
        # FSDP: a sharded checkpoint (any number of processes wrote it) or an unsharded run's whole tensors.
        sharded = ShardedLoad(set_weights=lambda t: load_full_weights(self.model, t),
                              set_optimizer=lambda s: load_full_optimizer_state(self.model, self.optimizer, s),
                              load_shards=lambda d: load_sharded(self.model, self.optimizer, d))
        state = load_checkpoint(folder, model=self.model if self.sharded else self.accelerator.unwrap_model(self.model),
                                optimizer=self.optimizer, scheduler=self.scheduler,
                                scaler=getattr(self.accelerator, "scaler", None),
                                sharded=sharded if self.sharded else None)
        self.history, self.progress = state.history, Progress(**{"sampler": 1, **state.position})
        if self.progress.sampler not in SAMPLERS:
            raise SurefitError(Problem(
                f"the checkpoint {folder} was written with sampler version {self.progress.sampler}, which this surefit "
                f"does not have (it has {', '.join(map(str, SAMPLERS))}): the rest of the epoch's order is unknown here",
                str(folder), "resume with the surefit version that started the run"))
        if self.progress.sampler != SAMPLER_VERSION:
            self.say(f"note: this run started with sampler version {self.progress.sampler} (data/sampling.py); it "
                     "keeps it, so the resumed epochs see the order they would have seen")
        self.guard.load(state.oom)
        self.selection.load(state.selection)  # the best so far and the early-stopping count go on
        if self.counters is not None:  # saved summed over processes: the main process carries them on
            self.counters.load((state.counters or {}) if self.main else {})
        if self.main:
            self.log.truncate(state.metrics_bytes)  # lines written after this checkpoint would be written twice
        p = self.progress
        self.say(f"resumed from {folder}: epoch {p.epoch}, step {p.step_in_epoch} of {self.steps_per_epoch} (global "
                 f"step {p.global_step})")

    def record(self, record: dict[str, Any]) -> None:
        if self.main:
            self.log.write(record)
        self.history.append(record)

    # -- one optimizer step

    def optimizer_step(self, step_indices: list[int], stop: _StopSignal) -> StepResult:
        """Accumulate the step's micro-batches (splitting any that run out of memory), clip, step, and agree with the
        other processes on the step's loss and on whether to stop after it (one exchange per step)."""
        t0 = time.perf_counter()
        self.stepped = True
        how = StepPlan(self.micro, guard=self.guard, saved_activations=self.settings.saved_activations,
                       dropout_key=(self.settings.seed, self.progress.global_step), lockstep=self.sharded, say=self.say)
        loss_sum = accumulate_step(self.model, self.work, step_indices, self.accelerator, how)
        if UNKEYED and not self.unkeyed_said:
            self.unkeyed_said = True
            names = sorted(UNKEYED)
            self.say(f"dropout in {', '.join(names[:3])}{' and others' if len(names) > 3 else ''} met tensors without "
                     "the batch first: those masks come from torch's generator, so an out-of-memory split redraws them")
        loss_sum, stops = sum_over_processes([loss_sum, float(stop.requested is not None)], self.accelerator.device)
        # Under fp16 the loss scaler expects overflowing gradients now and then and skips those steps itself.
        scaled = getattr(self.accelerator, "scaler", None) is not None
        grad_norm = None
        if self.sharded:  # the norm of sharded gradients is summed over the processes (DTensor)
            grad_norm = clip_grad_norm(self.params, self.settings.max_grad_norm)
        elif self.settings.max_grad_norm > 0:
            grad_norm = float(self.accelerator.clip_grad_norm_(self.params, self.settings.max_grad_norm))
        elif not scaled:
            grads = [p.grad for p in self.params if p.grad is not None]
            grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        items, tokens = sum(self.counts[i] for i in step_indices), sum(self.lengths[i] for i in step_indices)
        examples = len(step_indices)
        if not math.isfinite(loss_sum) or (not scaled and grad_norm is not None and not math.isfinite(grad_norm)):
            # Every process sees the same summed loss and all-reduced gradients, so all of them take this branch.
            self.optimizer.zero_grad(set_to_none=True)
            problem = self.nonfinite_problem(step_indices, loss_sum, grad_norm)
            if self.settings.on_nonfinite != "skip_step":
                raise NonFiniteLoss(problem)
            self.scheduler.step()  # the schedule follows the steps taken through the data, applied or not
            self.say(f"--on_nonfinite skip_step: skipped step {self.progress.global_step + 1}: {problem.what}")
            return StepResult(loss_sum=loss_sum, items=items, tokens=tokens, examples=examples,
                              seconds=time.perf_counter() - t0, grad_norm=grad_norm, stop=stops > 0, skipped=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.release_heap_steps:
            release_free_memory()
        return StepResult(loss_sum=loss_sum, items=items, tokens=tokens, examples=examples,
                          seconds=time.perf_counter() - t0, grad_norm=grad_norm, stop=stops > 0)

    def nonfinite_problem(self, step_indices: list[int], loss_sum: float, grad_norm: float | None,
                          weights_only: bool = False) -> Problem:
        """See :func:`~surefit.training.nonfinite.nonfinite_problem`."""
        from surefit.training.nonfinite import nonfinite_problem

        return nonfinite_problem(self, step_indices, loss_sum, grad_norm, weights_only)

    def describe(self, index: int) -> str:
        return self.where(index) if self.where is not None else f"training example #{index}"

    def log_step(self, step: StepResult) -> None:
        """Every ``log_every`` steps, a ``step`` record of the loss since the previous one."""
        p = self.progress
        if p.global_step % self.settings.log_every:
            return
        if self.main:
            self.log.write({"type": "step", "step": p.global_step, "epoch": p.epoch,
                            "loss": p.window_loss / max(p.window_items, 1), "lr": self.scheduler.get_last_lr()[0],
                            "grad_norm": step.grad_norm, "tokens_per_s": step.tokens / max(step.seconds, 1e-9),
                            "oom_splits": self.guard.splits,
                            **({"nonfinite_skipped": p.nonfinite_skipped} if p.nonfinite_skipped else {})})
        p.window_loss, p.window_items = 0.0, 0

    # -- the end of an epoch, checkpoints

    def end_epoch(self, on_epoch: Callable[[dict[str, Any]], None] | None) -> Path:
        """The epoch record (training and evaluation figures), then an epoch checkpoint carrying the model."""
        p = self.progress
        record = {"type": "epoch", "epoch": p.epoch, "step": p.global_step,
                  "train_loss": p.loss_sum / max(p.items, 1),
                  "train_tokens_per_s": p.tokens / max(p.seconds, 1e-9), "time_per_epoch": p.seconds,
                  "examples_seen": p.examples, "oom_splits": self.guard.splits}
        if p.nonfinite_skipped:
            record["nonfinite_skipped"] = p.nonfinite_skipped
        record.update(self.evaluate(p.epoch))
        if on_epoch is not None:
            on_epoch(record)
        name = f"epoch-{p.epoch}"
        if self.selection.goal is not None:
            self.selection.judge(record, name)
        self.record(record)
        p.next_epoch()
        return self.checkpoint(name, export=True)

    def checkpoint(self, name: str, export: bool) -> Path:
        """Save a checkpoint (the main process writes it; every process goes on once it is complete)."""
        counts = None
        if self.counters is not None:  # every process takes part in the sum, so before the main process goes its own way
            mine = self.counters.state()
            summed = sum_over_processes([float(v) for v in mine.values()], self.accelerator.device)
            counts = {k: int(v) for k, v in zip(mine, summed, strict=True)}
        if self.sharded:  # each process holds a shard: every one looks at its own, and they agree
            bad = sum(int(not bool(torch.isfinite(local(q)).all())) for q in self.params)
            finite = sum_over_processes([float(bad)], self.accelerator.device)[0] == 0
        else:  # every process holds the same weights
            finite = all(bool(torch.isfinite(q).all()) for q in self.params)
        if not finite:
            raise NonFiniteLoss(self.nonfinite_problem([], float("nan"), None, weights_only=True))
        with walltime.part("checkpoints"):
            return self._save(name, export, counts)

    def _save(self, name: str, export: bool, counts: dict[str, int] | None) -> Path:
        from surefit.training.checkpoint import (
            States,
            prune,
            save_checkpoint,
            save_sharded_checkpoint,
        )

        ck = self.checkpointing
        acc = self.accelerator
        states = States(self.optimizer, self.scheduler, getattr(acc, "scaler", None))  # scaler: fp16 loss scaling
        how = partial(ck.export, self.model) if export and ck.export else None
        if self.sharded:  # every process writes its shard; the main process the rest, and renames it into place
            folder = save_sharded_checkpoint(ck.folder / name, model=self.model, states=states,
                                             state=self.trainer_state(counts) if self.main else None, export=how,
                                             before_commit=ck.before_commit)
        elif not self.main:
            barrier()
            return ck.folder / name
        else:
            folder = save_checkpoint(ck.folder / name, model=acc.unwrap_model(self.model), states=states,
                                     state=self.trainer_state(counts), export=how, before_commit=ck.before_commit)
        if self.main:
            best = self.selection.best
            # The best evaluation's checkpoint becomes final/: --keep_checkpoints never removes it.
            prune(ck.folder, ck.keep, self.say, protect=ck.resume_from,
                  keep_names={best["checkpoint"]} if best else set())
        barrier()
        return folder

    def trainer_state(self, counts: dict[str, int] | None) -> TrainerState:
        """Where the run is, for a checkpoint (main process)."""
        from surefit.training.checkpoint import TrainerState

        acc = self.accelerator
        plan = {"batch_size": self.settings.batch_size, "micro_batch_size": self.micro, "grad_accum": self.accum,
                "mixed_precision": str(acc.mixed_precision), "processes": acc.num_processes,
                "sharding": self.settings.sharding}
        # Checkpoints are only taken between optimizer steps (mid-accumulation gradients are not state worth saving),
        # so the micro-step of the position is always 0.
        return TrainerState(global_step=self.progress.global_step, position=asdict(self.progress),
                            history=self.history, metrics_bytes=self.log.bytes_written(), plan=plan,
                            oom=self.guard.state(), counters=counts, selection=self.selection.state())

    def interrupted(self, stop: _StopSignal, where: str, folder: Path) -> TrainingInterrupted:
        return TrainingInterrupted(Problem(
            f"stopped by {stop.requested or 'a signal to another process'} {where}; checkpoint saved to {folder}",
            fix=f"resume with: {self.checkpointing.resume_command}"))


def fit(model: Any, work: TrainingWork, settings: LoopSettings, hooks: LoopHooks) -> list[dict[str, Any]]:
    """Train for ``settings.epochs``, evaluating before the first epoch and after each one, with checkpoints.

    A checkpoint is written every ``checkpointing.save_every`` optimizer steps, at each epoch end (after its
    evaluation) and when SIGINT/SIGTERM arrives (after the current step). Resuming restores the model's trainable
    state, optimizer, scheduler, every RNG and the position in the epoch, so the rest of the run is the same as if it
    had never stopped.

    Args:
        model: the model to train.
        work: the examples, collator, loss and the task's hooks (:class:`~surefit.training.work.TrainingWork`; its
            ``counters`` are summed over processes into checkpoints, so a resumed epoch reports what an uninterrupted
            one does).
        settings: the run's length, optimizer and control settings, with the memory plan's micro-batch.
        hooks: the accelerator, checkpointing, metrics log and evaluation (:class:`LoopHooks`).

    With several processes, ``hooks.evaluate`` runs on the main process only, on the unwrapped model, while the others
    wait for its result; the log and checkpoints are written by the main process only.

    Returns:
        One record per evaluation (epoch 0 first).

    Raises:
        TrainingInterrupted: after saving, when a stop signal arrived.
    """
    training_begins()  # the surefit command held Python's cyclic collector off while it set up (training/heap.py)
    # Process-wide settings (the CPU's denormal flushing, a GPU's attention kernel order) last as long as the run.
    with device_settings(hooks.accelerator.device):
        return _fit(model, work, settings, hooks)


def _fit(model: Any, work: TrainingWork, settings: LoopSettings, hooks: LoopHooks) -> list[dict[str, Any]]:
    from surefit.eval.progress import Progress

    run = _Fit(model, work, settings, hooks)
    say, lengths, evaluate, checkpointing = hooks.say, work.lengths, hooks.evaluate, hooks.checkpointing
    if (settings.max_steps is not None or settings.lr_scheduler != "cosine" or settings.min_lr
            or run.schedule.warmup_asked is not None):  # a warmup longer than the run is said, never silent
        say(run.schedule.describe())
    run.start()
    p = run.progress
    epochs = run.schedule.epochs  # --max_steps may end the last one early, or run more than --epochs
    with _StopSignal(announce=run.main) as stop:
        while p.epoch <= epochs:
            run.model.train()
            # Version 2 computes each step when asked (data/sampling.py): nothing per example, nothing up front.
            batches = (work.epoch_batches(p.epoch) if work.epoch_batches is not None
                       else epoch_steps(lengths if p.sampler == 1 else as_int_array(lengths), settings.batch_size,
                                        settings.seed, p.epoch, p.sampler))
            # A bar on a terminal; in a log file one line per epoch, never glued to the evaluation's (eval/progress.py).
            bar = Progress(f"epoch {p.epoch}/{epochs}", total=len(batches), unit="step", enabled=run.main)
            bar.__enter__()
            bar.set(p.step_in_epoch)
            for k in range(p.step_in_epoch, len(batches)):
                step = run.optimizer_step(batches[k], stop)
                p.add(step)
                bar.update(1, note=f"loss={step.loss_sum / max(step.items, 1):.4f} "
                                   f"tok/s={step.tokens / max(step.seconds, 1e-9):.0f}")
                run.log_step(step)
                if p.step_in_epoch == len(batches) or p.global_step >= run.schedule.total_steps:
                    break  # the epoch's end (or --max_steps) saves a checkpoint and handles a stop request
                saved = None
                if settings.eval_every and p.global_step % settings.eval_every == 0 and evaluate is not None:
                    with bar.pause():  # the evaluation's lines never share the bar's line
                        saved = run.evaluate_mid_epoch()
                    run.stopped_early = run.selection.should_stop
                    if run.stopped_early:
                        break
                if step.stop:
                    bar.close()
                    folder = run.checkpoint(f"step-{p.global_step:07d}", export=False)
                    raise run.interrupted(stop, f"after epoch {p.epoch}, step {p.step_in_epoch} of {len(batches)}",
                                          folder)
                if checkpointing.save_every and p.global_step % checkpointing.save_every == 0 and saved is None:
                    run.checkpoint(f"step-{p.global_step:07d}", export=False)
            bar.close()
            if run.stopped_early:
                break
            epoch = p.epoch
            folder = run.end_epoch(work.on_epoch)
            run.stopped_early = run.selection.should_stop
            if run.stopped_early:
                break
            # A signal may have come during the evaluation: agree again, so no process goes on alone.
            stop_now = sum_over_processes([float(stop.requested is not None)], hooks.accelerator.device)[0] > 0
            if p.global_step >= run.schedule.total_steps:
                break
            if stop_now and epoch < epochs:
                raise run.interrupted(stop, f"at the end of epoch {epoch}", folder)
    if run.stopped_early:
        say(run.selection.stopped_at(p.global_step))
    if run.sharded:
        # The final save (final/) runs on the main process alone after this: it keeps the full parameters.
        gather_on_main(run.model)
    return run.history


def accumulate_step(model: Any, work: TrainingWork, step_indices: list[int], accelerator: Any,
                    how: StepPlan) -> float:
    """Forward and backward every micro-batch of one optimizer step; gradients are left in ``.grad``.

    The gradient equals that of (sum of per-item losses over the whole step, on all processes) / (their count), so
    it does not depend on how the step is split into micro-batches. That is also what makes out-of-memory recovery
    exact: a micro-batch that runs out of memory is split in halves and the step is redone from zero gradients
    (an error mid-backward can leave half-accumulated gradients, so they are discarded rather than trusted).

    ``step_indices`` is the whole step. With several processes this one trains on its share of it
    (:func:`~surefit.data.sampling.deal`, which every process computes alike), and the count that normalises the loss
    is the whole step's, known to every process without communication. Each process runs exactly one synchronising
    backward per step (its last micro-batch; the others run under ``no_sync``), whatever its number of micro-batches;
    a process whose share is empty (a last step with fewer examples than processes) runs a zero-weight pass over one
    of the step's examples, which takes part in the gradient all-reduce and adds nothing to it.

    ``how.dropout_key``: ``(run seed, optimizer step)``; each micro-batch's forward and backward then run with its
    examples' indices set, so dropout masks are drawn per example (training/dropout.py) and a split step draws the
    same ones. None: torch's generator.

    ``how.lockstep`` (FSDP): every forward and backward gathers parameters from the other processes, so every process
    runs the same number of micro-batches (the most any of them needs; the others add zero-weight passes), and an
    out-of-memory error cannot be split and redone (the others are already inside the collectives).

    Returns:
        The step's loss sum on this process (sum it over processes, then divide by the step's item count).
    """
    features, lengths, counts, collate, loss_fn = work.features, work.lengths, work.counts, work.collate, work.loss_fn
    guard, say, lockstep, dropout_key = how.guard or OOMGuard(inject=set()), how.say, how.lockstep, how.dropout_key
    world = accelerator.num_processes
    n_global = sum(counts[i] for i in step_indices)
    share = list(step_indices)
    if world > 1:
        share = deal(share, lengths, world)[accelerator.process_index]
    idle = not share
    scale = 0.0 if idle else world / max(n_global, 1)
    parts = [[step_indices[0]]] if idle else guard.plan(micro_batches(share, how.micro_batch_size, lengths), lengths)
    real = 0 if idle else len(parts)
    if lockstep and world > 1:
        parts += [[step_indices[0]]] * (max_over_processes(len(parts), accelerator.device) - len(parts))
    while True:
        step_loss, failed, batch, in_sync_backward = 0.0, None, None, False
        for j, part in enumerate(parts):
            try:
                guard.tick()
                check_threads()  # fewer OpenMP threads while other processes use the cores (threads.py)
                batch = _to_device(collate([features[i] for i in part]), accelerator.device)
                # Gradients are only all-reduced on the last micro-batch of a step.
                last = j == len(parts) - 1
                gradient_sync(model, last)  # FSDP2's no_sync
                sync = nullcontext() if last or lockstep else accelerator.no_sync(model)
                # The backward pass too: gradient checkpointing recomputes forwards there, with the same masks.
                rows = nullcontext() if dropout_key is None else training_rows(*dropout_key, part)
                with rows:
                    with sync, accelerator.autocast(), saved_activations_in(how.saved_activations, work.activation_store):
                        loss_sum, _ = loss_fn(model, batch)
                    in_sync_backward = last or lockstep
                    accelerator.backward(loss_sum * (scale if j < real else 0.0))
                    in_sync_backward = False
                if j < real:
                    step_loss += loss_sum.item()  # note: a device->host sync, once per micro-batch
            except Exception as e:  # noqa: BLE001 - out-of-memory is recovered below; anything else is re-raised
                if not is_oom(e):
                    raise
                if world > 1 and lockstep:
                    raise OutOfMemoryInSync(Problem(
                        f"out of memory in a micro-batch of {len(part)} examples on process "
                        f"{accelerator.process_index} under --sharding fsdp, where every forward and backward gathers "
                        "parameters with the other processes, so a micro-batch cannot be split and redone alone",
                        "--grad_accum", "raise --grad_accum (smaller micro-batches), turn on "
                        "--gradient_checkpointing, or use more processes")) from e
                if world > 1 and in_sync_backward:
                    # This backward's all-reduce may have started with the other processes: it cannot be redone.
                    raise OutOfMemoryInSync(Problem(
                        f"out of memory in the synchronising backward pass of a micro-batch of {len(part)} examples "
                        f"on process {accelerator.process_index}; with several processes only the step's other "
                        "micro-batches (and forward passes) can be split and redone", "--grad_accum",
                        "raise --grad_accum (smaller micro-batches), or turn on --gradient_checkpointing")) from e
                failed = j
                break
        if failed is None:
            return step_loss
        # Outside the except block: the exception and the frames holding this micro-batch's activations are gone.
        batch = None
        model.zero_grad(set_to_none=True)
        free_memory()
        parts = guard.plan(parts[:failed] + guard.failed(parts[failed], lengths, say) + parts[failed + 1 :], lengths)
        real = 0 if idle else len(parts)  # reached without lockstep padding only (lockstep refuses to split)


def eval_batches(order: Sequence[int], lengths: Sequence[int], batch_size: int, device: Any) -> list[list[int]]:
    """``order`` (longest first) cut into evaluation batches of at most ``batch_size`` rows, each padded to its first
    row's length: the cut that computes the fewest padded tokens, counting a forward as the device's
    ``data/collate.part_cost`` tokens (generation's prompts are cut by the same rule). On a CPU a forward costs its
    tokens, padding included, so batches end where padding grows; on a GPU fewer, fuller batches are what is fast."""
    runs = length_parts([lengths[i] for i in order], [0] * len(order), batch_size, part_cost(device))
    return [list(order[s:e]) for s, e in runs]


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
        for part in eval_batches(order, lengths, bs, accelerator.device):
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
