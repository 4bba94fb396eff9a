"""The start-up cache: the results of work that depends only on content, the doctor's report and the planner's
measurements. An entry is found by the SHA-256 of its key (the model's files, the tokenizer, the encoded examples,
every setting and the versions of the code), so a changed input never finds an old entry. Entries are JSON, never
pickles: a corrupt or edited entry is ignored with a note and recomputed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from importlib.resources import files
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from surefit.config import TrainConfig

# Bumped when an entry's layout changes: older entries then simply miss.
CACHE_FORMAT = 2  # 2: model files keyed by content (sha256), not size and mtime

def digest(value: Any) -> str:
    """SHA-256 of a JSON-able value, independent of dict order."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def features_digest(features: Iterable[Mapping[str, Any]] | None) -> str | None:
    """SHA-256 of encoded examples (dicts of token-id lists or numbers), in order; ``None`` for no examples."""
    if features is None:
        return None
    import numpy as np

    h = hashlib.sha256()
    n = 0
    for item in features:
        n += 1
        for k in sorted(item):
            v = item[k]
            h.update(f"|{k}:".encode())
            try:
                a = np.asarray(v.detach().cpu() if hasattr(v, "detach") else v)
                if a.dtype == object:
                    raise TypeError
                h.update(f"{a.dtype.str}{a.shape}".encode())
                h.update(a.tobytes())
            except (TypeError, ValueError):
                h.update(json.dumps(v, sort_keys=True, default=repr).encode())
        h.update(b"\n")
    return f"{n}:{h.hexdigest()}"


def files_identity(path: str | Path) -> list[list[Any]] | None:
    """Every file under a folder (or the file) as ``[relative name, size, sha256]``; ``None`` if it is not on disk.

    Keyed by content: a file rewritten with the same size and modification time (a changed ``config.json``) is
    another key. The hashes are remembered by :func:`file_sha256`, so gigabytes of weights are read once.
    """
    p = Path(path)
    if p.is_file():
        return [[p.name, p.stat().st_size, file_sha256(p)]]
    if not p.is_dir():
        return None
    out = []
    for f in sorted(p.rglob("*")):
        if f.is_file():
            out.append([str(f.relative_to(p)), f.stat().st_size, file_sha256(f)])
    return out


def _stat_key(st: os.stat_result) -> list[int]:
    # ctime cannot be set back by hand (utime sets mtime, and changes ctime): any rewrite changes this key
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


# Hashes being computed ahead by :func:`hash_ahead`, by (real path, stat key): a reader waits for the one it needs.
_ahead: dict[tuple[str, tuple[int, ...]], Future[str]] = {}
_ahead_lock = threading.Lock()


def hash_ahead(path: str | Path) -> None:
    """Start hashing the files of a model folder (or file) in a background thread, smallest first, remembering them
    as :func:`file_sha256` does; its later calls for these files wait for the result instead of reading them again.

    Why: a cold start-up hashed the model's weights (about 1 s for 500 MB) while nothing else ran. Started when the
    model's folder is known, the reading and hashing (both release the GIL) run on another core while the tokenizer
    and the model load, which are single-threaded Python. Any failure there is left to the caller's own read."""
    p = Path(path)
    try:
        found = [p] if p.is_file() else sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
        jobs = [((os.path.realpath(f), tuple(_stat_key(f.stat()))), f) for f in found]
    except OSError:
        return
    with _ahead_lock:
        jobs = [(key, f) for key, f in jobs if key not in _ahead]
        futures: dict[tuple[str, tuple[int, ...]], Future[str]] = {key: Future() for key, _ in jobs}
        _ahead.update(futures)
    if not jobs:
        return

    memos = cache_dir() / "hashes"  # now: the thread may outlive a change of the environment

    def work() -> None:
        for key, f in jobs:
            fut: Future[str] = futures[key]
            try:
                value = _read_sha256(f, memos)
                if tuple(_stat_key(f.stat())) != key[1]:
                    raise OSError(f"{f} changed while it was hashed")
                fut.set_result(value)
            except BaseException as e:  # noqa: BLE001 - handed to the reader, which reads the file itself
                fut.set_exception(e)

    threading.Thread(target=work, name="surefit-hash-ahead", daemon=True).start()


def file_sha256(path: str | Path, remember: bool = True) -> str:
    """SHA-256 of a file's content, remembered under ``hashes/`` in the start-up cache by the file's device, inode,
    size, modification and change times: a hit is used only while all five still match (else the file is read).
    ``remember=False`` (``--no_cache``): read the file, and store nothing."""
    path = Path(path)
    if remember and _ahead:
        key = (os.path.realpath(path), tuple(_stat_key(path.stat())))
        with _ahead_lock:
            fut = _ahead.pop(key, None)
        if fut is not None:
            try:
                return fut.result()
            except Exception:  # noqa: BLE001 - read it here, where an error reaches the caller
                pass
    return _read_sha256(path, cache_dir() / "hashes" if remember else None)


