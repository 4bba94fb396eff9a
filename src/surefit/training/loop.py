"""The one training loop, on accelerate. Tasks give it examples, a loss-sum function and an evaluation hook.

Loss normalisation (DESIGN principle 5): each optimizer step's gradient is the mean over every supervised item
(token, for language models) in the whole accumulated batch, across micro-batches and processes. Each micro-batch's
loss sum is divided by the step's global count before ``backward``; DDP averages gradients over processes, so the
loss is also multiplied by the number of processes to turn that average back into the global sum.

Several processes (DDP): every process walks the same global steps (``--batch_size`` is the global batch) and trains
on its share of each step (:func:`~surefit.data.sampling.deal`), in micro-batches of at most the settings' size, so
micro-batch x accumulation x processes covers each step exactly and the run is the same run as on one process. Only
the main process evaluates, logs and writes checkpoints; ``training/distributed.py`` says who waits where.
"""

from __future__ import annotations

import functools
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from surefit.data.sampling import deal, micro_batches, step_batches
from surefit.errors import Problem, SurefitError
from surefit.training.distributed import barrier, share_from_main, sum_over_processes, world_size
from surefit.training.memory import OOMGuard, free_memory, is_oom, shrink_on_oom
from surefit.training.trackers import Trackers

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
    # "bf16": activations saved for the backward pass are stored in bf16 (LoRA on 16-bit frozen weights; see
    # training/lora_fast.SavedActivationsIn). None: as autograd saves them.
    saved_activations: str | None = None


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, flushed as written so a crashed run keeps what it logged.

    Args:
        trackers: also send each record's numbers to these experiment trackers (``--report_to``).
        after_epoch: called after each epoch record is written (e.g. to redraw ``curves.png``); a failure there is
            reported, never fatal to training.
    """

    def __init__(self, path: str | Path, trackers: Trackers | None = None,
                 after_epoch: Callable[[], None] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")
        self._t0 = time.time()
        self.trackers = trackers
        self.after_epoch = after_epoch

    def bytes_written(self) -> int:
        self._fh.flush()
        return self._fh.tell()

    def truncate(self, size: int) -> None:
        """Cut the log back to ``size`` bytes (the length it had when a checkpoint was written)."""
        self._fh.flush()
        self._fh.truncate(size)
        self._fh.seek(size)
        if self.trackers is not None:
            # The trackers already hold the interrupted process's later points: TensorBoard drops them from here on.
            self.trackers.start(purge_step=_last_step(self.path, size) + 1)

    def write(self, record: dict[str, Any]) -> None:
        record = {**record, "time": round(time.time() - self._t0, 3)}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self.trackers is not None:
            self.trackers.log(record)
        if self.after_epoch is not None and record.get("type") == "epoch":
            try:
                self.after_epoch()
            except Exception as e:  # noqa: BLE001 - a plot must not stop training; say so and go on
                print(f"warning: could not refresh the run's curves: {type(e).__name__}: {e}", file=sys.stderr)

    def close(self) -> None:
        self._fh.close()
        if self.trackers is not None:
            self.trackers.finish()


def _last_step(path: Path, size: int) -> int:
    """The highest global step among the first ``size`` bytes of a metrics.jsonl (0 when none)."""
    with path.open("rb") as fh:
        head = fh.read(size)
    steps = [0]
    for line in head.decode("utf-8", errors="replace").splitlines():
        try:
            steps.append(int(json.loads(line).get("step") or 0))
        except (ValueError, AttributeError, TypeError):
            continue
    return max(steps)


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX-512 BF16 or AMX): only then is bf16 faster on a CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_precision(precision: str, lora: bool = False) -> str:
    """``auto`` -> bf16 on GPUs that support it, fp16 on other GPUs; on a CPU, bf16 for LoRA runs when the CPU has
    native bf16 matmuls, fp32 otherwise. Returns accelerate's name.

    Why LoRA only on a CPU: with LoRA the 16-bit part is the frozen base's matmuls, while the adapters, their
    contribution and the loss stay fp32 (``training/lora_fast.py``), so the run learns as in fp32 (benchmarks/
    cpu_sft.py: final loss within noise of fp32). Full fine-tuning under autocast rounds small updates of the weights
    away in the forward pass; there fp32 stays the CPU default, where speed is not worth the difference.
    """
    if precision == "auto":
        if torch.cuda.is_available():
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if lora and cpu_has_bf16_matmul() else "no"
    return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]


def make_accelerator(precision: str, *, lora: bool = False, report_to: Sequence[str] = (),
                     project_dir: str | Path | None = None) -> Any:
    """The run's accelerator; ``lora``: only adapters train (see :func:`resolve_precision`); ``report_to`` names
    experiment trackers (``tensorboard``, ``wandb``), which log under ``project_dir`` (``project_dir/tensorboard``)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    mixed = resolve_precision(precision, lora)
    if AcceleratorState._shared_state.get("_mixed_precision", mixed) != mixed:
        # accelerate allows one precision per process; a later run in the same process (the Python API, a notebook:
        # an sft run resolving auto to bf16, then a classify run to fp32) starts its state afresh. The process
        # group, if any, is kept.
        AcceleratorState._reset_state(reset_partial_state=False)
    if not report_to:
        return Accelerator(mixed_precision=mixed, **_process_settings())
    from accelerate.utils import ProjectConfiguration

    from surefit.training.trackers import TENSORBOARD_DIR

    folder = Path(project_dir or ".")
    project = ProjectConfiguration(project_dir=str(folder), logging_dir=str(folder / TENSORBOARD_DIR))
    return Accelerator(mixed_precision=mixed, log_with=list(report_to), project_config=project,
                       **_process_settings())


