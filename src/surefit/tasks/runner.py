"""What the tasks share: the prepared run, the runner (doctor, memory plan, loop, final save) and the surface every
task module has (:class:`Task`: ``prepare``, ``run``, ``final_files``, ``evaluate``, ``predict``, ``export``).

``prepare`` builds everything the loop needs and writes nothing (the doctor calls it too, so it checks exactly what
training would use); :func:`train` hands what it found to the run folder (:class:`~surefit.run_folder.RunFolder`),
which writes every file of the run.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import surefit.startup as startup
import surefit.startup.cache as startup_cache
import surefit.startup.walltime as walltime
from surefit.config import TrainConfig
from surefit.data.summary import DataSummary
from surefit.doctor.core import Report
from surefit.doctor.gate import cached_doctor, gate, run_doctor
from surefit.errors import ConfigError, Problem, SurefitError, raise_if
from surefit.eval.progress import phase
from surefit.models import quiet_libraries
from surefit.run_folder import Found, RunFolder
from surefit.run_folder.guard import train_problems
from surefit.run_folder.open_run import Run
from surefit.tasks.baseline_eval import BaselineReuse
from surefit.threads import describe_threads, governor, limited_by_cgroup
from surefit.training.distributed import plain_architectures
from surefit.training.loop import LoopHooks, LoopSettings, fit
from surefit.training.plan import plan_run
from surefit.training.precision import autocast_where, device_settings
from surefit.training.processes import is_main_process, on_main, world_size
from surefit.training.trackers import MetricsLog
from surefit.training.work import Evaluation, TrainingWork

__all__ = ["Evaluation", "Inspects", "Prepared", "RunResult", "Task", "doctor", "render_columns", "train"]

Say = Callable[[str], None]


@dataclass
class Prepared:
    """Everything a training run needs, built by a task's ``prepare`` without writing to the run folder.

    Attributes:
        cfg: the task's config.
        model: the model as it will train (adapters applied); accelerator: the run's accelerator.
        work: the examples, collator, loss and evaluation the loop runs (``training/work.py``).
        save: ``(model, folder)``: writes the model in the task's ``final/`` format.
        check: the doctor on exactly these objects (``() -> Report``).
        found: what the run folder keeps of the data: the data report, rejected rows, the task's other files.
        saved: what ``final/`` holds, in words, for the last line of the run.
        cache_key: what the doctor and the planner read besides the settings (the model's files, the tokenizer, the
            encoded examples), as JSON-able content identities, computed only when the cache is on; ``None``: not
            cacheable (user code, a model not on disk).
        baseline: what the evaluation before training reads, so that it is reused from the start-up cache
            (``tasks/baseline_eval.py``); ``None``: the task's epoch 0 is always computed.
    """

    cfg: TrainConfig
    model: Any
    accelerator: Any
    work: TrainingWork
    save: Callable[[Any, Path], None]
    check: Callable[[], Report]
    found: Found
    saved: str
    cache_key: Callable[[], dict[str, Any]] | None = None
    baseline: BaselineReuse | None = None


# A task's own config class (SFTConfig, ClassifyConfig ...): a task takes its own, so a parameter, contravariant.
C = TypeVar("C", bound=TrainConfig, contravariant=True)
# Any task's config, returned as the class it came in.
ConfigT = TypeVar("ConfigT", bound=TrainConfig)


class PrepareFn(Protocol[C]):
    """A task's ``prepare``: the run's setup from its config; problems already found join the data's."""

    def __call__(self, cfg: C, say: Say = ..., problems: list[Problem] | None = ...) -> Prepared: ...


