"""Training control around the loop, shared by the three tasks: other tools' names noted, a GPU preset on a machine
without that GPU, training without validation data, a small validation split, logged samples, and which model
``final/`` holds (the last state, or the best evaluation's with ``--keep_best`` / ``--early_stopping``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from surefit.run_folder import predictions_path, write_jsonl
from surefit.training.distributed import is_main_process

Say = Callable[[str], None]


def final_model(out: Path, history: list[dict[str, Any]], export_last: Callable[[Path], None],
                say: Say) -> Callable[[Path], None]:
    """What writes ``final/``: the model as training left it, or, when the run selected the best evaluation, that
    evaluation's model as its checkpoint exported it (said with its metric, value and step)."""
    best = best_evaluation(history)
    if best is None:
        return export_last
    source = out / "checkpoints" / best["best_checkpoint"] / "model"
    say(f"final/ is the best evaluation: {best['best_metric']} {best['best_value']:.4f} at step "
        f"{best['best_step']} (checkpoints/{best['best_checkpoint']})")
    from surefit.run_folder.verified import copy_checkpoint_model

    return lambda folder: copy_checkpoint_model(source.parent, folder)  # verified first; its manifest carried over


SAMPLES = "samples"  # under predictions/: one file per evaluation of the --log_samples rows


def log_samples(out: Path, log: Any, records: list[dict[str, Any]], epoch: int | float, step: int, say: Say) -> None:
    """``--log_samples``: the same first validation rows at every evaluation, as prompt / reference / prediction, to
    ``predictions/samples/step_N.jsonl`` (one file per evaluation, so a resumed run rewrites rather than repeats),
    the trackers' text (TensorBoard) and the printout."""
    samples = [{"step": step, "epoch": epoch, "sample": i, "where": r.get("where"),
                "prompt": r.get("input", r.get("text")), "reference": r.get("gold"), "prediction": r.get("prediction")}
               for i, r in enumerate(records)]
    write_jsonl(predictions_path(out, 0).parent / SAMPLES / f"step_{step}.jsonl", samples)
    if is_main_process() and getattr(log, "trackers", None) is not None:
        log.trackers.log_text({f"samples/{s['sample']}": f"**prompt**: {s['prompt']}\n\n**reference**: "
                               f"{s['reference']}\n\n**prediction**: {s['prediction']}" for s in samples}, step)
    for s in samples:
        say(f"  sample {s['sample']} at step {step}: {str(s['prompt'])[:60]!r} -> {str(s['prediction'])[:80]!r} "
            f"(reference {str(s['reference'])[:60]!r})")


# Below this many validation examples, an evaluation's metrics move in coarse steps (1/N): say so.
SMALL_VALIDATION = 20


def warn_small_validation(data_report: dict[str, Any], cfg: Any, say: Say) -> None:
    """A validation split of fewer than :data:`SMALL_VALIDATION` examples gets a warning that gives the number."""
    encoded = (data_report.get("encoding") or {}).get("validation", {}).get("encoded")
    n = encoded if isinstance(encoded, int) else data_report.get("val_rows")
    if isinstance(n, int) and 0 < n < SMALL_VALIDATION:
        selects = " and --keep_best/--early_stopping would choose on noise" if (cfg.keep_best or cfg.early_stopping) \
            else ""
        say(f"warning: the validation split has only {n} example{'s' if n != 1 else ''} (fewer than "
            f"{SMALL_VALIDATION}): each metric moves in steps of 1/{n}{selects}; give more with --val_fraction or "
            "--val_data")


def gpu_preset_without_gpu(cfg: Any, say: Say) -> Any:
    """A preset made for a GPU (it sets --gpu_memory_gb) on a machine without a CUDA GPU: say that the plan is for a
    GPU this machine does not have, and leave off the preset's gradient checkpointing (on a CPU it only slows
    training down) unless the user asked for it themselves."""
    import dataclasses

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


def has_validation(cfg: Any) -> bool:
    """Whether the run has validation data to evaluate on (``--val_data``, or a ``--val_fraction`` above 0)."""
    return cfg.val_data is not None or cfg.val_fraction > 0


def best_evaluation(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last evaluation record's best-so-far (``best_*`` keys, written with a best-model goal), or ``None``."""
    for record in reversed(history):
        if record.get("best_checkpoint"):
            return record
    return None


def say_alias_notes(cfg: Any, say: Say) -> None:
    """Print once which other tools' setting names were read as which surefit settings (``config.ALIASES``)."""
    for note in dict.fromkeys(getattr(cfg, "alias_notes", None) or []):
        say(note)