def _process_settings() -> dict[str, Any]:
    """How several processes are set up (no effect on one process).

    ``cpu``: without a GPU, accelerate only forms a group of CPU processes (gloo) when told it runs on the CPU.
    ``find_unused_parameters``: decided in ``fit`` (:func:`unused_parameters`) before the model is wrapped.
    ``timeout``: the others wait while the main process evaluates.
    """
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    from surefit.training.distributed import WAIT, cpu_processes

    return {"cpu": cpu_processes(),
            "kwargs_handlers": [DistributedDataParallelKwargs(find_unused_parameters=True),
                                InitProcessGroupKwargs(timeout=WAIT)]}


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


class OutOfMemoryInSync(SurefitError):
    title = "out of memory"


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

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


@contextmanager
def flush_denormals(device: Any):
    """On a CPU, treat denormal floats (below 1.2e-38) as zero while training.

    x86 CPUs compute with denormals through a microcode slow path. Under bf16 base matmuls they turn up often enough
    that an epoch of ``benchmarks/cpu_sft.py`` (SmolLM2-135M, LoRA) ran 1.23x faster with flushing, with the same
    losses to 4 decimals (fp32 runs were unaffected either way). GPUs flush in most kernels already. torch can set
    this process-wide flag but not read it, so it is switched back off afterwards, torch's default.
    """
    on = getattr(device, "type", None) == "cpu" and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if on:
            torch.set_flush_denormal(False)