class Task(Protocol[C]):
    """What the runner and the finished-run commands call on a task. Each task module satisfies it as it stands
    (``tasks/__init__.py`` registers the modules; a type checker and ``tests/test_tasks.py`` hold them to it).

    ``save`` and ``load`` are the task's own (their arguments differ by task): training reaches ``save`` through
    :attr:`Prepared.save`, and the task's ``evaluate``, ``predict`` and ``export`` call its ``load``.
    """

    @property
    def FIELDS(self) -> tuple[str, ...]:  # noqa: N802 - the module constant's name
        """The column flags ``surefit eval`` / ``predict`` take for other data (``--input_field`` ...)."""
        ...

    def final_files(self, cfg: C) -> list[tuple[str, ...]]:
        """What ``final/`` must hold (any one of these groups of files)."""
        ...

    def prepare(self, cfg: C, say: Say = ..., problems: list[Problem] | None = ...) -> Prepared:
        """The run's setup, written nowhere (:class:`Prepared`)."""
        ...

    def run(self, cfg: C, say: Say = ...) -> RunResult:
        """Train: :func:`train` on what ``prepare`` builds."""
        ...

    def evaluate(self, run: Run, data: str | None, batch_size: int, max_new_tokens: int | None,
                 fields: dict[str, str], say: Say = ...) -> tuple[str, int, dict[str, Any], list[dict[str, Any]]]:
        """``surefit eval``: (what was evaluated, rows, metrics, prediction records)."""
        ...

    def predict(self, run: Run, inputs: str | list[str] | None, file: str | None, batch_size: int,
                max_new_tokens: int | None, fields: dict[str, str],
                say: Say = ...) -> Iterator[list[dict[str, Any]]]:
        """``surefit predict``: records, one batch at a time, in input order."""
        ...

    def export(self, run: Run, folder: Path, merge: bool, say: Say = ...) -> str:
        """``surefit export``: write the run's model into ``folder``; returns what was written, in words."""
        ...


class Inspects(Protocol[C]):
    """A task that can show what training would supervise without training (``surefit inspect``): sft and dpo. Not
    every task can (classify and custom have no supervised spans), so it is apart from :class:`Task`."""

    def inspect(self, cfg: C, out: str | None = ..., show: int = ..., color: bool | None = ...,
                say: Say = ...) -> dict[str, Any]:
        """Encode every row as training would, print the first ``show`` with supervised spans marked; the counts."""
        ...


@dataclass
class RunResult:
    """What a training run produced.

    Attributes:
        output_dir: the run folder; final_dir: the saved model (or adapter) and tokenizer.
        history: one record per evaluation, epoch 0 (before training) first, as written to metrics.jsonl.
        data_report: counts of what happened to the data (split, augmentation, truncation, exclusions), as saved in
            ``data_report.json``.
    """

    output_dir: Path
    final_dir: Path
    history: list[dict[str, Any]]
    data_report: dict[str, Any]

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return self.history


def train(cfg: C, prepare: PrepareFn[C], say: Say = print) -> RunResult:
    """Prepare the run, start its folder, run the doctor, plan the memory, train, and save ``final/``."""
    say = on_main(say)  # several processes: the main one reports and writes files, the others wait where needed
    clock, times = startup.Clock(), walltime.WallTimes()
    # Before the lock: its file must not be created among the data or in the base model's folder either.
    raise_if(train_problems(cfg), ConfigError)
    folder = RunFolder(cfg, say)
    # one run at a time in --output_dir (run_folder.RunLock)
    with startup.timing(clock), walltime.recording(times), folder.locked():
        return _train(folder, prepare, clock, times)


def _train(folder: RunFolder, prepare: PrepareFn[Any], clock: startup.Clock, times: walltime.WallTimes) -> RunResult:
    from accelerate.utils import set_seed

    say = folder.say
    if governor() is not None:  # it says when it changes the thread count, in the run's words
        governor().say = say  # type: ignore[union-attr]
    if (limited := limited_by_cgroup()) is not None:
        say(limited)
    quiet_libraries()
    say_alias_notes(folder.cfg, say)
    cfg = folder.cfg = gpu_preset_without_gpu(folder.cfg, say)
    set_seed(cfg.seed)
    # The run folder's problems (a previous run, --resume) are cheap to find: they join the data's in one report.
    early: list[Problem] = []
    folder.check(early)
    resume_from = folder.resume_point(early)
    with clock.phase("prepare (other)"):  # the task names its own phases inside (data, model, ...)
        try:
            p = prepare(cfg, say, problems=early)
        except SurefitError as e:
            folder.write_rejected(e.rejected)  # so that "all rows rejected" points at a list that exists
            raise
    folder.start(p.found)
    warn_small_validation(p.found.data_report, cfg, say)
    # The doctor's dry run and the planner's probe compute as training will (a GPU's attention kernels, the CPU's
    # denormal flushing): the plan measures the kernels the steps use.
    with device_settings(p.accelerator.device):
        return _run_prepared(folder, p, clock, times, resume_from)


