"""What the three tasks share: the prepared run, and the run itself (doctor, memory plan, loop, final save).

Each task module (``sft``, ``classify``, ``custom``) has the same small surface:

- ``prepare(cfg) -> Prepared``: data, model, collator, loss and evaluation, everything the loop needs, built
  without writing to the run folder (the doctor calls it too, so it checks exactly what training would use);
- ``run(cfg)``: :func:`train` on what ``prepare`` built;
- ``save(...)`` / ``load(run)``: the task's format of ``final/``, written and read in the same file;
- ``evaluate(run, data)`` / ``predict(run, ...)``: use a finished run, scored as training scored each epoch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import surefit.startup as startup
import surefit.startup_cache as startup_cache
from surefit.doctor.core import Report
from surefit.doctor.gate import cached_doctor, gate, run_doctor
from surefit.errors import ConfigError, Problem, raise_if
from surefit.models import quiet_libraries
from surefit.run_folder import (
    STARTUP,
    check_output_dir,
    lock_run,
    open_metrics_log,
    predictions_path,
    resume_command,
    resume_point,
    save_final,
    start_output_dir,
    write_json,
    write_jsonl,
    write_rejected,
    write_run_report,
)
from surefit.run_folder.guard import train_problems
from surefit.tasks.control import (
    final_model,
    gpu_preset_without_gpu,
    has_validation,
    log_samples,
    say_alias_notes,
    warn_small_validation,
)
from surefit.training.distributed import on_main, plain_architectures
from surefit.training.loop import Checkpointing, LoopSettings, LossFn, fit
from surefit.training.plan import plan_run

Say = Callable[[str], None]


@dataclass
class Evaluation:
    """One evaluation: the metrics (``eval_loss`` and the task's own) and, per validation row, its prediction record
    (``None`` when the task has none, e.g. custom models)."""

    metrics: dict[str, Any]
    records: list[dict[str, Any]] | None = None


@dataclass
class Prepared:
    """Everything a training run needs, built by a task's ``prepare`` without writing to the run folder.

    Attributes:
        cfg: the task's config.
        model: the model as it will train (adapters applied); accelerator: the run's accelerator.
        features, lengths, counts: the training examples as the collator takes them, their token lengths, and the
            items each carries in the loss (supervised tokens, or 1 per example).
        collate: pads a list of features into a batch (nothing else; see ``data/collate.py``).
        loss_fn: ``(model, batch) -> (loss_sum, n_items)``.
        evaluate: ``(model, epoch, batch_size) -> Evaluation``; prints the epoch's line.
        save: ``(model, folder)``: writes the model in the task's ``final/`` format.
        check: the doctor on exactly these objects (``() -> Report``).
        data_report: counts of what happened to the data (``data_report.json``).
        files: other JSON files of the run folder by name (``columns.json``); jsonl: JSON-lines files by name
            (``excluded_rows.jsonl``), written when not empty.
        plan: keyword arguments for the memory planner beyond the training examples (``eval_lengths``,
            ``generate_lengths``, ``lora``, and ``collate`` or ``loss_fn`` where the probe uses other ones).
        saved: what ``final/`` holds, in words, for the last line of the run.
        on_epoch, counters, epoch_batches: passed on to :func:`~surefit.training.loop.fit`.
        rejected: rows dropped under ``--on_bad_rows skip`` (already written to ``rejected_rows.jsonl``).
        where: a training example's index -> its source row in words, for messages (a non-finite loss names rows).
    """

    cfg: Any
    model: Any
    accelerator: Any
    features: Sequence[Any]
    lengths: list[int]
    counts: list[int]
    collate: Callable[[list[Any]], dict[str, Any]]
    loss_fn: LossFn
    evaluate: Callable[[Any, int, int], Evaluation]
    save: Callable[[Any, Path], None]
    check: Callable[[], Report]
    data_report: dict[str, Any]
    saved: str
    files: dict[str, Any] = field(default_factory=dict)
    jsonl: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    on_epoch: Callable[[dict[str, Any]], None] | None = None
    counters: Any = None
    epoch_batches: Callable[[int], list[list[int]]] | None = None
    rejected: int = 0
    where: Callable[[int], str] | None = None
    # What the doctor and the planner read besides the settings (the model's files, the tokenizer, the encoded
    # examples), as JSON-able content identities, computed only when the cache is on; None: not cacheable (user
    # code, a model not on disk).
    cache_key: Callable[[], dict[str, Any]] | None = None


PrepareFn = Callable[..., Prepared]


def train(cfg: Any, prepare: PrepareFn, say: Say = print) -> dict[str, Any]:
    """Prepare the run, start its folder, run the doctor, plan the memory, train, and save ``final/``.

    Returns:
        ``{"output_dir", "final_dir", "history", "data_report"}``.
    """
    say = on_main(say)  # several processes: the main one reports and writes files, the others wait where needed
    clock = startup.Clock()
    # Before the lock: its file must not be created among the data or in the base model's folder either.
    raise_if(train_problems(cfg), ConfigError)
    with startup.timing(clock), lock_run(cfg, say):  # one run at a time in --output_dir (run_folder.RunLock)
        return _train(cfg, prepare, say, clock)


def _train(cfg: Any, prepare: PrepareFn, say: Say, clock: startup.Clock) -> dict[str, Any]:
    from accelerate.utils import set_seed

    quiet_libraries()
    say_alias_notes(cfg, say)
    cfg = gpu_preset_without_gpu(cfg, say)
    set_seed(cfg.seed)
    # The run folder's problems (a previous run, --resume) are cheap to find: they join the data's in one report.
    early: list[Problem] = []
    previous = check_output_dir(cfg, early)
    resume_from = resume_point(cfg, early, say)
    with clock.phase("prepare (other)"):  # the task names its own phases inside (data, model, ...)
        p = prepare(cfg, say, problems=early, on_rejected=lambda rejects: write_rejected(cfg, rejects, say))
    out = start_output_dir(cfg, previous, say, keep_rejected=p.rejected > 0)
    write_json(out, "data_report.json", p.data_report)
    warn_small_validation(p.data_report, cfg, say)
    for name, value in p.files.items():
        write_json(out, name, value)
    for name, records in p.jsonl.items():
        if records:
            write_jsonl(out / name, records)

    cache = startup_cache.StartupCache(None if getattr(cfg, "no_cache", False) else startup_cache.cache_dir(), say)
    with clock.phase("cache key"):
        key = startup_cache.run_key(cfg, p.cache_key, p.accelerator) if cache.folder is not None else None
    with clock.phase("doctor"):
        gate(run_doctor(lambda: cached_doctor(p.check, key, cache, clock.cache)), cfg, say, out)
    acc = p.accelerator
    plan_args = {k: v for k, v in p.plan.items() if k not in ("collate", "loss_fn")}
    with clock.phase("memory plan"):
        # The planner's measurements (not its choices: the budget is read afresh) are reused for an identical setup.
        memo = startup_cache.planner_memo(cache, key)
        before = json.dumps(memo, sort_keys=True)
        plan = plan_run(cfg, p.model, acc, features=p.features, lengths=p.lengths, counts=p.counts,
                        collate=p.plan.get("collate", p.collate), loss_fn=p.plan.get("loss_fn", p.loss_fn), say=say,
                        out=out, memo=memo, **plan_args)
        reused = bool(before != "{}" and json.dumps(memo, sort_keys=True) == before)
        clock.cache["planner"] = cache.status(key, reused)
        if not reused:
            cache.put("planner", key, memo)
    settings = LoopSettings.from_config(cfg, plan)
    # The schedule the loop builds, for the report's drawing (the same formula, training/schedule.py).
    schedule = settings.schedule(len(p.features))
    write_json(out, "schedule.json", schedule.to_dict())
    with clock.phase("metrics log and trackers"):
        log = open_metrics_log(cfg, out, acc)

    def started(model: Any, batch: dict[str, Any]) -> Any:
        if clock.total is None:  # step 1 begins at the first training forward: the start-up ends here, once
            end_startup(clock, out, say)
        return p.loss_fn(model, batch)

    def evaluate(model: Any, epoch: int | float, step: int | None = None) -> dict[str, Any]:
        # ``step``: an --eval_every evaluation inside an epoch (``epoch`` is then the fractional epoch reached).
        with startup.phase("evaluation before training"):  # epoch 0 (nothing after step 1)
            result = p.evaluate(model, epoch, plan.eval_batch_size)
        if result.records is not None:
            path = predictions_path(out, int(epoch))
            write_jsonl(path if step is None else path.with_name(f"step_{step}.jsonl"), result.records)
            if cfg.log_samples:
                at = step if step is not None else min(int(epoch) * schedule.steps_per_epoch, schedule.total_steps)
                log_samples(out, log, result.records[: cfg.log_samples], epoch, at, say)
        return result.metrics

    evaluates = has_validation(cfg)
    if not evaluates:
        say("no validation data (--val_fraction 0 and no --val_data): training without evaluation; metrics.jsonl "
            "holds the training figures and final/ the last state")

    def export(model: Any, folder: Path) -> None:
        p.save(acc.unwrap_model(model), folder)
        plain_architectures(folder)  # --sharding fsdp: the model's own class, not FSDP<Class>

    checkpointing = Checkpointing(folder=out / "checkpoints", save_every=cfg.save_every, keep=cfg.keep_checkpoints,
                                  export=export, resume_from=resume_from, resume_command=resume_command(cfg))
    clock.begin("loop setup")  # until step 1: the optimizer, accelerate's prepare, the sampler
    try:
        history = fit(p.model, p.features, p.lengths, p.counts, loss_fn=started, collate=p.collate,
                      settings=settings, accelerator=acc, evaluate=evaluate if evaluates else None,
                      checkpointing=checkpointing, log=log, say=say, on_epoch=p.on_epoch, counters=p.counters,
                      epoch_batches=p.epoch_batches, where=p.where)
    finally:
        log.close()
    final = save_final(out, final_model(out, history, lambda d: export(p.model, d), say))
    say(f"saved {p.saved} to {final}")
    write_run_report(out, acc, say)
    return {"output_dir": out, "final_dir": final, "history": history, "data_report": p.data_report}


def end_startup(clock: startup.Clock, out: Path, say: Say) -> None:
    """Stop the start-up clock, write ``OUTPUT/startup.json``, and say where the time went when it was long."""
    if clock.stop() > startup.REPORT_AFTER_S:
        say(clock.line())
    write_json(out, STARTUP, clock.record())  # main process only


def doctor(cfg: Any, prepare: PrepareFn, say: Say = print) -> Report:
    """The doctor's report on the setup ``prepare`` builds, exactly as training would use it; nothing is written."""
    quiet_libraries()
    say_alias_notes(cfg, say)
    cfg = gpu_preset_without_gpu(cfg, say)
    p = prepare(cfg, say)
    report = p.check()
    say(str(report))
    return report


def render_columns(table: list[dict[str, str]]) -> str:
    """The kept / dropped / why table of a run's columns (``columns.json``), as printed before training."""
    width = max(len(r["column"]) for r in table)
    lines = [f"  {'column'.ljust(width)}  kept?    why"]
    lines += [f"  {r['column'].ljust(width)}  {r['status'].ljust(7)}  {r['why']}" for r in table]
    return "\n".join(lines)
