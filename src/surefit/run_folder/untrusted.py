"""A run folder read as data, not trusted: ``eval``, ``predict`` and ``export`` may be given a folder from anywhere.

- The code its config.yaml names (a ``head``, a ``model`` or ``data`` factory, ``trust_remote_code``) only runs when
  the command line allows it (:func:`code_problems`).
- ``final/`` is verified against its manifest; the JSON files read (``data_report.json``, ``memory_plan.json``,
  ``metrics.jsonl``) are checked for what their readers need, and a problem names the file.
- The data files' hashes, stored at the start of training, tell when the data changed since (:func:`changed_data`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from surefit.config import TrainConfig
from surefit.data.summary import Saved, saved_object
from surefit.errors import Problem, SurefitError, raise_if
from surefit.run_folder.integrity import MANIFEST, hash_source, verify

Say = Callable[[str], None]


def code_problems(cfg: TrainConfig, config_path: Path, allow_code: bool, trust_remote_code: bool) -> list[Problem]:
    """The settings of a run's config.yaml that would import or run code, unless this command line allows it (the
    one table and gate: run_folder/code_gate.py)."""
    from surefit.run_folder.code_gate import code_problems as gate

    return gate(cfg, lambda key: f"{config_path} '{key}'", allow_code, trust_remote_code)


def verify_final(final: Path, say: Say) -> None:
    """``final/manifest.json`` must match ``final/``: corrupt or changed weights are refused, not scored."""
    if not (final / MANIFEST).is_file():
        say(f"warning: {final} has no {MANIFEST} (written before surefit kept one, or removed): its files cannot be "
            "checked for corruption")
        return
    reason = verify(final, base=())
    if reason:
        raise SurefitError(Problem(f"{final} does not match its manifest: {reason}", str(final / MANIFEST),
                                   "the saved model was changed or damaged after training; train the run again, or "
                                   "finish it from a checkpoint (surefit train --config RUN/config.yaml --resume)"))


@dataclass(frozen=True)
class SavedPlan:
    """What ``eval``, ``predict`` and ``export`` take from ``memory_plan.json`` (``training/plan.Plan`` wrote it):
    the evaluation batch, the precision and the frozen weights' dtype training used; ``None`` where it says nothing
    (no plan: the run's config.yaml settings apply)."""

    eval_batch_size: int | None = None
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    frozen_dtype: Literal["bf16", "fp16"] | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, value: Any, where: str) -> SavedPlan:
        """Read and check the plan (every value not what training writes is named, with the file and key)."""
        saved = saved_object(value, where, "the memory plan")
        batch, precision, frozen = (saved.get("eval_batch_size", int), saved.get("precision", str),
                                    saved.get("frozen_dtype", str))
        if batch is not None and batch < 1:
            saved.wrong("eval_batch_size", batch, "1 or more")
            batch = None
        if precision is not None and precision not in ("fp32", "bf16", "fp16"):
            saved.wrong("precision", precision, "fp32, bf16 or fp16")
        if frozen is not None and frozen not in ("bf16", "fp16"):
            saved.wrong("frozen_dtype", frozen, "bf16, fp16 or null")
        raise_if(saved.problems)
        return cls(batch, precision, frozen)


def read_json(path: Path, what: str) -> Any:
    """A JSON file of the run folder, parsed (``{}`` when absent); a file that is not JSON is named."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SurefitError(Problem(f"{path} ({what}) is not valid JSON: {e}", str(path),
                                   Saved({}, str(path)).fix())) from e


def data_hashes(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """sha256 and size of everything the run reads from disk, stored at the start of training (``data_files.json``)
    so that ``--resume``, ``eval``, ``predict`` and ``export`` can name what changed since: ``--data`` and
    ``--val_data`` (a folder: all its files, hashed together), and every other setting that names a file or folder
    (the base model's weights, config and tokenizer files, a chat template ...), file by file."""
    import dataclasses

    out = {}
    for key in ("data", "val_data"):
        value = getattr(cfg, key, None)
        if value:
            found = hash_source(str(value))
            if found is not None:
                out[key] = {"path": str(value), **found}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name, None)
        if f.name in out or f.name in _NOT_INPUTS or not isinstance(value, str) or not value:
            continue
        files = _file_hashes(value, remember=not getattr(cfg, "no_cache", False))
        if files:
            out[f.name] = {"path": value, "files": files}
    return out


# Settings that name paths the run writes (or reads as data, hashed above), not files it depends on.
_NOT_INPUTS = {"output_dir", "resume", "cache_dir", "data", "val_data"}


