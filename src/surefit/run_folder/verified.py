"""Checkpoints are verified before they are used for anything: ``--keep_best`` copies the best checkpoint's model into
``final/`` only after the checkpoint verifies against its manifest, and ``final/``'s manifest is taken from that
verified manifest (then checked against the copy), never computed afresh over bytes nobody checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from surefit.errors import Problem
from surefit.run_folder import integrity
from surefit.training.checkpoint import CheckpointError
from surefit.training.checkpoint import verify as verify_checkpoint

MODEL = "model"  # the exported model inside an epoch checkpoint (training/checkpoint.py)


def copy_checkpoint_model(checkpoint: Path, dest: Path, what: str = "the best evaluation") -> None:
    """Copy ``checkpoint/model`` to ``dest`` with a manifest derived from the checkpoint's verified one.

    Raises:
        CheckpointError: the checkpoint does not verify (a file changed, cut or missing), or the copy does not match.
    """
    fix = ("the checkpoint's files were changed or damaged after it was written; restore them, or train again "
           "(final/ is not written from unverified weights)")
    reason = verify_checkpoint(checkpoint)
    manifest, problem = integrity.read_manifest(checkpoint)
    if reason is None and manifest is not None:
        files = {name[len(MODEL) + 1:]: meta for name, meta in manifest["files"].items()
                 if name.startswith(f"{MODEL}/")}
        if not files:
            reason = f"its manifest lists no {MODEL}/ files (an epoch checkpoint carries the model)"
    reason = reason or problem
    if reason:
        raise CheckpointError(Problem(f"cannot write final/ from {what}: the checkpoint {checkpoint} does not verify: "
                                      f"{reason}", str(checkpoint), fix))
    shutil.copytree(checkpoint / MODEL, dest)
    (dest / integrity.MANIFEST).write_text(json.dumps({"format": 2, "required": sorted(files), "files": files},
                                                       indent=2), encoding="utf-8")
    reason = integrity.verify(dest)  # the copy, against the verified manifest (a change since the check is caught)
    if reason:
        raise CheckpointError(Problem(f"the copy of {checkpoint / MODEL} for final/ does not match the checkpoint's "
                                      f"manifest: {reason}", str(checkpoint), fix))


def copy_exported_model(checkpoint: Path, dest: Path) -> str | None:
    """``final/`` from the model the last checkpoint exported, when the weights have not changed since: the model is
    serialised once per run. Only ``model/``'s files are copied, with the checkpoint's manifest entries for them,
    and the copy is checked against those (not the optimizer state: nothing of it goes into ``final/``).

    Returns:
        ``None`` when ``dest`` holds the verified copy, else why not (``dest`` is then removed: export afresh).
    """
    manifest, problem = integrity.read_manifest(checkpoint)
    files = {name[len(MODEL) + 1:]: meta for name, meta in (manifest or {}).get("files", {}).items()
             if name.startswith(f"{MODEL}/")}
    reason = problem or (None if files else f"its manifest lists no {MODEL}/ files")
    if reason is None:
        shutil.copytree(checkpoint / MODEL, dest)
        (dest / integrity.MANIFEST).write_text(json.dumps({"format": 2, "required": sorted(files), "files": files},
                                                           indent=2), encoding="utf-8")
        reason = integrity.verify(dest)
    if reason is not None:
        shutil.rmtree(dest, ignore_errors=True)
    return reason
