"""A run folder read as data, not trusted: ``eval``, ``predict`` and ``export`` may be given a folder from anywhere.

- The code its config.yaml names (a ``head``, a ``model`` or ``data`` factory, ``trust_remote_code``) only runs when
  the command line allows it (:func:`code_problems`).
- ``final/`` is verified against its manifest; the JSON files read (``data_report.json``, ``memory_plan.json``,
  ``metrics.jsonl``) are checked for what their readers need, and a problem names the file.
- The data files' hashes, stored at the start of training, tell when the data changed since (:func:`changed_data`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from surefit.errors import Problem, SurefitError, raise_if
from surefit.training.integrity import MANIFEST, hash_source, verify

Say = Callable[[str], None]


def code_problems(cfg: Any, config_path: Path, allow_code: bool, trust_remote_code: bool) -> list[Problem]:
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


# What the readers of a run take from its JSON files, and the types they need (None: may be null).
DATA_REPORT_KEYS: dict[str, tuple[type, ...]] = {"problem_type": (str, type(None)), "label2id": (dict, type(None)),
                                                  "fields": (dict, type(None)), "encoding": (dict, type(None))}
PLAN_KEYS: dict[str, tuple[type, ...]] = {"eval_batch_size": (int, type(None)), "precision": (str, type(None)),
                                           "frozen_dtype": (str, type(None))}


def read_json(path: Path, what: str, keys: dict[str, tuple[type, ...]] | None = None) -> dict[str, Any]:
    """A JSON object of the run folder (``{}`` when absent); what is not what the readers expect is named."""
    if not path.is_file():
        return {}
    fix = (f"{path.name} was changed or cut after training; restore it, or delete it (surefit then uses the run's "
           "config.yaml) and check the results")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SurefitError(Problem(f"{path} ({what}) is not valid JSON: {e}", str(path), fix)) from e
    if not isinstance(value, dict):
        raise SurefitError(Problem(f"{path} ({what}) holds a {type(value).__name__}, not a JSON object", str(path),
                                   fix))
    problems = []
    for key, types in (keys or {}).items():
        if key in value and (not isinstance(value[key], types) or isinstance(value[key], bool)):
            problems.append(Problem(f"'{key}' is {value[key]!r} ({type(value[key]).__name__}); expected "
                                    f"{' or '.join(t.__name__ for t in types if t is not type(None))}",
                                    f"{path} '{key}'", fix))
    if "eval_batch_size" in (keys or {}) and isinstance(value.get("eval_batch_size"), int) \
            and value["eval_batch_size"] < 1:
        problems.append(Problem(f"'eval_batch_size' is {value['eval_batch_size']}; expected 1 or more",
                                f"{path} 'eval_batch_size'", fix))
    label2id = value.get("label2id") if keys is DATA_REPORT_KEYS else None
    if isinstance(label2id, dict) and not all(isinstance(v, int) and not isinstance(v, bool)
                                              for v in label2id.values()):
        problems.append(Problem("'label2id' maps labels to something other than class numbers",
                                f"{path} 'label2id'", fix))
    raise_if(problems)
    return value


def data_hashes(cfg: Any) -> dict[str, dict[str, Any]]:
    """sha256 and size of the run's data files (``--data``, ``--val_data``; a folder: all its files), so that
    ``eval`` can warn when the data it re-derives the validation split from has changed since training."""
    out = {}
    for key in ("data", "val_data"):
        value = getattr(cfg, key, None)
        if value:
            found = hash_source(str(value))
            if found is not None:
                out[key] = {"path": str(value), **found}
    return out


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


def changed_data(path: Path, cfg: Any) -> dict[str, tuple[str, str]]:
    """The run's data files whose contents differ from what training read (``path``: its ``data_files.json``)."""
    if not path.is_file():
        return {}
    saved = read_json(path, "the data files' hashes")
    changed = {}
    for key, before in saved.items():
        value = getattr(cfg, key, None)
        if not isinstance(before, dict) or not value:
            continue
        now = hash_source(str(value))
        if now is None:
            continue
        if now["sha256"] != before.get("sha256"):
            changed[key] = (str(value), f"changed ({before.get('bytes')} -> {now['bytes']} bytes, sha256 "
                                        f"{str(before.get('sha256'))[:12]} -> {now['sha256'][:12]})")
    return changed