def _run_prepared(folder: RunFolder, p: Prepared, clock: startup.Clock, times: walltime.WallTimes,
                  resume_from: Path | None) -> RunResult:
    """The doctor, the memory plan, the loop and the final save of a prepared run."""
    cfg, say = folder.cfg, folder.say
    cache = startup_cache.StartupCache(None if getattr(cfg, "no_cache", False) else startup_cache.cache_dir(), say)
    with clock.phase("cache key"):
        key = startup_cache.run_key(cfg, p.cache_key, p.accelerator) if cache.folder is not None else None
    with clock.phase("doctor"), phase("doctor"):
        report = run_doctor(lambda: cached_doctor(lambda: _where_it_trains(p, cfg), key, cache, clock.cache))
        clock.checks = dict(getattr(report, "seconds", None) or {})
        folder.write_doctor(report)
        gate(report, cfg, say)
    acc = p.accelerator
    with clock.phase("memory plan"), phase("memory plan"):
        # The planner's measurements (not its choices: the budget is read afresh) are reused for an identical setup.
        memo = startup_cache.planner_memo(cache, key)
        before = json.dumps(memo, sort_keys=True)
        plan = plan_run(cfg, p.model, acc, p.work, say=say, memo=memo)
        folder.write_plan(plan)
        reused = bool(before != "{}" and json.dumps(memo, sort_keys=True) == before)
        clock.cache["planner"] = cache.status(key, reused)
        if not reused:
            cache.put("planner", key, memo)
    if p.baseline is not None and has_validation(cfg) and resume_from is None:
        # epoch 0 is the model as loaded: reused when nothing it reads changed (a resumed run has no epoch 0)
        p.baseline.arm(cache, cfg, plan, clock.cache, say)
    settings = LoopSettings.from_config(cfg, plan)
    # The schedule the loop builds, for the report's drawing (the same formula, training/schedule.py).
    schedule = settings.schedule(len(p.work.features))
    folder.write_json("schedule.json", schedule.to_dict())
    with clock.phase("metrics log and trackers"):
        log = folder.metrics_log(acc)

    exported = ExportedModel()

    def export(model: Any, into: Path) -> None:
        p.save(acc.unwrap_model(model), into)
        plain_architectures(into)  # --sharding fsdp: the model's own class, not FSDP<Class>
        exported.note(model, into)

    evaluates = has_validation(cfg) and p.work.evaluate is not None
    if not has_validation(cfg):
        say("no validation data (--val_fraction 0 and no --val_data): training without evaluation; metrics.jsonl "
            "holds the training figures and final/ the last state")
    hooks = LoopHooks(accelerator=acc, checkpointing=folder.checkpointing(export, resume_from), log=log, say=say,
                      evaluate=_evaluation(folder, p, log, settings, plan.eval_batch_size) if evaluates else None)
    clock.begin("loop setup")  # until step 1: the optimizer, accelerate's prepare, the sampler
    work = dataclasses.replace(p.work, loss_fn=_starting(clock, folder, p.work.loss_fn, times))
    try:
        history = fit(p.model, work, settings, hooks)
    finally:
        log.close()
    loop_end = time.time()
    times.recording = True  # a run that took no step (resumed at its end) has its final save and report timed too
    with times.part("final save"):
        final = folder.save_final(final_model(folder, history, exported.final(p.model, lambda d: export(p.model, d), say)))
    say(f"saved {p.saved} to {final}")
    threads = describe_threads()
    if threads.get("changes"):
        say(f"threads: fewer than {threads['threads']} for {threads['seconds_below_full']:.0f} s of the run while other "
            f"processes used the cores ({len(threads['changes'])} changes, each said when made)")
    with times.part("report"):
        folder.write_report(acc)
    if cfg.profile and is_main_process():
        startup_s = clock.stop()
        loop_s = loop_end - clock.step1_at if clock.step1_at is not None else 0.0
        profile = walltime.Profile.build(time.time() - clock.started, startup_s, clock.split(), loop_s, times,
                                         clock.checks)
        folder.write_profile(profile.to_json())
        say(profile.table())
    return RunResult(folder.path, final, history, p.found.data_report.to_json())


class ExportedModel:
    """The last model a checkpoint exported, so that ``final/`` is copied from it rather than serialised a second
    time when the weights have not changed since (every parameter's in-place version counter is the same)."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.versions: list[int] = []

    @staticmethod
    def _versions(model: Any) -> list[int]:
        return [q._version for q in model.parameters()]

    def note(self, model: Any, into: Path) -> None:
        """``model`` was exported into ``into``: a checkpoint's ``NAME.tmp/model``, renamed to ``NAME/model``."""
        self.folder = None
        if into.parent.name.endswith(".tmp") and world_size() == 1:
            self.folder = into.parent.with_name(into.parent.name.removesuffix(".tmp")) / into.name
            self.versions = self._versions(model)

    def final(self, model: Any, export: Callable[[Path], None], say: Say = print) -> Callable[[Path], None]:
        """What writes ``final/`` as the last state: a verified copy of the last export when the weights are the
        ones it exported, else ``export`` (and said why, when the copy did not verify)."""

        def write(dest: Path) -> None:
            from surefit.run_folder.verified import copy_exported_model

            if self.folder is None or self.versions != self._versions(model) or not self.folder.is_dir():
                export(dest)
                return
            problem = copy_exported_model(self.folder.parent, dest)
            if problem is not None:
                say(f"note: final/ written afresh from the model in memory: the copy of {self.folder} did not "
                    f"verify ({problem})")
                export(dest)

        return write


