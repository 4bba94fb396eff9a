"""Checkpoints that survive crashes: atomic, verified by a manifest of checksums, and enough to resume exactly.

A checkpoint folder holds:

- ``trainable.safetensors``: every trainable parameter and every buffer, bit for bit (LoRA: the adapters; full
  fine-tuning: the whole model). This is what resuming loads; it works for any ``nn.Module``.
- ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``: their ``state_dict()``s (loaded with ``weights_only=True``).
- ``rng.pt``: the Python, NumPy, torch and CUDA generator states.
- ``trainer_state.json``: epoch, step within the epoch, global step, the metrics so far, the length of
  ``metrics.jsonl`` when it was written.
- ``model/`` (epoch ends and the final save): the model or adapter in its ecosystem format (safetensors).
- ``sharded/`` instead of ``trainable.safetensors`` and ``optimizer.pt`` under ``--sharding fsdp``: each process's
  shard of the trainable weights, buffers and optimizer state, written by torch.distributed.checkpoint (one
  ``__RANK_0.distcp`` per process and a ``.metadata``); it loads into any number of processes (resharded).
- ``manifest.json``: ``{"format": 2, "required": [...], "files": {name: {"bytes", "sha256"}}}``: the files the
  checkpoint requires to resume (weights, optimizer, scheduler, scaler, RNG, state) and the size and sha256 of every
  file above. Written last; a folder without a valid manifest is not a checkpoint, and one whose required file is
  missing (even with its entry removed from ``files``) does not verify, so it is never resumed with a fresh
  optimizer.

Retention (:func:`prune`) only counts checkpoints that verify, and never removes the one a run resumed from until a
newer one verifies.

It is written into a temporary folder, fsynced, then renamed into place, so a reader sees a complete checkpoint or
none; a crash mid-write leaves a ``.tmp`` folder that the next save removes. A sharded checkpoint is renamed by the
main process once every process has written and fsynced its shard and the manifest covers every shard file.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

import surefit.run_folder.integrity as integrity
from surefit.errors import Problem, SurefitError
from surefit.run_folder.integrity import MANIFEST

STATE = "trainer_state.json"
WEIGHTS = "trainable.safetensors"
RNG = "rng.pt"
# Every checkpoint needs these to resume; optimizer, scheduler and scaler files are required when they were saved.
ALWAYS_REQUIRED = (WEIGHTS, RNG, STATE)
# --sharding fsdp: the weights and optimizer state as torch.distributed.checkpoint shards, one file per process.
SHARDS = "sharded"
SHARDS_METADATA = f"{SHARDS}/.metadata"
SHARDED_REQUIRED = (SHARDS_METADATA, RNG, STATE)


class CheckpointError(SurefitError):
    title = "checkpoint error"


# ------------------------------------------------------------------------------------------------------------ RNG


def capture_rng() -> dict[str, Any]:
    """Every generator whose state decides what happens next (dropout masks, shuffles)."""
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # legacy=True, the default: the Mersenne Twister tuple
    state: dict[str, Any] = {
        "python": random.getstate(),
        # weights_only loading refuses numpy arrays; a tensor of the keys round-trips exactly.
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(_to_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_tuple(x: Any) -> Any:
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ------------------------------------------------------------------------------------------------------------ weights


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters and all buffers (e.g. BatchNorm statistics), detached copies on the CPU."""
    out = {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad}
    out.update({n: b.detach().to("cpu").contiguous() for n, b in model.named_buffers()})
    return out