def make_adamw(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, with torch's fused kernel where it runs (CPU and CUDA floating-point parameters), else foreach.

    The same update; the fused kernel does each parameter's whole step in one pass. On a 2-core CPU a step over
    33M parameters took 18 ms fused against 101 ms foreach (7.7M LoRA parameters: 12 vs 37 ms), where a
    MiniLM classification step takes about 300 ms (benchmarks/cpu_classify.py). The Trainer's default is fused too.
    """
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16,
                                                                                  torch.bfloat16, torch.float64)
                                 for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {}))


def _flushing_denormals(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with flush_denormals(getattr(kwargs.get("accelerator"), "device", None)):
            return fn(*args, **kwargs)

    return wrapper


@_flushing_denormals
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
    counters: Any | None = None,
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
        counters: the task's running counts for the epoch in progress (``state() -> {name: int}``, ``load(state)``;
            e.g. :class:`~surefit.training.prefixes.PrefixSharing`): checkpoints keep them, summed over processes, so
            a resumed epoch's record reports what an uninterrupted one does.

    With several processes, ``evaluate`` runs on the main process only, on the unwrapped model (the DDP wrapper's
    forward is a collective: called on one process it would wait for the others forever), while the others wait for
    its result; ``log`` and checkpoints are written by the main process only.

    Returns:
        One record per evaluation (epoch 0 first).

    Raises:
        TrainingInterrupted: after saving, when a stop signal arrived.
    """
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    from surefit.training.checkpoint import load_checkpoint, prune, save_checkpoint

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_adamw(params, lr=settings.lr, weight_decay=settings.weight_decay)
    steps_per_epoch = math.ceil(len(features) / settings.batch_size)
    total_steps = steps_per_epoch * settings.epochs
    warmup = int(settings.warmup_ratio * total_steps)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    _refuse_sharded(accelerator)
    if world_size() > 1 and getattr(accelerator, "ddp_handler", None) is not None and features:
        unused = unused_parameters(model, features, collate, loss_fn, accelerator)
        # DDP must be told about parameters that get no gradient, or it fails at the next step; looking for them
        # walks the autograd graph every step, so only when there are some.
        accelerator.ddp_handler.find_unused_parameters = bool(unused)
        if unused:
            say(f"{len(unused)} trainable parameters get no gradient (e.g. {unused[0]}): DDP looks for them every step")
    model, optimizer = accelerator.prepare(model, optimizer)
    world, main = accelerator.num_processes, accelerator.is_main_process
    if world != world_size():
        raise SurefitError(Problem(
            f"the launcher started {world_size()} processes (WORLD_SIZE), but accelerate formed a group of {world}: "
            "each process would train alone", "accelerate config",
            "launch with torchrun, accelerate launch, or surefit train --num_processes N, with a matching config"))
    micro, accum = process_micro_batches(settings.batch_size, settings.micro_batch_size, world)
    if world > 1:
        say(describe_processes(settings.batch_size, settings.micro_batch_size, world))

    def run_evaluate(epoch: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        if world == 1:
            metrics = evaluate(model, epoch)
        else:
            metrics = share_from_main(evaluate(accelerator.unwrap_model(model), epoch) if main else None)
        return {**metrics, "eval_seconds": round(time.perf_counter() - t0, 3)}

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
        if counters is not None:  # saved summed over processes: the main process carries them on
            counters.load((state.get("counters") or {}) if main else {})
        if main:
            log.truncate(state["metrics_bytes"])  # lines written after this checkpoint would be written twice
        say(f"resumed from {checkpointing.resume_from}: epoch {pos['epoch']}, step {pos['step_in_epoch']} of "
            f"{steps_per_epoch} (global step {pos['global_step']})")
    else:
        record = {"type": "epoch", "epoch": 0, **run_evaluate(0)}
        if main:
            log.write(record)
        history.append(record)

    def checkpoint(name: str, export: bool) -> Path:
        counts = None
        if counters is not None:  # every process takes part in the sum, so before the main process goes its own way
            mine = counters.state()
            summed = sum_over_processes([float(v) for v in mine.values()], accelerator.device)
            counts = {k: int(v) for k, v in zip(mine, summed, strict=True)}
        if not main:
            barrier()  # the main process writes it; every process goes on once it is complete
            return checkpointing.folder / name
        folder = save_checkpoint(
            checkpointing.folder / name,
            model=accelerator.unwrap_model(model),
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=getattr(accelerator, "scaler", None),  # fp16 loss scaling state (None otherwise)
            # Checkpoints are only taken between optimizer steps (mid-accumulation gradients are not state worth
            # saving), so the micro-step of the position is always 0.
            state={"global_step": pos["global_step"], "position": pos, "micro_step": 0, "history": history,
                   "oom": guard.state(), "counters": counts,
                   "metrics_bytes": log.bytes_written(),
                   "plan": {"batch_size": settings.batch_size, "micro_batch_size": micro, "grad_accum": accum,
                            "mixed_precision": str(accelerator.mixed_precision),
                            "processes": accelerator.num_processes}},
            export=(lambda d: checkpointing.export(model, d)) if export and checkpointing.export else None,
            before_commit=checkpointing.before_commit,
        )
        prune(checkpointing.folder, checkpointing.keep, say)
        barrier()
        return folder

    with _StopSignal(announce=main) as stop:
        while pos["epoch"] <= settings.epochs:
            epoch = pos["epoch"]
            model.train()
            batches = step_batches(lengths, settings.batch_size, settings.seed, epoch)
            # In a log file (not a terminal) a bar redrawn every step is noise: redraw at most every 30 s there.
            tty = sys.stderr.isatty()
            bar = tqdm(total=len(batches), initial=pos["step_in_epoch"], desc=f"epoch {epoch}/{settings.epochs}",
                       unit="step", dynamic_ncols=True, mininterval=0.5 if tty else 30.0, disable=not main)
            for step_indices in batches[pos["step_in_epoch"] :]:
                t0 = time.perf_counter()
                n_items = sum(counts[i] for i in step_indices)
                step_loss = accumulate_step(
                    model, features, step_indices, lengths, counts,
                    micro_batch_size=micro, loss_fn=loss_fn, collate=collate,
                    accelerator=accelerator, guard=guard, say=say, saved_activations=settings.saved_activations,
                )
                # One exchange per step: the step's loss over every process's share, and whether any process was
                # asked to stop (so that all of them stop after the same step).
                step_loss, stops = sum_over_processes([step_loss, float(stop.requested is not None)],
                                                      accelerator.device)
                stop_now = stops > 0
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
                pos["items"] += n_items
                pos["tokens"] += tokens
                pos["examples"] += len(step_indices)
                pos["seconds"] += dt
                pos["window_loss"] += step_loss
                pos["window_items"] += n_items
                bar.set_postfix(loss=f"{step_loss / max(n_items, 1):.4f}", tok_s=f"{tokens / max(dt, 1e-9):.0f}",
                                refresh=False)
                bar.update(1)
                if pos["global_step"] % settings.log_every == 0 and main:
                    log.write({"type": "step", "step": pos["global_step"], "epoch": epoch,
                               "loss": pos["window_loss"] / max(pos["window_items"], 1),
                               "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                               "tokens_per_s": tokens / max(dt, 1e-9), "oom_splits": guard.splits})
                if pos["global_step"] % settings.log_every == 0:
                    pos["window_loss"], pos["window_items"] = 0.0, 0
                last_of_epoch = pos["step_in_epoch"] == len(batches)
                if stop_now and not last_of_epoch:
                    bar.close()
                    folder = checkpoint(f"step-{pos['global_step']:07d}", export=False)
                    raise TrainingInterrupted(Problem(
                        f"stopped by {stop.requested or 'a signal to another process'} after epoch {epoch}, step "
                        f"{pos['step_in_epoch']} of {len(batches)}; checkpoint saved to {folder}",
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
            record.update(run_evaluate(epoch))
            if on_epoch is not None:
                on_epoch(record)
            if main:
                log.write(record)
            history.append(record)
            pos.update(epoch=epoch + 1, step_in_epoch=0, loss_sum=0.0, items=0, tokens=0, seconds=0.0, examples=0)
            folder = checkpoint(f"epoch-{epoch}", export=True)
            # A signal may have come during the evaluation: agree again, so no process goes on alone.
            stop_now = sum_over_processes([float(stop.requested is not None)], accelerator.device)[0] > 0
            if stop_now and epoch < settings.epochs:
                raise TrainingInterrupted(Problem(
                    f"stopped by {stop.requested or 'a signal to another process'} at the end of epoch {epoch}; "
                    f"checkpoint saved to {folder}",
                    fix=f"resume with: {checkpointing.resume_command}"))
    return history


def process_micro_batches(batch_size: int, micro_batch_size: int, processes: int) -> tuple[int, int]:
    """``(micro-batch, accumulation)`` of one process: its share of a step is at most ``ceil(batch / processes)``
    examples, cut into micro-batches of at most ``micro_batch_size`` (the most one process runs at once).

    One process: ``(micro_batch_size, batch_size / micro_batch_size)``, as configured.
    """
    share = math.ceil(batch_size / processes)
    micro = max(1, min(micro_batch_size, share))
    return micro, math.ceil(share / micro)


def describe_processes(batch_size: int, micro_batch_size: int, processes: int) -> str:
    """How a global batch is split over processes and micro-batches, and what was done where it does not divide."""
    micro, accum = process_micro_batches(batch_size, micro_batch_size, processes)
    share, extra = divmod(batch_size, processes)
    if micro * accum * processes == batch_size:
        return (f"{processes} processes: batch {batch_size} = micro-batch {micro} x accumulation {accum} x "
                f"{processes} processes (each step's examples are dealt to the processes by tokens; the same run as "
                "one process)")
    if not extra:
        dealt = f"{share} to each process"
    elif extra == 1:
        dealt = f"{share + 1} to one process, {share} to the other{'s' if processes > 2 else ''}"
    else:
        dealt = f"{share + 1} to {extra} processes, {share} to the other{'s' if processes - extra > 1 else ''}"
    cut = " + ".join(str(min(micro, share + (extra > 0) - i)) for i in range(0, share + (extra > 0), micro))
    return (f"{processes} processes: batch {batch_size} is not micro-batch x accumulation x processes exactly; it "
            f"stays {batch_size}: each step's examples are dealt by tokens ({dealt}) and cut into micro-batches of "
            f"at most {micro} (the largest share runs as {cut}). The loss is normalised by the whole step's count, so the update is the "
            "one a single process would make; a last step with fewer examples than processes leaves some without "
            "any (they run a zero-weight pass)")


def unused_parameters(model: Any, features: Sequence[dict[str, Any]], collate: Callable[[list[dict[str, Any]]], Any],
                      loss_fn: LossFn, accelerator: Any) -> list[str]:
    """Trainable parameters that a forward and backward of the first example leave without a gradient (a pooler under
    a head that ignores it, say). The random generators and the buffers (BatchNorm statistics) are put back."""
    model.to(accelerator.device)
    model.zero_grad(set_to_none=True)
    device = torch.device(accelerator.device)
    devices = [device.index or 0] if device.type == "cuda" else []
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    with torch.random.fork_rng(devices=devices):
        batch = _to_device(collate([features[0]]), device)
        with accelerator.autocast():
            loss, _ = loss_fn(model, batch)
        loss.backward()
    names = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    return names


def _refuse_sharded(accelerator: Any) -> None:
    """FSDP and DeepSpeed shard parameters or optimizer states across processes; the loop's checkpoints, evaluation
    and saving read them whole on the main process, which would save a shard as if it were the model."""
    kind = str(getattr(accelerator, "distributed_type", "NO")).split(".")[-1]
    if kind in ("FSDP", "DEEPSPEED"):
        from surefit.errors import ConfigError

        raise ConfigError(Problem(
            f"accelerate is set up for {kind}, which surefit does not train with yet: its checkpoints, evaluation and "
            "final save read the whole model and optimizer on the main process, and under "
            f"{kind} each process holds only a shard of them",
            "accelerate config",
            "launch with a DDP config (examples/accelerate/multi-gpu.yaml, multi-node.yaml), torchrun, or "
            "surefit train --num_processes N"))


def _saved_in(dtype: str | None) -> Any:
    if dtype is None:
        return nullcontext()
    from surefit.training.lora_fast import SavedActivationsIn

    return SavedActivationsIn({"bf16": torch.bfloat16}[dtype])


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
    saved_activations: str | None = None,
) -> float:
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

    Returns:
        The step's loss sum on this process (sum it over processes, then divide by the step's item count).
    """
    guard = guard or OOMGuard(inject=set())
    world = accelerator.num_processes
    n_global = sum(counts[i] for i in step_indices)
    share = list(step_indices)
    if world > 1:
        share = deal(share, lengths, world)[accelerator.process_index]
    idle = not share
    scale = 0.0 if idle else world / max(n_global, 1)
    parts = [[step_indices[0]]] if idle else guard.plan(micro_batches(share, micro_batch_size, lengths), lengths)
    while True:
        step_loss, failed, batch, in_sync_backward = 0.0, None, None, False
        for j, part in enumerate(parts):
            try:
                guard.tick()
                batch = _to_device(collate([features[i] for i in part]), accelerator.device)
                # Gradients are only all-reduced on the last micro-batch of a step.
                last = j == len(parts) - 1
                sync = nullcontext() if last else accelerator.no_sync(model)
                with sync, accelerator.autocast(), _saved_in(saved_activations):
                    loss_sum, _ = loss_fn(model, batch)
                in_sync_backward = last
                accelerator.backward(loss_sum * scale)
                in_sync_backward = False
                if not idle:
                    step_loss += loss_sum.item()  # note: a device->host sync, once per micro-batch
            except Exception as e:  # noqa: BLE001 - out-of-memory is recovered below; anything else is re-raised
                if not is_oom(e):
                    raise
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
