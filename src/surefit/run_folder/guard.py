"""Outputs never overwrite inputs: every command declares what it reads and what it writes, and
:func:`check_outputs` refuses, before anything is loaded or written, an output that resolves (symlinks, ``..`` and
hard links followed) to an input file, into an input folder (the base model, ``final/``, ``checkpoints/``, a data
folder), or into any surefit run's ``final/`` or ``checkpoints/``. Files are then written through
:func:`atomic_file`: a temporary file beside the target, renamed into place, so a failure never leaves a cut file and
a symlink at the target is replaced, never written through.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from surefit.config import TrainConfig
from surefit.errors import ConfigError, Problem, raise_if

# A run folder's folders whose contents only training writes (checkpoint manifests, the final model).
PROTECTED = ("final", "checkpoints")


@dataclass(frozen=True)
class Input:
    """Something a command reads: a file, or a folder whose every file is read (``tree``)."""

    path: Path
    what: str
    tree: bool = False


@dataclass(frozen=True)
class Output:
    """Something a command writes, named by its flag; ``folder``: replaced as a whole (``export --to``)."""

    flag: str
    path: Path
    folder: bool = False


def _real(path: Path) -> Path:
    return Path(os.path.realpath(os.path.abspath(os.path.expanduser(str(path)))))


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or child.is_relative_to(parent)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _tree_files(folder: Path, limit: int = 10_000) -> Iterator[Path]:
    """The files of an input folder (a bounded walk: a data folder of millions of shards is not listed whole)."""
    for n, p in enumerate(folder.rglob("*")):
        if n >= limit:
            return
        if p.is_file():
            yield p


def _protected_run_folder(out: Path) -> Path | None:
    """The ``final/`` or ``checkpoints/`` of a surefit run (a folder holding config.yaml) that ``out`` is inside."""
    for p in [out, *out.parents]:
        if p.name in PROTECTED and (p.parent / "config.yaml").is_file():
            return p
    return None


def conflicts(outputs: Iterable[Output], inputs: Iterable[Input], own_run: Path | None = None) -> list[Problem]:
    """The outputs that would overwrite an input, each as a Problem naming both paths and the fix.

    ``own_run``: the run folder the command itself writes (training), whose ``final/`` and ``checkpoints/`` are
    its outputs.
    """
    inputs = [i for i in inputs if i.path is not None]
    real_inputs = [(_real(i.path), i) for i in inputs]
    problems = []
    for o in outputs:
        if o.path is None:
            continue
        out = _real(o.path)
        hit: tuple[Input, Path] | None = None
        via = "" if out == _abs(o.path) else f" (it resolves to {out})"
        for real, i in real_inputs:
            folder_input = i.tree or real.is_dir()
            if (folder_input and _inside(out, real)) or out == real or (o.folder and _inside(real, out)):
                hit = (i, real)
                break
        if hit is None:
            node = _identity(out)
            if node is not None and os.path.isfile(out) and os.stat(out).st_nlink > 1:  # a hard link to an input?
                for real, i in real_inputs:
                    files = _tree_files(real) if real.is_dir() else [real]
                    same = next((f for f in files if _identity(f) == node), None)
                    if same is not None:
                        hit = (i, real)
                        via = f" (a hard link to {same})"
                        break
        if hit is None:
            run_part = _protected_run_folder(out)
            if run_part is not None and (own_run is None or run_part.parent != _real(own_run)):
                hit = (Input(run_part, f"the {run_part.name}/ folder of the run {run_part.parent}", tree=True), run_part)
        if hit is not None:
            i, real = hit
            at = "is" if out == real else "holds" if _inside(real, out) and out != real else "is inside"
            if "hard link" in via:
                at = "is the same file as one of"
            problems.append(Problem(
                f"{o.flag} {o.path}{via} {at} {i.what} ({i.path}), which this command reads: writing there would "
                "replace it", o.flag, f"pass another path for {o.flag}, outside the inputs (the data, the base model, the "
                "run's final/ and checkpoints/ and the files it reads)"))
    return problems


def _abs(path: Path) -> Path:
    return Path(os.path.abspath(os.path.expanduser(str(path))))


def check_outputs(outputs: Iterable[Output], inputs: Iterable[Input]) -> None:
    """Raise :class:`ConfigError` listing every output that resolves to an input (see :func:`conflicts`), or to
    another output of the same command (the second would replace the first)."""
    outputs = [o for o in outputs if o.path is not None]
    problems = conflicts(outputs, inputs)
    seen: dict[Path, Output] = {}
    for o in outputs:
        first = seen.setdefault(_real(o.path), o)
        if first is not o:
            problems.append(Problem(f"{o.flag} {o.path} and {first.flag} {first.path} are the same file; the second "
                                    "write would replace the first", o.flag, f"pass another path for {o.flag}"))
    raise_if(problems, ConfigError)


# ------------------------------------------------------------------------------------------------------ what is read


def path_of(value: Any) -> Path | None:
    """The file or folder a setting names, if it is on disk: a path, or the module file of ``file.py:function``."""
    if not isinstance(value, str | os.PathLike) or not str(value).strip():
        return None
    text = str(value)
    for candidate in (text, text.rsplit(":", 1)[0] if ":" in text else None):
        if candidate and len(candidate) < 4096:
            try:
                p = Path(candidate).expanduser()
                if p.exists():
                    return p
            except OSError:
                continue
    return None


def config_inputs(cfg: TrainConfig) -> list[Input]:
    """Every file or folder a config's settings name (data, base model, templates, factories ...): a walk over the
    dataclass's fields, so that a setting added later is an input without being listed here."""
    found = []
    here = _real(Path.cwd())
    for f in dataclasses.fields(cfg):
        if f.name in ("output_dir", "resume", "cache_dir"):
            continue  # what the run writes, not what it reads
        value = getattr(cfg, f.name, None)
        for v in value if isinstance(value, list | tuple) else [value]:
            p = path_of(v)
            # "." or a parent of the working folder is not what a setting names to be read whole
            if p is not None and not _inside(here, _real(p)):
                found.append(Input(p, f"--{f.name}", tree=p.is_dir()))
    return found