def load_trainable_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], check_only: bool = False) -> None:
    """Copy ``tensors`` into ``model``'s parameters and buffers of the same names; every trainable parameter must be
    there. ``check_only``: only that check (a sharded model is loaded by ``set_weights``)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    missing = [n for n, p in params.items() if p.requires_grad and n not in tensors]
    if missing:
        raise CheckpointError(
            Problem(
                f"the checkpoint has no weights for {len(missing)} trainable parameters (e.g. {missing[0]})",
                "--resume",
                "resume with the same model and settings the run was started with",
            )
        )
    if check_only:
        return
    with torch.no_grad():
        for name, value in tensors.items():
            target = params.get(name, buffers.get(name))
            if target is not None:
                target.copy_(value.to(target.device, target.dtype))


# ------------------------------------------------------------------------------------------------------------ save


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# trainer_state.json's layout: a newer one is refused by name rather than misread (files without a version are 1).
STATE_VERSION = 1


@dataclass
class TrainerState:
    """Where a run is and what it has seen (``trainer_state.json``), enough to continue it exactly.

    Attributes:
        global_step: optimizer steps taken; position: the loop's progress (epoch, step in it, the epoch's sums).
        history: the evaluation records so far; metrics_bytes: the length of ``metrics.jsonl`` at this point.
        plan: how steps were cut (batch, micro-batch, accumulation, precision, processes, sharding), for the report.
        oom: the out-of-memory guard's splits; counters: the task's epoch counters, summed over processes;
        selection: the best evaluation so far and the early-stopping count.
        micro_step: always 0 (checkpoints are taken between optimizer steps).
    """

    global_step: int
    position: dict[str, Any]
    history: list[dict[str, Any]]
    metrics_bytes: int
    plan: dict[str, Any] = field(default_factory=dict)
    oom: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, int] | None = None
    selection: dict[str, Any] | None = None
    micro_step: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any) -> TrainerState:
        """The state a checkpoint wrote; ``ValueError`` naming what is wrong when it is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("position"), dict):
            raise ValueError("not a trainer state (no 'position')")
        version = data.get("version", 1)
        if version != STATE_VERSION:
            raise ValueError(f"trainer state version {version!r}; this surefit reads version {STATE_VERSION}")
        known = {f.name for f in fields(cls)}
        state = cls(**{k: v for k, v in data.items() if k in known})
        if not isinstance(state.global_step, int) or not isinstance(state.history, list):
            raise ValueError("global_step is not a number or history not a list")
        return state


@dataclass
class States:
    """The training objects a checkpoint saves by ``state_dict()`` besides the weights (``None``: not in this run);
    a sharded checkpoint saves the optimizer's shards instead (:func:`save_sharded_checkpoint`)."""

    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None


