"""Checkpoints that survive crashes: atomic, verified by a manifest of checksums, and enough to resume exactly.

A checkpoint folder holds:

- ``trainable.safetensors``: every trainable parameter and every buffer, bit for bit (LoRA: the adapters; full
  fine-tuning: the whole model). This is what resuming loads; it works for any ``nn.Module``.
- ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``: their ``state_dict()``s (loaded with ``weights_only=True``).
- ``rng.pt``: the Python, NumPy, torch and CUDA generator states.
- ``trainer_state.json``: epoch, step within the epoch, global step, the metrics so far, the length of
  ``metrics.jsonl`` when it was written.
- ``model/`` (epoch ends and the final save): the model or adapter in its ecosystem format (safetensors).
- ``manifest.json``: size and sha256 of every file above. Written last; a folder without a valid manifest is not
  a checkpoint.

It is written into a temporary folder, fsynced, then renamed into place, so a reader sees a complete checkpoint or
none; a crash mid-write leaves a ``.tmp`` folder that the next save removes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from surefit.errors import Problem, SurefitError

MANIFEST = "manifest.json"
STATE = "trainer_state.json"


class CheckpointError(SurefitError):
    title = "checkpoint error"


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
        manifest = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        for p in files + [tmp / MANIFEST]:
            _fsync(p)
        if before_commit is not None:
            before_commit(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        _fsync(folder.parent)  # the rename itself must reach the disk
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(folder.parent, say=lambda *_: None)
        keep = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(
            Problem(
                f"could not write checkpoint {folder}: {e.strerror or e} ({type(e).__name__}); {keep}",
                "--output_dir",
                "free disk space or fix the folder's permissions (or pass another --output_dir), then resume with "
                "--resume",
            )
        ) from e
    return folder


# ------------------------------------------------------------------------------------------------------------ load


def verify(folder: Path) -> str | None:
    """``None`` if the checkpoint is complete and unmodified, else what is wrong with it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the write did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return "manifest.json is not valid JSON"
    for name, meta in manifest.items():
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
    """Restore everything :func:`save_checkpoint` wrote (RNG last) and return the trainer state."""
    from safetensors.torch import load_file

    load_trainable_state(model, load_file(folder / "trainable.safetensors"))
    for obj, name in ((optimizer, "optimizer.pt"), (scheduler, "scheduler.pt"), (scaler, "scaler.pt")):
        if obj is not None and (folder / name).is_file():
            obj.load_state_dict(torch.load(folder / name, weights_only=True, map_location="cpu"))
    state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    restore_rng(torch.load(folder / "rng.pt", weights_only=True))
    return state


def prune(checkpoints: Path, keep: int, say: Callable[[str], None] = print, protect: set[str] | None = None) -> None:
    """Remove all but the newest ``keep`` checkpoints (0 keeps all), never those named in ``protect`` (the best
    evaluation's, with ``--keep_best``)."""
    if keep <= 0 or not checkpoints.is_dir():
        return
    done = sorted((p for p in checkpoints.iterdir() if p.is_dir() and not p.name.endswith(".tmp")), key=_global_step)
    for p in done[:-keep]:
        if p.name in (protect or set()):
            continue
        shutil.rmtree(p)
        say(f"removed {p} (--keep_checkpoints {keep})")