def _file_hashes(value: str, limit: int = 10_000, remember: bool = True) -> dict[str, dict[str, Any]] | None:
    """``{relative name: {bytes, sha256}}`` of a file, or of a folder's files; ``None`` when ``value`` is no path
    (a hub id, a built-in name) or the folder is the working folder or holds more than ``limit`` files."""
    from surefit.startup.cache import file_sha256

    try:
        path = Path(value).expanduser()
        if not path.exists() or Path.cwd().resolve().is_relative_to(path.resolve()):
            return None
        # a run's lock file is not an input (a run refused before its checks once left one in a model folder)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                     and p.name != ".surefit.lock")
        if len(files) > limit:
            return None
        return {(p.name if p == path else str(p.relative_to(path))): {"bytes": p.stat().st_size,
                                                                      "sha256": file_sha256(p, remember)}
                for p in files}
    except (OSError, ValueError):
        return None


def check_inputs_on_resume(cfg: TrainConfig, saved: Path, problems: list[Problem], say: Say) -> None:
    """``--resume``: the run's data and other input files must be what the run started with, or
    ``--allow_changed_data`` given; then each change is listed, and recorded in ``data_files.json``."""
    changed = changed_data(saved, cfg)
    if not changed:
        return
    if not getattr(cfg, "allow_changed_data", False):
        for key, (path, why) in changed.items():
            problems.append(Problem(f"--{key} {path} {why} since the run started ({saved}); resuming would continue the "
                                    "run on other inputs than it started with", f"--{key}",
                                    "restore the file(s), start a new run (--overwrite or another --output_dir), or "
                                    "pass --allow_changed_data to resume on the changed inputs"))
        return
    for key, (path, why) in changed.items():
        say(f"--allow_changed_data: resuming although --{key} {path} {why} since the run started")
    import time

    record = json.loads(saved.read_text(encoding="utf-8"))
    record.setdefault("resumed_with_changes", []).append(
        {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "changed": {k: f"{p} {w}" for k, (p, w) in changed.items()}})
    tmp = saved.with_name(f".{saved.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    tmp.replace(saved)


# The keys of an epoch record that hold text: the record's type and, with --keep_best / --early_stopping, the metric
# and checkpoint of the best evaluation (training/selection.py). Every other figure is a number.
EPOCH_TEXT_KEYS = frozenset({"type", "best_metric", "best_checkpoint"})


def last_epoch(path: Path) -> dict[str, Any] | None:
    """The last epoch record of ``metrics.jsonl``; a record whose figures are not numbers is named, not used."""
    if not path.is_file():
        return None
    last = None
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue  # the last line cut by a crash; the run's metrics are read for comparison only
            raise SurefitError(Problem(f"line {number} is not valid JSON: {line[:80]!r}", f"{path} line {number}",
                                       "metrics.jsonl was changed after training; restore it or remove that line")) from None
        if isinstance(record, dict) and record.get("type") == "epoch":
            wrong = {k: v for k, v in record.items() if k not in EPOCH_TEXT_KEYS and isinstance(v, str)}
            if wrong:
                key, value = next(iter(wrong.items()))
                raise SurefitError(Problem(f"'{key}' is {value!r}, not a number (an epoch record holds numbers)",
                                           f"{path} line {number}",
                                           "metrics.jsonl was changed after training; restore it or fix that line"))
            last = record
    return last


def changed_data(path: Path, cfg: TrainConfig) -> dict[str, tuple[str, str]]:
    """The run's data files whose contents differ from what training read (``path``: its ``data_files.json``)."""
    if not path.is_file():
        return {}
    saved = saved_object(read_json(path, "the data files' hashes"), str(path), "the data files' hashes").value
    changed = {}
    for key, before in saved.items():
        value = getattr(cfg, key, None)
        if not isinstance(before, dict) or not value:
            continue
        if isinstance(before.get("files"), dict):  # file by file: name the files that changed
            now_files = _file_hashes(str(value))
            if now_files is None:
                continue
            names = sorted(n for n in set(before["files"]) | set(now_files)
                           if (before["files"].get(n) or {}).get("sha256") != (now_files.get(n) or {}).get("sha256"))
            if names:
                shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                changed[key] = (str(value), f"changed ({shown})")
            continue
        now = hash_source(str(value))
        if now is None:
            continue
        if now["sha256"] != before.get("sha256"):
            changed[key] = (str(value), f"changed ({before.get('bytes')} -> {now['bytes']} bytes, sha256 "
                                        f"{str(before.get('sha256'))[:12]} -> {now['sha256'][:12]})")
    return changed