def save_checkpoint(folder: str | Path, *, model: torch.nn.Module, states: States | None = None,
                    state: TrainerState | None = None, export: Callable[[Path], None] | None = None,
                    before_commit: Callable[[Path], object] | None = None) -> Path:
    """Write a checkpoint atomically; on a failed write, the previous checkpoints are untouched.

    Args:
        folder: the checkpoint's final path (e.g. ``OUT/checkpoints/step-0000120``).
        model: the model whose trainable state is saved.
        states: the optimizer, scheduler and scaler, saved by ``state_dict()`` when given.
        state: the trainer state (epoch, step, metrics ...).
        export: writes the model in its ecosystem format into the folder it is given (``model/``), or ``None``.
        before_commit: called with the temporary folder just before the rename (tests use it to crash mid-write).

    Raises:
        CheckpointError: the write failed (disk full, permissions); the message names the folder and the cause.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    states = states or States()
    optimizer = states.optimizer
    tmp = folder.with_name(folder.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(trainable_state(model), tmp / "trainable.safetensors")
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        _write_rest(tmp, states, state, export)
        _commit(tmp, folder, [*ALWAYS_REQUIRED, *_saved_states(states, with_optimizer=True)], before_commit)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint is never left behind
        if not integrity.is_write_failure(e):
            raise
        raise _write_error(e, folder, checkpoint_bytes(model, optimizer, export is not None)) from e
    return folder


def _saved_states(states: States, with_optimizer: bool) -> list[str]:
    return [name for obj, name in ((states.optimizer, "optimizer.pt"), (states.scheduler, "scheduler.pt"),
                                   (states.scaler, "scaler.pt")) if obj is not None and (with_optimizer or
                                                                                         name != "optimizer.pt")]


def _write_rest(tmp: Path, states: States, state: TrainerState | None,
                export: Callable[[Path], None] | None) -> None:
    """The files besides the weights and optimizer state: scheduler, scaler, RNG, trainer state, ``model/``."""
    if states.scheduler is not None:
        torch.save(states.scheduler.state_dict(), tmp / "scheduler.pt")
    if states.scaler is not None:
        torch.save(states.scaler.state_dict(), tmp / "scaler.pt")
    torch.save(capture_rng(), tmp / "rng.pt")
    (tmp / STATE).write_text(json.dumps(state.to_json() if state else {}, indent=2), encoding="utf-8")
    if export is not None:
        export(tmp / "model")


def _commit(tmp: Path, folder: Path, required: list[str], before_commit: Callable[[Path], object] | None,
            hashed: dict[str, dict[str, Any]] | None = None) -> None:
    """The manifest (``hashed``: entries already computed), fsync, then the rename that makes the checkpoint exist."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    integrity.write_manifest(tmp, required, hashed)
    for p in files + [tmp / MANIFEST]:
        if str(p.relative_to(tmp)) not in (hashed or {}):  # the processes that wrote those fsynced them
            _fsync(p)
    if before_commit is not None:
        before_commit(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    _fsync(folder.parent)  # the rename itself must reach the disk


def _write_error(e: BaseException, folder: Path, needed: int | None) -> CheckpointError:
    previous = latest_checkpoint(folder.parent, say=lambda *_: None)
    keep = f"; the previous checkpoint {previous} is intact" if previous else "; no earlier checkpoint exists"
    return CheckpointError(integrity.write_failure(e, f"checkpoint {folder}", folder.parent, needed, keep))


def _dcp_failure(e: BaseException) -> BaseException:
    """The first process's own exception inside torch.distributed.checkpoint's ``CheckpointException``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return inner
    return e


def save_sharded_checkpoint(folder: str | Path, *, model: torch.nn.Module, states: States | None = None,
                            state: TrainerState | None = None, export: Callable[[Path], None] | None = None,
                            before_commit: Callable[[Path], object] | None = None) -> Path:
    """:func:`save_checkpoint` for a model sharded with ``--sharding fsdp``; every process calls it (collectives).

    Each process writes its shard of the trainable weights and optimizer state into ``sharded/`` (DCP) and hashes
    it; the main process writes the other files (``state`` and ``export`` are only used there), the manifest
    covering every shard, and renames the folder into place once all of them have written. Only ``model/`` (epoch
    checkpoints) needs the whole weights, gathered on the main process; the optimizer state is never gathered.

    Raises:
        CheckpointError: on every process, when any process's part failed; the previous checkpoints are untouched.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    from surefit.training.distributed import gather_json, gathered, save_sharded
    from surefit.training.processes import is_main_process, sum_over_processes, world_size
    from surefit.training.processes import state as process_state

    folder = Path(folder)
    states = states or States()
    tmp = folder.with_name(folder.name + ".tmp")
    main = is_main_process()
    device = process_state().device if world_size() > 1 else "cpu"
    needed = _sharded_bytes(model, states.optimizer is not None, export is not None)

    def together(error: BaseException | None) -> None:
        """Every process learns whether any process's part failed, and all of them stop if one did."""
        failed = int(sum_over_processes([float(error is not None)], device)[0])
        if not failed:
            return
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint is never left behind
        if error is not None and not integrity.is_write_failure(error):
            raise error
        if error is not None:
            raise _write_error(error, folder, needed) from error
        raise CheckpointError(Problem(
            f"could not write checkpoint {folder}: {failed} other process{'es' if failed > 1 else ''} failed to write "
            "its part (its own message says why)", str(folder.parent),
            "free disk space (or fix the folder's permissions), then resume with --resume; the previous checkpoint "
            "is intact"))

    error: BaseException | None = None
    if main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / SHARDS).mkdir(parents=True)
        except Exception as e:
            error = e
    together(error)
    hashed: dict[str, dict[str, Any]] = {}
    try:
        written = save_sharded(model, states.optimizer, tmp / SHARDS)
        # Each process hashes the shard it wrote (in parallel), the main process gathers the entries.
        mine = {f"{SHARDS}/{name}": integrity.file_entry(tmp / SHARDS / name) for name in written}
        for entries in gather_json(mine):
            hashed.update(entries)
    except CheckpointException as e:  # DCP raises it on every process when any process's write failed
        error = _dcp_failure(e)
    except Exception as e:
        error = e
    together(error)
    if export is not None:
        with gathered(model):  # the exported model/ (epoch ends) needs the whole weights, on the main process only
            if main:
                try:
                    export(tmp / "model")
                except Exception as e:
                    error = e
        together(error)
    if main:
        try:
            _write_rest(tmp, states, state, None)
            shards = sorted(str(p.relative_to(tmp)) for p in (tmp / SHARDS).iterdir() if p.is_file())
            required = dict.fromkeys([*SHARDED_REQUIRED, *shards, *_saved_states(states, with_optimizer=False)])
            _commit(tmp, folder, list(required), before_commit, hashed)
        except Exception as e:
            error = e
    together(error)  # the others return once the checkpoint is complete
    return folder


