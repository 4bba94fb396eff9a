"""Checkpoints that survive crashes: atomic, verified by a manifest of checksums, and enough to resume exactly.

A checkpoint folder holds:

- ``trainable.safetensors``: every trainable parameter and every buffer, bit for bit (LoRA: the adapters; full
  fine-tuning: the whole model). This is what resuming loads; it works for any ``nn.Module``.
- ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``: their ``state_dict()``s (loaded with ``weights_only=True``).
- ``rng.pt``: the Python, NumPy, torch and CUDA generator states.
- ``trainer_state.json``: epoch, step within the epoch, global step, the metrics so far, the length of
  ``metrics.jsonl`` when it was written.
- ``model/`` (epoch ends and the final save): the model or adapter in its ecosystem format (safetensors).
- ``manifest.json``: ``{"format": 2, "required": [...], "files": {name: {"bytes", "sha256"}}}``: the files the
  checkpoint requires to resume (weights, optimizer, scheduler, scaler, RNG, state) and the size and sha256 of every
  file above. Written last; a folder without a valid manifest is not a checkpoint, and one whose required file is
  missing (even with its entry removed from ``files``) does not verify, so it is never resumed with a fresh
  optimizer.

Retention (:func:`prune`) only counts checkpoints that verify, and never removes the one a run resumed from until a
newer one verifies.

It is written into a temporary folder, fsynced, then renamed into place, so a reader sees a complete checkpoint or
none; a crash mid-write leaves a ``.tmp`` folder that the next save removes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from surefit.errors import Problem, SurefitError

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
WEIGHTS = "trainable.safetensors"
RNG = "rng.pt"
# Every checkpoint needs these to resume; optimizer, scheduler and scaler files are required when they were saved.
ALWAYS_REQUIRED = (WEIGHTS, RNG, STATE)


class CheckpointError(SurefitError):
    title = "checkpoint error"


class WriteFailed(SurefitError):
    """A file of the run could not be written (disk full, quota, file-size limit, permissions)."""

    title = "write failed"


# What the libraries really raise when a write fails: OSError from Python's own writes, SafetensorError from
# safetensors ("I/O error: No space left on device (os error 28)"), and RuntimeError from torch.save's zip writer
# ("PytorchStreamWriter failed writing file ..." or "[enforce fail at inline_container.cc] . unexpected pos ...").
_TORCH_WRITE_FAILURES = ("PytorchStreamWriter", "inline_container", "file write failed", "unexpected pos")
_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file is larger than the file-size limit (ulimit -f)",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def is_write_failure(e: BaseException) -> bool:
    """Whether ``e`` is how torch, safetensors or Python report a failed write (see ``_TORCH_WRITE_FAILURES``)."""
    if isinstance(e, OSError):
        return True
    if type(e).__name__ == "SafetensorError":
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _TORCH_WRITE_FAILURES)


def _errno_of(e: BaseException) -> int | None:
    if isinstance(e, OSError) and e.errno:
        return e.errno
    found = re.search(r"os error (\d+)|\[Errno (\d+)\]", str(e))
    return int(found.group(1) or found.group(2)) if found else None


def write_failure(e: BaseException, what: str, where: Path, needed: int | None = None,
                  after: str = "") -> Problem:
    """A Problem for a failed write: the cause in words (from the error, or the free space when the library does not
    say), the space it needed and the space left, what was kept, and the fix."""
    from surefit.units import human_bytes

    try:
        free = shutil.disk_usage(next(p for p in [Path(where), *Path(where).parents] if p.exists())).free
    except (OSError, StopIteration):
        free = None
    code = _errno_of(e)
    cause = _CAUSES.get(code) if code is not None else None
    if cause is None and free is not None and needed is not None and free < needed:
        cause = "the disk is full"
    if cause is None:  # torch's zip writer does not say why; a file-size limit is the other usual reason
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and (needed is None or limit < needed):
            cause = _CAUSES[errno.EFBIG]
    cause = cause or "the write failed"
    detail = str(e).strip() or type(e).__name__
    space = ""
    if needed is not None:
        space = f"; it needs about {human_bytes(needed)}"
    if free is not None:
        space += f", {human_bytes(free)} is free there"
    return Problem(f"could not write {what}: {cause} ({type(e).__name__}: {detail[:200]}){space}{after}",
                   str(where),
                   "free disk space (or raise the quota or file-size limit, or fix the folder's permissions), or pass "
                   "another --output_dir; then resume with --resume where a checkpoint was kept")


# ------------------------------------------------------------------------------------------------------------ RNG


def capture_rng() -> dict[str, Any]:
    """Every generator whose state decides what happens next (dropout masks, shuffles)."""
    np_state = np.random.get_state()
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


def load_trainable_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
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
    with torch.no_grad():
        for name, value in tensors.items():
            target = params.get(name, buffers.get(name))
            if target is not None:
                target.copy_(value.to(target.device, target.dtype))


# ------------------------------------------------------------------------------------------------------------ save


def write_manifest(folder: Path, required: list[str] | None = None) -> None:
    """``folder/manifest.json``: every file under ``folder`` with its size and sha256 (``required``: all of them)."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    manifest = {"format": 2, "required": sorted(entries) if required is None else required, "files": entries}
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    folder: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    state: dict[str, Any] | None = None,
    export: Callable[[Path], None] | None = None,
    before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Write a checkpoint atomically; on a failed write, the previous checkpoints are untouched.

    Args:
        folder: the checkpoint's final path (e.g. ``OUT/checkpoints/step-0000120``).
        model: the model whose trainable state is saved.
        optimizer, scheduler, scaler: saved by ``state_dict()`` when given.
        state: JSON-serialisable training state (epoch, step, metrics ...).
        export: writes the model in its ecosystem format into the folder it is given (``model/``), or ``None``.
        before_commit: called with the temporary folder just before the rename (tests use it to crash mid-write).

    Raises:
        CheckpointError: the write failed (disk full, permissions); the message names the folder and the cause.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(trainable_state(model), tmp / "trainable.safetensors")
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / "scaler.pt")
        torch.save(capture_rng(), tmp / "rng.pt")
        (tmp / STATE).write_text(json.dumps(state or {}, indent=2), encoding="utf-8")
        if export is not None:
            export(tmp / "model")
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        required = [*ALWAYS_REQUIRED] + [name for obj, name in ((optimizer, "optimizer.pt"),
                                                                (scheduler, "scheduler.pt"), (scaler, "scaler.pt"))
                                         if obj is not None]
        manifest = {"format": 2, "required": required,
                    "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                              for p in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        for p in files + [tmp / MANIFEST]:
            _fsync(p)
        if before_commit is not None:
            before_commit(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        _fsync(folder.parent)  # the rename itself must reach the disk
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint is never left behind
        if not is_write_failure(e):
            raise
        previous = latest_checkpoint(folder.parent, say=lambda *_: None)
        keep = f"; the previous checkpoint {previous} is intact" if previous else "; no earlier checkpoint exists"
        raise CheckpointError(write_failure(e, f"checkpoint {folder}", folder.parent,
                                            checkpoint_bytes(model, optimizer, export is not None), keep)) from e
    return folder


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


def read_manifest(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)``, or ``(None, what is wrong with manifest.json)``. Reads both the current form
    (``format`` 2: ``required`` + ``files``) and the first one (a flat ``{name: {bytes, sha256}}``)."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return None, "no manifest.json (the write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None, "manifest.json is not valid JSON"
    if not isinstance(manifest, dict):
        return None, f"manifest.json holds a {type(manifest).__name__}, not a mapping of files"
    if "files" in manifest or "format" in manifest:
        files, required = manifest.get("files"), manifest.get("required", [])
    else:  # the first form: the files alone; the files every checkpoint needs are required
        files, required = manifest, list(ALWAYS_REQUIRED)
    if not isinstance(files, dict):
        return None, "manifest.json 'files' is not a mapping of file names to sizes and checksums"
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return None, "manifest.json 'required' is not a list of file names"
    for name, meta in files.items():
        if (not isinstance(meta, dict) or not isinstance(meta.get("bytes"), int) or isinstance(meta.get("bytes"), bool)
                or not isinstance(meta.get("sha256"), str)):
            return None, f"manifest.json entry {name!r} is not {{'bytes': int, 'sha256': str}} (got {meta!r})"
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return None, f"manifest.json names a file outside the folder: {name!r}"
    return {"files": files, "required": sorted(set(required))}, None


# (folder, stat signature) -> verify's verdict: retention re-verifies every checkpoint at each save, and hashing
# gigabytes each time would cost more than the save; a file changed since (size or mtime) is hashed again.
_VERIFIED: dict[str, tuple[Any, str | None]] = {}


def _signature(folder: Path) -> Any:
    try:
        return tuple(sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
                            for p in folder.rglob("*") if p.is_file()))
    except OSError:
        return None


def verify(folder: Path, required: tuple[str, ...] = (), base: tuple[str, ...] = ALWAYS_REQUIRED) -> str | None:
    """``None`` if the checkpoint is complete and unmodified, else what is wrong with it.

    Complete: every file the manifest requires, ``required`` and ``base`` (what every checkpoint holds) is listed
    and present, and every listed file has its recorded size and sha256. ``base=()`` verifies any folder with a
    manifest (``final/``).
    """
    folder = Path(folder)
    needed = tuple(sorted(set(required) | set(base)))
    key = f"{folder}|{','.join(needed)}"
    signature = _signature(folder)
    cached = _VERIFIED.get(key)
    if signature is not None and cached is not None and cached[0] == signature:
        return cached[1]
    manifest, problem = read_manifest(folder)
    reason = problem if manifest is None else _check_files(folder, manifest, needed)
    if signature is not None:
        _VERIFIED[key] = (signature, reason)
    return reason


def _check_files(folder: Path, manifest: dict[str, Any], needed: tuple[str, ...]) -> str | None:
    files = manifest["files"]
    for name in sorted(set(manifest["required"]) | set(needed)):
        if name not in files:
            present = "present but " if (folder / name).exists() else ""
            return f"{name} is {present}missing from the manifest (a checkpoint requires it)"
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if _sha256(path) != meta["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
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


def load_checkpoint(folder: Path, *, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
                    scaler: Any = None) -> dict[str, Any]:
    """Restore everything :func:`save_checkpoint` wrote (RNG last) and return the trainer state.

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
    current = "trainable.safetensors"
    try:
        load_trainable_state(model, load_file(folder / WEIGHTS))
        for obj, name in ((optimizer, "optimizer.pt"), (scheduler, "scheduler.pt"), (scaler, "scaler.pt")):
            if obj is not None:
                current = name
                obj.load_state_dict(torch.load(folder / name, weights_only=True, map_location="cpu"))
        current = STATE
        state = json.loads((folder / STATE).read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("position"), dict):
            raise ValueError("not a trainer state (no 'position')")
        current = RNG
        restore_rng(torch.load(folder / RNG, weights_only=True))
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
        raise CheckpointError(Problem(f"cannot resume from {folder}: {current} could not be read: "
                                      f"{type(e).__name__}: {str(e)[:300]}", "--resume",
                                      "resume from another checkpoint, or start the run again")) from e
    return state


def prune(checkpoints: Path, keep: int, say: Callable[[str], None] = print, protect: Path | None = None) -> None:
    """Keep the newest ``keep`` checkpoints that verify (0 keeps all); remove the older ones and the unusable ones.

    Only checkpoints that verify count towards ``keep``, and nothing is removed while no checkpoint verifies.
    ``protect`` (the checkpoint the run resumed from) stays until a newer checkpoint verifies.
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
        if p in kept:
            continue
        if protect is not None and p.resolve() == Path(protect).resolve() and newest_step <= _global_step(p):
            continue  # the run resumed from it and nothing newer verifies yet
        shutil.rmtree(p)
        if verdicts[p] is None:
            say(f"removed {p} (--keep_checkpoints {keep})")
        else:
            say(f"removed {p}: it is unusable ({verdicts[p]}); {usable[0].name} verifies (--keep_checkpoints {keep})")
