"""Integrity of what a run writes: manifests (size and sha256 of every file, and the files required), and failed
writes named in the user's terms.

A manifest is ``{"format": 2, "required": [...], "files": {name: {"bytes", "sha256"}}}``. Checkpoints carry one
(training/checkpoint.py), and so does ``final/`` (run_folder/__init__.py), so that a missing, cut or changed file is found
before it is used. The first form, a flat ``{name: {"bytes", "sha256"}}``, is still read.

Failed writes: what the libraries really raise when a disk is full is not one type. Python raises ``OSError``,
safetensors ``SafetensorError`` ("I/O error: No space left on device (os error 28)"), and torch.save's zip writer a
``RuntimeError`` ("PytorchStreamWriter failed writing file ..." or "[enforce fail at inline_container.cc] .
unexpected pos ...") that does not say why; the free space then tells.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from surefit.errors import Problem, SurefitError

MANIFEST = "manifest.json"


class WriteFailed(SurefitError):
    """A file of the run could not be written (disk full, quota, file-size limit, permissions)."""

    title = "write failed"


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


# ------------------------------------------------------------------------------------------------------------ manifests


def write_manifest(folder: Path, required: list[str] | None = None,
                   hashed: dict[str, dict[str, Any]] | None = None) -> None:
    """``folder/manifest.json``: every file under ``folder`` with its size and sha256 (``required``: all of them).

    ``hashed``: entries (:func:`file_entry`) already computed by whoever wrote those files (each process hashes its
    own checkpoint shard); every file not in it is hashed here, and an entry for a file not there is refused."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name != MANIFEST)
    known: dict[str, dict[str, Any] | None] = dict(hashed or {})
    entries = {str(p.relative_to(folder)): known.pop(str(p.relative_to(folder)), None) or file_entry(p)
               for p in files}
    if known:
        raise FileNotFoundError(f"{sorted(known)[0]} was hashed by the process that wrote it, but is not in {folder}")
    manifest = {"format": 2, "required": sorted(entries) if required is None else required, "files": entries}
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def file_entry(path: Path) -> dict[str, Any]:
    """A manifest's entry for one file: ``{"bytes", "sha256"}``."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
        files, required = manifest, []  # verify's ``base`` names what every such folder holds
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


def verify(folder: Path, required: tuple[str, ...] = (), base: tuple[str, ...] = ()) -> str | None:
    """``None`` if the folder is complete and unmodified, else what is wrong with it.

    Complete: every file the manifest requires, ``required`` and ``base`` (what every folder of its kind holds) is
    listed and present, and every listed file has its recorded size and sha256.
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




def hash_source(value: str) -> dict[str, Any] | None:
    """``{"sha256", "bytes"}`` of a data file, or of a folder's files (names included); ``None`` when ``value`` is not
    on disk (a dataset factory ``module:make``, a hub name) or cannot be read."""
    path = Path(value)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        return None
    h, size = hashlib.sha256(), 0
    try:
        for p in files:
            if path.is_dir():
                h.update(str(p.relative_to(path)).encode() + b"\0")
            with p.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
                    size += len(chunk)
    except OSError:
        return None
    return {"sha256": h.hexdigest(), "bytes": size}