def _sharded_bytes(model: torch.nn.Module, with_optimizer: bool, with_model: bool) -> int:
    """About what a sharded checkpoint takes on disk, over all processes (AdamW: two fp32 states per value; a
    sharded parameter's ``numel()`` is the whole tensor's)."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    values = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return trainable + (values * 8 if with_optimizer else 0) + (total if with_model else 0) + (1 << 16)


def checkpoint_bytes(model: torch.nn.Module, optimizer: Any = None, with_model: bool = False) -> int:
    """About what a checkpoint takes on disk: the trainable weights, the optimizer's tensors, and the exported model
    (its trainable part: an adapter, or the whole model when everything trains)."""
    weights = sum(t.numel() * t.element_size() for t in trainable_state(model).values())
    states = 0
    if optimizer is not None:
        for per_param in optimizer.state_dict().get("state", {}).values():
            states += sum(v.numel() * v.element_size() for v in per_param.values() if isinstance(v, torch.Tensor))
    return weights * (2 if with_model else 1) + states + (1 << 16)  # RNG, state and manifest files


# ------------------------------------------------------------------------------------------------------------ load


def is_sharded_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds its weights as the shards of a ``--sharding fsdp`` run (``sharded/``), by its files
    or by its manifest (so a checkpoint whose ``sharded/`` was deleted is still judged as one)."""
    folder = Path(folder)
    if (folder / SHARDS).is_dir():
        return True
    manifest, _ = integrity.read_manifest(folder)
    return manifest is not None and SHARDS_METADATA in manifest["required"]


def verify(folder: Path, required: tuple[str, ...] = ()) -> str | None:
    """``None`` if the checkpoint is complete (every file it requires, ``required`` and the weights, RNG and state
    every checkpoint holds) and unmodified, else what is wrong with it.

    A sharded checkpoint requires its shards' metadata and every shard file its manifest lists (a shard's loss is
    named with what it means); its optimizer state is in the shards, so ``optimizer.pt`` is not asked of it."""
    if not is_sharded_checkpoint(folder):
        return integrity.verify(folder, required, ALWAYS_REQUIRED)
    reason = integrity.verify(folder, tuple(r for r in required if r != "optimizer.pt"), SHARDED_REQUIRED)
    reason = reason or _unlisted_shard(Path(folder))
    if reason and reason.startswith(f"{SHARDS}/"):
        reason += (" (a --sharding fsdp checkpoint needs the shard of every process that wrote it, whatever the "
                   "number of processes resuming: the others do not hold that part of the weights and optimizer)")
    return reason


def _unlisted_shard(folder: Path) -> str | None:
    """A shard file the (verified) ``.metadata`` reads from that the manifest does not list, if any: a shard
    deleted together with its manifest entries is found before the collective load, not in it."""
    import pickle

    from surefit.training.distributed import read_dcp_metadata

    manifest, _ = integrity.read_manifest(folder)
    listed = set(manifest["files"]) if manifest else set()
    try:
        metadata = read_dcp_metadata(folder / SHARDS_METADATA)
        paths = {str(getattr(info, "relative_path", "")) for info in (metadata.storage_data or {}).values()}
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        return f"{SHARDS_METADATA} could not be read ({type(e).__name__}: {str(e)[:200]})"
    for path in sorted(paths):
        if f"{SHARDS}/{path}" not in listed:
            return f"{SHARDS}/{path} is missing from the manifest ({SHARDS_METADATA} says it holds part of the state)"
    return None


def _global_step(folder: Path) -> int:
    try:
        return int(json.loads((folder / STATE).read_text(encoding="utf-8")).get("global_step", -1))
    except (OSError, ValueError):
        return -1