def _read_sha256(path: Path, memos: Path | None) -> str:
    """:func:`file_sha256`'s work; ``memos``: the folder of remembered hashes, ``None`` to read and store nothing."""
    remember = memos is not None
    st = path.stat()
    memo = (memos or Path()) / f"{digest(os.path.realpath(path))}.json"
    try:
        if not remember:
            raise OSError("not remembered")
        entry = json.loads(memo.read_text(encoding="utf-8"))
        if entry.get("stat") == _stat_key(st) and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    value = h.hexdigest()
    if remember and _stat_key(path.stat()) == _stat_key(st):  # unchanged while it was read
        tmp = memo.with_name(f"{memo.name}.tmp{os.getpid()}.{threading.get_ident()}")  # hash_ahead's thread too
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"stat": _stat_key(st), "sha256": value}), encoding="utf-8")
            os.replace(tmp, memo)
        except OSError:
            with contextlib.suppress(OSError):  # under a file (ENOTDIR) even the unlink fails
                tmp.unlink(missing_ok=True)  # a cache that cannot be written only costs the next read
    return value


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What of a tokenizer is not in its files: the template in force, special tokens, padding side, size."""
    get = lambda name: getattr(tokenizer, name, None)  # noqa: E731
    specials = get("special_tokens_map")
    return {"class": type(tokenizer).__name__, "size": len(tokenizer) if hasattr(tokenizer, "__len__") else None,
            "chat_template": get("chat_template"), "specials": specials if isinstance(specials, dict) else None,
            "pad": get("pad_token_id"), "eos": get("eos_token_id"), "bos": get("bos_token_id"),
            "padding_side": get("padding_side"), "max_length": get("model_max_length")}


def code_identity() -> dict[str, Any]:
    """The code that computed an entry: surefit's own files and the versions of the libraries it calls."""
    import platform

    import torch

    versions: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "peft", "accelerate"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed: not used
            versions[name] = None
    root = Path(str(files("surefit"))).resolve()  # every module of the package, wherever this one sits
    versions["surefit"] = digest([[str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns]
                                  for f in sorted(root.rglob("*.py"))])
    device: dict[str, Any] = {"cuda": torch.cuda.is_available()}
    if device["cuda"]:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        device.update(name=props.name, total=props.total_memory, count=torch.cuda.device_count())
    versions["device"] = device
    return versions


# ------------------------------------------------------------------------------------------------------------ the cache


P = ParamSpec("P")
R = TypeVar("R")
_ROOTS: list[Path] = []  # --cache_dir of the command running in this process (innermost last)


@contextlib.contextmanager
def using_cache_dir(folder: str | os.PathLike[str] | None) -> Iterator[None]:
    """Within the block, :func:`cache_root` is ``folder`` (a command's ``--cache_dir``); ``None`` changes nothing."""
    if folder is None:
        yield
        return
    depth = len(_ROOTS)
    set_cache_dir(folder)
    try:
        yield
    finally:
        del _ROOTS[depth:]


def set_cache_dir(folder: str | os.PathLike[str] | None) -> None:
    """Use ``folder`` as :func:`cache_root` until the enclosing :func:`cache_dir_scope` ends; ``None``: no change."""
    if folder is not None:
        _ROOTS.append(Path(folder).expanduser())