def _where_it_trains(p: Prepared, cfg: TrainConfig) -> Report:
    """The doctor's checks on the device step 1 runs on and under its autocast: a run that does not shard the model
    moves it there now (the planner would next), so that a GPU run's dry run is a GPU forward; a sharded one keeps
    it on the CPU for ``prepare`` to split, and its dry run runs there under the CPU's autocast."""
    from torch import nn

    if isinstance(p.model, nn.Module) and getattr(cfg, "sharding", "none") == "none":
        p.model.to(p.accelerator.device)
    with autocast_where(p.model, p.accelerator):
        return p.check()


def _starting(clock: startup.Clock, folder: RunFolder, loss_fn: Any, times: walltime.WallTimes) -> Any:
    """The loss function, stopping the start-up clock at the first training forward (step 1 begins there)."""

    def started(model: Any, batch: dict[str, Any]) -> Any:
        if clock.total is None:
            end_startup(clock, folder)
            times.recording = True  # --profile's parts count from here
        return loss_fn(model, batch)

    return started


def _evaluation(folder: RunFolder, p: Prepared, log: MetricsLog, settings: LoopSettings,
                batch_size: int) -> Callable[..., dict[str, Any]]:
    """The loop's evaluation: the task's, with its predictions written and ``--log_samples`` logged."""
    cfg, evaluate = p.cfg, p.work.evaluate
    assert evaluate is not None
    schedule = settings.schedule(len(p.work.features))

    def run(model: Any, epoch: int | float, step: int | None = None) -> dict[str, Any]:
        # ``step``: an --eval_every evaluation inside an epoch (``epoch`` is then the fractional epoch reached).
        # epoch 0 is start-up; after step 1 --profile counts the loss and generation inside it apart
        with startup.phase("evaluation before training"), walltime.part("evaluation (other)"):
            result = evaluate(model, epoch, batch_size)
            if result.records is not None:
                folder.write_predictions(int(epoch), result.records, step)
                if cfg.log_samples:
                    at = step if step is not None else min(int(epoch) * schedule.steps_per_epoch, schedule.total_steps)
                    log_samples(folder, log, result.records[: cfg.log_samples], epoch, at)
        return result.metrics

    return run


# ------------------------------------------------------------------------------------------------------------ control
# Training control around the loop: other tools' names noted, a GPU preset on a machine without that GPU, training
# without validation data, a small validation split, logged samples, and which model ``final/`` holds.


def final_model(folder: RunFolder, history: list[dict[str, Any]],
                export_last: Callable[[Path], None]) -> Callable[[Path], object]:
    """What writes ``final/``: the model as training left it, or, when the run selected the best evaluation, that
    evaluation's model as its checkpoint exported it (said with its metric, value and step)."""
    best = best_evaluation(history)
    if best is None:
        return export_last
    source = folder.checkpoint_model(best["best_checkpoint"])
    folder.say(f"final/ is the best evaluation: {best['best_metric']} {best['best_value']:.4f} at step "
        f"{best['best_step']} (checkpoints/{best['best_checkpoint']})")
    from surefit.run_folder.verified import copy_checkpoint_model

    return lambda dest: copy_checkpoint_model(source.parent, dest)  # verified first; its manifest carried over


def log_samples(folder: RunFolder, log: MetricsLog, records: list[dict[str, Any]], epoch: int | float,
                step: int) -> None:
    """``--log_samples``: the same first validation rows at every evaluation, as prompt / reference / prediction, to
    ``predictions/samples/step_N.jsonl`` (one file per evaluation, so a resumed run rewrites rather than repeats),
    the trackers' text (TensorBoard) and the printout."""
    samples = [{"step": step, "epoch": epoch, "sample": i, "where": r.get("where"),
                "prompt": r.get("input", r.get("text")), "reference": r.get("gold"), "prediction": r.get("prediction")}
               for i, r in enumerate(records)]
    folder.write_samples(step, samples)
    trackers = log.trackers if is_main_process() else None
    if trackers is not None:
        trackers.log_text({f"samples/{s['sample']}": f"**prompt**: {s['prompt']}\n\n**reference**: "
                               f"{s['reference']}\n\n**prediction**: {s['prediction']}" for s in samples}, step)
    for s in samples:
        folder.say(f"  sample {s['sample']} at step {step}: {str(s['prompt'])[:60]!r} -> {str(s['prediction'])[:80]!r} "
            f"(reference {str(s['reference'])[:60]!r})")