def latest_checkpoint(checkpoints: str | Path, say: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint that verifies; each newer one that does not is named with the reason."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return None
    candidates = [p for p in checkpoints.iterdir() if p.is_dir() and not p.name.endswith(".tmp")]
    for folder in sorted(candidates, key=_global_step, reverse=True):
        problem = verify(folder)
        if problem is None:
            return folder
        say(f"checkpoint {folder} is unusable: {problem}; falling back to the previous one")
    return None


@dataclass
class ShardedLoad:
    """How a ``--sharding fsdp`` run takes up a checkpoint (every process calls :func:`load_checkpoint`).

    Attributes:
        set_weights, set_optimizer: load whole tensors and a whole optimizer state (a checkpoint an unsharded run
            wrote, ``trainable.safetensors`` and ``optimizer.pt``): each process keeps its shard of them.
        load_shards: load a sharded checkpoint's ``sharded/`` folder (any number of processes wrote it) into this
            run's shards of the weights and optimizer.
    """

    set_weights: Callable[[dict[str, torch.Tensor]], None]
    set_optimizer: Callable[[dict[str, Any]], None]
    load_shards: Callable[[Path], None]


def load_checkpoint(folder: Path, *, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
                    scaler: Any = None, sharded: ShardedLoad | None = None) -> TrainerState:
    """Restore everything :func:`save_checkpoint` or :func:`save_sharded_checkpoint` wrote (RNG last) and return the
    trainer state.

    ``sharded``: the run's model is sharded (``--sharding fsdp``), see :class:`ShardedLoad`. A sharded checkpoint
    is only taken up by a sharded run (with any number of processes).

    Raises:
        CheckpointError: the checkpoint does not verify, lacks a state that this run has (an optimizer, scheduler or
            scaler: resuming without it would silently start that state afresh), or a file cannot be read.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    wanted = tuple(name for obj, name in ((optimizer, "optimizer.pt"), (scheduler, "scheduler.pt"),
                                          (scaler, "scaler.pt")) if obj is not None)
    reason = verify(folder, required=wanted)
    if reason:
        raise CheckpointError(Problem(f"cannot resume from {folder}: {reason}", "--resume",
                                      "resume from another checkpoint (--resume alone picks the newest usable one), "
                                      "or start the run again"))
    shards = is_sharded_checkpoint(folder)
    if shards and sharded is None:
        raise CheckpointError(Problem(f"cannot resume from {folder}: it holds the weights and optimizer state as the "
                                      "shards of a --sharding fsdp run, and this run is not sharded", "--resume",
                                      "resume with --sharding fsdp (any number of processes), or from a checkpoint "
                                      "of an unsharded run"))
    current = SHARDS if shards else WEIGHTS
    try:
        if shards:
            assert sharded is not None
            try:
                sharded.load_shards(folder / SHARDS)
            except BaseException as e:
                if type(e).__name__ != "CheckpointException":  # torch.distributed.checkpoint's, on every process
                    raise
                raise RuntimeError(str(_dcp_failure(e))) from e
        else:
            tensors = load_file(folder / WEIGHTS)
            load_trainable_state(model, tensors, check_only=sharded is not None)
            if sharded is not None:
                sharded.set_weights(tensors)
        for obj, name in ((optimizer, "optimizer.pt"), (scheduler, "scheduler.pt"), (scaler, "scaler.pt")):
            if obj is not None and not (shards and obj is optimizer):
                current = name
                loaded = torch.load(folder / name, weights_only=True, map_location="cpu")
                (sharded.set_optimizer if obj is optimizer and sharded is not None else obj.load_state_dict)(loaded)
        current = STATE
        state = TrainerState.from_json(json.loads((folder / STATE).read_text(encoding="utf-8")))
        current = RNG
        restore_rng(torch.load(folder / RNG, weights_only=True))
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
        raise CheckpointError(Problem(f"cannot resume from {folder}: {current} could not be read: "
                                      f"{type(e).__name__}: {str(e)[:300]}", "--resume",
                                      "resume from another checkpoint, or start the run again")) from e
    return state


def prune(checkpoints: Path, keep: int, say: Callable[[str], None] = print, protect: Path | None = None,
          keep_names: set[str] | None = None) -> None:
    """Keep the newest ``keep`` checkpoints that verify (0 keeps all); remove the older ones and the unusable ones.

    Only checkpoints that verify count towards ``keep``, and nothing is removed while no checkpoint verifies.
    ``protect`` (the checkpoint the run resumed from) stays until a newer checkpoint verifies; ``keep_names`` (the
    best evaluation's checkpoint, with ``--keep_best``) are never removed.
    """
    if keep <= 0 or not Path(checkpoints).is_dir():
        return
    folders = sorted((p for p in Path(checkpoints).iterdir() if p.is_dir() and not p.name.endswith(".tmp")),
                     key=_global_step, reverse=True)
    verdicts = {p: verify(p) for p in folders}
    usable = [p for p in folders if verdicts[p] is None]
    if not usable:
        return
    kept = set(usable[:keep])
    newest_step = _global_step(usable[0])
    for p in folders:
        if p in kept or p.name in (keep_names or set()):
            continue
        if protect is not None and p.resolve() == Path(protect).resolve() and newest_step <= _global_step(p):
            continue  # the run resumed from it and nothing newer verifies yet
        shutil.rmtree(p)
        if verdicts[p] is None:
            say(f"removed {p} (--keep_checkpoints {keep})")
        else:
            say(f"removed {p}: it is unusable ({verdicts[p]}); {usable[0].name} verifies (--keep_checkpoints {keep})")