def cache_dir_scope(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: a cache folder set inside ``fn`` (:func:`set_cache_dir`) ends with it."""

    @functools.wraps(fn)
    def scoped(*args: P.args, **kwargs: P.kwargs) -> R:
        depth = len(_ROOTS)
        try:
            return fn(*args, **kwargs)
        finally:
            del _ROOTS[depth:]

    return scoped


def cache_root() -> Path:
    """The folder of surefit's caches: ``--cache_dir`` of the running command, else ``$SUREFIT_CACHE``, else
    ``~/.cache/surefit``."""
    if _ROOTS:
        return _ROOTS[-1]
    return Path(os.environ.get("SUREFIT_CACHE") or Path.home() / ".cache" / "surefit")


def cache_dir() -> Path:
    """The start-up cache: ``startup/`` under ``--cache_dir`` when a command gave it, else ``$SUREFIT_STARTUP_CACHE``
    if set, else ``startup/`` under :func:`cache_root`."""
    if not _ROOTS and os.environ.get("SUREFIT_STARTUP_CACHE"):
        return Path(os.environ["SUREFIT_STARTUP_CACHE"])
    return cache_root() / "startup"


def _not_a_folder(folder: Path) -> str | None:
    """Why ``folder`` cannot hold the cache (it, or a folder above it, is a file), or None."""
    for at in [folder, *folder.parents]:
        if at.exists():
            return None if at.is_dir() else f"{folder} is a file, not a folder" if at == folder else \
                f"{at}, above {folder}, is a file"
    return None


class StartupCache:
    """JSON entries under ``folder/KIND/DIGEST.json``, each holding its key's digest and a checksum of its value.

    Args:
        folder: where entries live; ``None`` turns the cache off (nothing read or written).
        say: where notes go (an ignored entry, a cache that cannot be written).
    """

    def __init__(self, folder: Path | None, say: Callable[[str], None] = print) -> None:
        if folder is not None and _not_a_folder(folder) is not None:
            # A cache is a speed-up: a path that cannot hold one turns it off, with the reason, never the run.
            say(f"note: the start-up cache is off for this run: {_not_a_folder(folder)} (set SUREFIT_STARTUP_CACHE "
                "to a folder, or unset it)")
            folder = None
        self.folder = folder
        self.say = say

    def status(self, key: Any, reused: bool) -> str:
        """What the cache did for one kind of work, in words (``startup.json``'s ``cache``)."""
        if self.folder is None:
            return "off"
        return "not cacheable" if key is None else "reused" if reused else "computed"

    def _path(self, kind: str, key_digest: str) -> Path:
        assert self.folder is not None
        return self.folder / kind / f"{key_digest}.json"

    def entry_path(self, kind: str, key: Any) -> Path | None:
        """Where the entry for ``key`` lives (``None``: the cache is off, or nothing to key on)."""
        if self.folder is None or key is None:
            return None
        return self._path(kind, digest([CACHE_FORMAT, kind, key]))

    def get(self, kind: str, key: Any) -> Any | None:
        """The value stored under ``key``, or ``None`` (absent, off, or an entry that does not check out)."""
        if self.folder is None or key is None:
            return None
        key_digest = digest([CACHE_FORMAT, kind, key])
        path = self._path(kind, key_digest)
        if not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            ok = (isinstance(entry, dict) and entry.get("format") == CACHE_FORMAT and entry.get("key") == key_digest
                  and "value" in entry and entry.get("check") == digest(entry["value"]))
            why = "its contents do not match their checksum or key"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            self.say(f"note: ignored a damaged start-up cache entry {path} ({why}); recomputing it")
            return None
        return entry["value"]

    def put(self, kind: str, key: Any, value: Any) -> None:
        """Store ``value`` (JSON-able) under ``key``, atomically; a cache that cannot be written is only noted."""
        if self.folder is None or key is None:
            return
        key_digest = digest([CACHE_FORMAT, kind, key])
        path = self._path(kind, key_digest)
        entry = {"format": CACHE_FORMAT, "kind": kind, "key": key_digest, "check": digest(value), "value": value}
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry, default=str), encoding="utf-8")
            os.replace(tmp, path)  # a reader sees the whole entry or none
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self.say(f"note: could not write the start-up cache ({path}: {e}); the next run recomputes it")


# Settings that only steer the loop or the bookkeeping: neither the doctor nor the planner reads them, so changing
# one still finds the cached work. Every other setting is part of the key.
NOT_IN_KEY = {"output_dir", "cache_dir", "overwrite", "allow_changed_data", "resume", "force", "no_cache", "log_every", "save_every", "keep_checkpoints",
              "report_to", "log_samples", "profile", "epochs", "max_steps", "lr", "weight_decay", "warmup_ratio", "warmup",
              "min_lr", "lr_scheduler", "max_grad_norm", "eval_every", "early_stopping", "keep_best", "on_nonfinite"}


def run_key(cfg: TrainConfig, inputs: Callable[[], dict[str, Any]] | None, accelerator: Any) -> dict[str, Any] | None:
    """The key of the doctor's and the planner's work: the task's ``inputs()`` (model files, tokenizer, encoded
    examples), the settings they read, the processes and the code; ``None`` when the inputs have no identity."""
    if inputs is None:
        return None
    from dataclasses import asdict

    settings = {k: v for k, v in asdict(cfg).items() if k not in NOT_IN_KEY}
    return {"task": type(cfg).__name__, "inputs": inputs(), "settings": settings,
            "processes": getattr(accelerator, "num_processes", 1), "code": code_identity()}


def planner_memo(cache: StartupCache, key: Any) -> dict[str, Any]:
    """The planner's stored measurements for ``key`` (``training/plan.make_plan``'s ``memo``), or ``{}``.

    An entry of another shape (edited by hand, checksum and all) is ignored with a note."""
    stored = cache.get("planner", key)
    if stored is None:
        return {}
    acts = stored.get("saved_activations") if isinstance(stored, dict) else 0
    probes = stored.get("probes", {}) if isinstance(stored, dict) else 0
    ok = (acts is None or (isinstance(acts, list) and len(acts) == 2 and all(type(v) is int for v in acts))) \
        and isinstance(probes, dict) and all(v is None or type(v) is int for v in probes.values())
    if not ok:
        cache.say("note: ignored a start-up cache entry for the memory planner that is not a measurement; "
                  "recomputing it")
        return {}
    return dict(stored)