# Below this many validation examples, an evaluation's metrics move in coarse steps (1/N): say so.
SMALL_VALIDATION = 20


def warn_small_validation(data_report: DataSummary, cfg: TrainConfig, say: Say) -> None:
    """A validation split of fewer than :data:`SMALL_VALIDATION` examples gets a warning that gives the number."""
    n = data_report.validation_examples
    if isinstance(n, int) and 0 < n < SMALL_VALIDATION:
        selects = " and --keep_best/--early_stopping would choose on noise" if (cfg.keep_best or cfg.early_stopping) \
            else ""
        say(f"warning: the validation split has only {n} example{'s' if n != 1 else ''} (fewer than "
            f"{SMALL_VALIDATION}): each metric moves in steps of 1/{n}{selects}; give more with --val_fraction or "
            "--val_data")


def gpu_preset_without_gpu(cfg: ConfigT, say: Say) -> ConfigT:
    """A preset made for a GPU (it sets --gpu_memory_gb) on a machine without a CUDA GPU: say that the plan is for a
    GPU this machine does not have, and leave off the preset's gradient checkpointing (on a CPU it only slows
    training down) unless the user asked for it themselves."""
    import torch

    preset_only = getattr(cfg, "preset_only", None) or set()
    if not cfg.preset or "gpu_memory_gb" not in preset_only or torch.cuda.is_available():
        return cfg
    text = (f"preset {cfg.preset} plans for a GPU with {cfg.gpu_memory_gb} GB, and this machine has no CUDA GPU: "
            "the memory plan is for that GPU's budget, and training runs on the CPU")
    if cfg.gradient_checkpointing and "gradient_checkpointing" in preset_only:
        text += ("; the preset's gradient checkpointing is left off (on a CPU it only slows training; pass "
                 "--gradient_checkpointing to keep it)")
        notes = {k: getattr(cfg, k) for k in ("alias_notes", "preset_only") if hasattr(cfg, k)}
        cfg = dataclasses.replace(cfg, gradient_checkpointing=False)
        for k, v in notes.items():
            setattr(cfg, k, v)
    say(text)
    return cfg


def has_validation(cfg: TrainConfig) -> bool:
    """Whether the run has validation data to evaluate on (``--val_data``, or a ``--val_fraction`` above 0)."""
    return cfg.val_data is not None or cfg.val_fraction > 0


def best_evaluation(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last evaluation record's best-so-far (``best_*`` keys, written with a best-model goal), or ``None``."""
    for record in reversed(history):
        if record.get("best_checkpoint"):
            return record
    return None


def say_alias_notes(cfg: TrainConfig, say: Say) -> None:
    """Print once which other tools' setting names were read as which surefit settings (``config.ALIASES``)."""
    for note in dict.fromkeys(getattr(cfg, "alias_notes", None) or []):
        say(note)


def end_startup(clock: startup.Clock, folder: RunFolder) -> None:
    """Stop the start-up clock, write ``OUTPUT/startup.json``, and say where the time went when it was long."""
    if clock.stop() > startup.REPORT_AFTER_S:
        folder.say(clock.line())
    folder.write_startup({**clock.record(), "threads": describe_threads()})  # main process only


def doctor(cfg: C, prepare: PrepareFn[C], say: Say = print) -> Report:
    """The doctor's report on the setup ``prepare`` builds, exactly as training would use it; nothing is written."""
    quiet_libraries()
    say_alias_notes(cfg, say)
    cfg = gpu_preset_without_gpu(cfg, say)
    p = prepare(cfg, say)
    with phase("doctor"):
        report = _where_it_trains(p, cfg)
    say(str(report))
    return report


def render_columns(table: list[dict[str, str]]) -> str:
    """The kept / dropped / why table of a run's columns (``columns.json``), as printed before training."""
    width = max(len(r["column"]) for r in table)
    lines = [f"  {'column'.ljust(width)}  kept?    why"]
    lines += [f"  {r['column'].ljust(width)}  {r['status'].ljust(7)}  {r['why']}" for r in table]
    return "\n".join(lines)