def run_inputs(folder: Path, cfg: TrainConfig | None = None) -> list[Input]:
    """What a command on a finished run reads: the run folder's records, ``final/``, ``checkpoints/`` and the files
    its config names (data, base model, templates)."""
    from surefit.run_folder import CONFIG, LOCK, RUN_FILES

    named = [Input(folder / name, f"the run's {name}", tree=(folder / name).is_dir() or name in PROTECTED)
             for name in (CONFIG, LOCK, *RUN_FILES)]
    return named + (config_inputs(cfg) if cfg is not None else [])


def train_problems(cfg: TrainConfig) -> list[Problem]:
    """``--output_dir`` and the files a run writes in it, against what the run reads (its data, base model, ...)."""
    from surefit.run_folder import CHECKPOINTS, FINAL, LOCK, PREDICTIONS, RUN_FILES

    if not getattr(cfg, "output_dir", None):
        return []
    out = Path(cfg.output_dir)
    folders = {CHECKPOINTS, FINAL, PREDICTIONS, "tensorboard"}
    outputs = [Output("--output_dir", out / name, folder=name in folders) for name in (LOCK, *RUN_FILES)]
    inside = [i for i in config_inputs(cfg) if i.tree and _inside(_real(out), _real(i.path))]
    problems = [] if inside else conflicts(outputs, config_inputs(cfg), own_run=out)  # inside: said once, below
    problems += [Problem(f"--output_dir {out} is inside {i.what} ({i.path}); the run would write its files among the "
                         "ones it reads", "--output_dir", "pass an --output_dir outside the data and the base model")
                 for i in inside]
    problems += cache_problems(cfg, [Input(out / name, f"the run's {name}", tree=name in folders)
                                     for name in (LOCK, *RUN_FILES)])
    return list({p.what: p for p in problems}.values())


def cache_problems(cfg: TrainConfig, run_files: list[Input]) -> list[Problem]:
    """``--cache_dir`` against what the run reads and the run folder's own files: the caches write (and remove
    damaged entries) under ``startup/`` and ``gguf/`` there, so it may be none of the inputs, inside none of them,
    hold none of them there, and be inside no run's ``final/``, ``checkpoints/`` or other record."""
    if not getattr(cfg, "cache_dir", None):
        return []
    root = Path(str(cfg.cache_dir)).expanduser()
    outputs = [Output("--cache_dir", root), Output("--cache_dir", root / "startup", folder=True),
               Output("--cache_dir", root / "gguf", folder=True)]
    inputs = [*config_inputs(cfg), *run_files]
    for output in outputs:  # the folder itself first: one report per input, not one per subfolder
        found = conflicts([output], inputs)
        if found:
            return found
    return []


# ------------------------------------------------------------------------------------------------------ writing


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` (created exclusively, never through a symlink); on a clean exit it is
    fsynced and renamed onto ``path``, on an error removed: a reader never sees a cut file."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():  # /dev/null, a pipe: written to, never replaced
        with open(path, mode, encoding=None if "b" in mode else encoding) as fh:
            yield fh
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover (or planted) name: never written through
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        from surefit.run_folder import integrity

        if isinstance(e, Exception) and integrity.is_write_failure(e):
            raise integrity.WriteFailed(integrity.write_failure(
                e, f"{path} (left as it was: the new file is written beside it, then renamed)", path.parent)) from e
        raise
