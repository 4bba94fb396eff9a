"""Tensor data for ``--task custom``: a folder of shards holding named arrays, read by example with bounded RAM.

A folder holds shards of one format:

- ``.npy``: one array per file, named by the file stem up to the first ``-`` or ``.`` (``labels.npy``,
  ``inputs_embeds-00002.npy``); several files of one name are consecutive shards of that array.
- ``.safetensors``, ``.npz``, ``.pt`` / ``.pth`` (a dict name -> tensor): several named arrays per file; every shard
  holds the same names.

Shards are ordered by file name (digit runs compare as numbers, so ``x-2`` comes before ``x-10``; zero-padded names
sort the same either way) and concatenate along dim 0. Every array must end with the same number of rows N, the
example count.

RAM: ``.npy`` and ``.safetensors`` rows are read with explicit positioned reads (``os.preadv``) straight into the
batch's tensor. Memory mappings are avoided on purpose: pages touched through a mapping stay in the process RSS, which
would grow to the dataset size over an epoch. ``.npz`` and ``.pt`` cannot be read by row, so whole shards are loaded
into an LRU cache kept within ``max_memory_gb`` (GiB, as every ``_gb`` setting: see ``units.py``). With a bound, the data's RAM is the current batch
plus that cache.

Every problem with the folder is collected and raised as one :class:`~surefit.errors.DataError`, each naming the file
and array and the fix. NaN/inf are not checked on open (that is :meth:`TensorData.stats`).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import threading
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from surefit.errors import DataError, Problem, raise_if
from surefit.units import GiB, human_bytes

GB = GiB  # every _gb setting counts GiB (units.py)
# Row chunks for stats(): large enough for few reads, small enough that the temporaries (masks, float copies) of
# one chunk stay a small multiple of it.
STATS_CHUNK_BYTES = 64 * 2**20
# Open shard files kept at once; past this the least recently used is closed (ulimit -n is often 1024).
MAX_OPEN_FILES = 64
# A safetensors header above this is not a header (the safetensors library refuses the same size).
MAX_SAFETENSORS_HEADER = 100 * 2**20
# Problems list at most this many file names before saying "and N more".
MAX_LISTED = 8

_STREAMED = {".npy": "npy", ".safetensors": "safetensors"}
_WHOLE = {".npz": "npz", ".pt": "pt", ".pth": "pt"}
_SHARD_EXTS = {**_STREAMED, **_WHOLE}
_IGNORED_EXTS = {".json", ".md", ".txt"}
_FORMATS = ".npy, .safetensors, .npz or .pt"
_LAYOUT_FIX = (
    "put the data shards in the folder: one .npy per array named after it (inputs_embeds.npy, labels.npy; "
    "inputs_embeds-00001.npy, inputs_embeds-00002.npy for shards), or .safetensors/.npz/.pt shards that each "
    "hold every named array"
)
_RESAVE_FIX = "the file is corrupt or was cut short (an interrupted save or copy?): save or copy it again"

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _code, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):  # newer dtypes: accepted where this torch has them
        _SAFETENSORS_DTYPES[_code] = getattr(torch, _attr)


@dataclass(frozen=True)
class ArrayInfo:
    """One named array of a :class:`TensorData`.

    Attributes:
        name: the array's name (the batch key).
        shape: the full shape; the first dimension is N, summed over all shards.
        dtype: the torch dtype name, e.g. ``"float32"``.
        nbytes: total bytes over all shards.
        files: the shard paths holding it, in order.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    files: list[str]


@dataclass(frozen=True)
class _Piece:
    """The rows of one array held in one shard file."""

    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None  # where row 0 starts in the file; None for shards that are loaded whole
    swap: np.dtype | None = None  # a non-native-endian .npy dtype: bytes are swapped after reading

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def _natural_key(name: str) -> list[Any]:
    # re.split with a capture group alternates text, digits, text...: positions never compare str with int.
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", name)]


def _gb_text(max_memory_gb: float) -> str:
    return f"{max_memory_gb:g}"


class TensorData:
    """A folder of shards holding named arrays; indexable by example.

    Args:
        folder: the shard folder (a single shard file is accepted too).
        max_memory_gb: RAM the data may take, in GiB; ``None``: no bound (loaded shards stay cached).

    Raises:
        DataError: with every problem found in the folder (missing, empty, unknown files, unreadable or truncated
            shards, disagreeing shapes, dtypes or row counts, shards above the bound).
    """

    _pieces: dict[str, list[_Piece]]
    _starts: dict[str, np.ndarray]
    _shard_files: list[str]
    _shard_bytes: list[int]

    def __init__(self, folder: str | os.PathLike, max_memory_gb: float | None = None):
        self._init_state(max_memory_gb)
        self.source = os.fspath(folder)
        problems: list[Problem] = []
        files, kind = _list_shards(Path(self.source), self.source, problems)
        pieces: dict[str, list[_Piece]] = {}
        if kind is not None:
            pieces = _scan_folder(files, kind, self.source, max_memory_gb, problems)
        arrays = _array_infos(pieces)
        n = _check_totals(arrays, pieces, self.source, problems) if arrays else 0
        if arrays and not problems and n == 0:
            problems.append(Problem(f"{self.source} holds 0 examples (every array has 0 rows)", fix=_LAYOUT_FIX))
        raise_if(problems, DataError)
        self._set_arrays(arrays, n)
        self._whole = kind in _WHOLE.values()
        self._pieces = pieces
        self._starts = {name: np.cumsum([0] + [p.rows for p in ps]) for name, ps in pieces.items()}
        if self._whole:
            # Whole-shard formats have the same files and per-shard row counts for every name (checked above).
            first = next(iter(pieces.values()))
            self._shard_files = [p.file for p in first]
            self._shard_starts = self._starts[next(iter(pieces))]
            self._shard_bytes = [sum(ps[i].rows * ps[i].row_bytes for ps in pieces.values()) for i in range(len(first))]

    # ----------------------------------------------------------------------------------------------------------------
    # shared state (also used by the in-memory and Dataset-backed variants)

    def _init_state(self, max_memory_gb: float | None) -> None:
        self.source = ""
        self._max_memory_gb = max_memory_gb
        self._budget = None if max_memory_gb is None else int(max_memory_gb * GB)
        self._whole = False
        self._pieces = {}
        self._starts = {}
        self._shard_files = []
        self._shard_starts = np.zeros(1, dtype=np.int64)
        self._shard_bytes = []
        self._stats: dict[str, dict] = {}
        self._reset_handles()

    def _reset_handles(self) -> None:
        self._lock = threading.RLock()
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._cache: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._cache_bytes = 0
        self.shard_loads = 0  # whole-shard loads so far: shows cache thrashing (see epoch_order)

    def _set_arrays(self, arrays: dict[str, ArrayInfo], n: int) -> None:
        self._arrays = arrays
        self._n = n
        self._row_bytes = {name: (math.prod(a.shape[1:]) * _itemsize(getattr(torch, a.dtype))) for name, a in
                           arrays.items()}

    def __getstate__(self) -> dict:
        # DataLoader workers started by spawn get a pickled copy: open files, locks and loaded shards stay behind.
        state = dict(self.__dict__)
        for key in ("_lock", "_fds", "_cache", "_cache_bytes"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_handles()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: os may already be gone
            pass

    def close(self) -> None:
        """Close the open shard files and drop the loaded shards (reads reopen them as needed)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._cache.clear()
            self._cache_bytes = 0

    # ----------------------------------------------------------------------------------------------------------------
    # public API

    @property
    def arrays(self) -> dict[str, ArrayInfo]:
        """The named arrays, in shard order."""
        return dict(self._arrays)

    @property
    def max_memory_gb(self) -> float | None:
        return self._max_memory_gb

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        names = ", ".join(f"{a.name} {_shape_text(a.shape)} {a.dtype}" for a in self._arrays.values())
        return f"TensorData({self.source!r}: {names})"

    def footprint(self) -> int:
        """Total bytes of all arrays."""
        return sum(a.nbytes for a in self._arrays.values())

    def loaded_shard_bytes(self) -> int:
        """Bytes of the ``.npz``/``.pt`` shards now held in the cache (0 for streamed formats)."""
        return self._cache_bytes

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Read the given examples.

        Args:
            indices: example indices (a list, range, numpy array or tensor); negative ones count from the end.

        Returns:
            name -> tensor ``[len(indices), ...]`` with rows in the order given and the stored dtype. Tensors are fresh
            (never views of a cache), so the caller may modify them.

        Raises:
            IndexError: an index out of range.
            DataError: the batch alone is above ``max_memory_gb``, or a shard changed on disk since it was opened.
        """
        idx = self._indices(indices)
        return self._gather(idx, list(self._arrays))

    def stats(self, name: str, chunk_rows: int | None = None) -> dict:
        """Streaming statistics of one array, reading it in bounded chunks.

        Args:
            name: the array.
            chunk_rows: rows per read; default: 64 MB of rows (a quarter of the bound, if that is smaller).

        Returns:
            ``name``, ``rows``, ``min``, ``max``, ``mean`` (over finite values, for every real dtype; ``None`` when
            there are none or the dtype is complex), ``nan``, ``inf`` (counts of values) and ``first_nan_row``,
            ``first_inf_row``, ``first_bad_row`` (the first example holding a NaN, an inf, either; or ``None``).
        """
        if name not in self._arrays:
            raise KeyError(f"no array {name!r}; arrays: {', '.join(self._arrays)}")
        if chunk_rows is None and name in self._stats:
            return dict(self._stats[name])
        row_bytes = max(1, self._row_bytes[name])
        if chunk_rows is None:
            limit = STATS_CHUNK_BYTES if self._budget is None else min(STATS_CHUNK_BYTES, self._budget // 4)
            chunk_rows = max(1, limit // row_bytes)
        acc = _StatsAccumulator()
        for start in range(0, self._n, chunk_rows):
            stop = min(self._n, start + chunk_rows)
            acc.add(self._gather(np.arange(start, stop, dtype=np.int64), [name])[name], start)
        result = {"name": name, "rows": self._n, **acc.result()}
        self._stats[name] = result
        return dict(result)

    def describe(self) -> str:
        """A table with one line per array: name, shape, dtype, min..max, NaN/inf, footprint (reads every array)."""
        header = ("name", "shape", "dtype", "min..max", "NaN/inf", "footprint")
        rows = [header]
        for name, info in self._arrays.items():
            s = self.stats(name)
            value_range = "-" if s["min"] is None else f"{_num(s['min'])}..{_num(s['max'])}"
            bad = "-"
            if s["nan"] or s["inf"]:
                parts = [f"{s[k]:,} {label} (first row {s['first_' + k + '_row']})" for k, label in
                         (("nan", "NaN"), ("inf", "inf")) if s[k]]
                bad = ", ".join(parts)
            elif info.dtype.startswith(("float", "bfloat", "complex")):
                bad = "0"
            rows.append((name, _shape_text(info.shape), info.dtype, value_range, bad, human_bytes(info.nbytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.append(f"{self._n:,} examples, {human_bytes(self.footprint())} in all")
        return "\n".join(lines)

    @property
    def loads_whole_shards(self) -> bool:
        """Whether reads load whole shards into a bounded cache (``.npz``/``.pt`` under ``max_memory_gb``): then the
        order of the examples decides how often each shard is read (see :meth:`epoch_order`)."""
        return self._whole and self._budget is not None

    def epoch_order(self, seed: int | Sequence[int], among: Sequence[int] | None = None) -> list[int]:
        """A shuffled order of the examples (all, or those in ``among``) that reads well from this data.

        For ``.npz``/``.pt`` shards under a bound, fully random batches would touch every shard and reload each one
        per batch; this order shuffles the shards, then shuffles rows within groups of shards that fit in the cache
        together, so each shard is loaded once per pass. Otherwise it is a plain permutation.
        """
        rng = np.random.default_rng(seed)
        wanted = np.arange(self._n) if among is None else np.asarray(among, dtype=np.int64)
        if not self.loads_whole_shards:
            return rng.permutation(wanted).tolist()
        shard_of = np.searchsorted(self._shard_starts, wanted, side="right") - 1
        order: list[int] = []
        group: list[int] = []
        group_bytes = 0
        assert self._budget is not None  # loads_whole_shards says there is one
        capacity = int(self._budget * 0.9)  # room left for the batch being built
        for s in rng.permutation(len(self._shard_files)).tolist():
            if group and group_bytes + self._shard_bytes[s] > capacity:
                order.extend(rng.permutation(wanted[np.isin(shard_of, group)]).tolist())
                group, group_bytes = [], 0
            group.append(s)
            group_bytes += self._shard_bytes[s]
        order.extend(rng.permutation(wanted[np.isin(shard_of, group)]).tolist())
        return order

    # ----------------------------------------------------------------------------------------------------------------
    # reading

    def _indices(self, indices: Sequence[int]) -> np.ndarray:
        if isinstance(indices, torch.Tensor):
            indices = indices.cpu().numpy()
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        idx = np.where(idx < 0, idx + self._n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            bad = int(idx[(idx < 0) | (idx >= self._n)][0])
            raise IndexError(f"example index {bad} out of range for {self._n:,} examples")
        needed = len(idx) * sum(self._row_bytes.values())
        if self._budget is not None and needed > self._budget:
            fits = self._budget // max(1, sum(self._row_bytes.values()))
            raise DataError(Problem(
                f"a batch of {len(idx):,} examples needs {human_bytes(needed)}, above --max_memory_gb "
                f"{_gb_text(self._max_memory_gb)}",  # type: ignore[arg-type]
                fix=f"use batches of at most {fits:,} examples, or raise --max_memory_gb",
            ))
        return idx

    def _gather(self, idx: np.ndarray, names: list[str]) -> dict[str, torch.Tensor]:
        if self._whole:
            return self._gather_whole(idx, names)
        return {name: self._read_rows(name, idx) for name in names}

    def _read_rows(self, name: str, idx: np.ndarray) -> torch.Tensor:
        pieces, starts = self._pieces[name], self._starts[name]
        info = self._arrays[name]
        row_bytes = self._row_bytes[name]
        out = torch.empty(len(idx) * row_bytes, dtype=torch.uint8)
        if row_bytes and len(idx):
            buf = out.numpy().data
            shard = np.searchsorted(starts, idx, side="right") - 1
            # A run is a stretch of consecutive rows in one shard: one read each.
            breaks = np.flatnonzero((np.diff(idx) != 1) | (np.diff(shard) != 0)) + 1
            run_starts = [0, *breaks.tolist()]
            run_ends = [*breaks.tolist(), len(idx)]
            for a, b in zip(run_starts, run_ends, strict=True):
                piece = pieces[int(shard[a])]
                start = piece.offset + int(idx[a] - starts[shard[a]]) * row_bytes  # type: ignore[operator]
                self._pread(piece, buf[a * row_bytes : b * row_bytes], start)
                if piece.swap is not None:
                    np.frombuffer(buf[a * row_bytes : b * row_bytes], dtype=piece.swap).byteswap(inplace=True)
        return out.view(getattr(torch, info.dtype)).reshape(len(idx), *info.shape[1:])

    def _pread(self, piece: _Piece, view: memoryview, offset: int) -> None:
        fd = self._fd(piece.file)
        while len(view):
            if hasattr(os, "preadv"):
                got = os.preadv(fd, [view], offset)  # positioned: no shared file offset between threads or forks
            else:  # Windows: no pread; the lock keeps seek + read together
                with self._lock:
                    os.lseek(fd, offset, os.SEEK_SET)
                    data = os.read(fd, len(view))
                    got = len(data)
                    view[:got] = data
            if got == 0:
                raise DataError(Problem(
                    f"{Path(piece.file).name} ended early: it is shorter than when it was opened",
                    where=piece.file, fix="the file changed during the run; do not rewrite shards while training"))
            view, offset = view[got:], offset + got

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is not None:
                self._fds.move_to_end(path)
                return fd
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            except OSError as e:
                raise DataError(Problem(f"cannot open {Path(path).name}: {e.strerror}", where=path,
                                        fix="the shard was moved or deleted after it was opened")) from e
            self._fds[path] = fd
            while len(self._fds) > MAX_OPEN_FILES:
                os.close(self._fds.popitem(last=False)[1])
            return fd

    def _gather_whole(self, idx: np.ndarray, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            info = self._arrays[name]
            out[name] = torch.empty((len(idx), *info.shape[1:]), dtype=getattr(torch, info.dtype))
        reserve = sum(t.nbytes for t in out.values())
        shard = np.searchsorted(self._shard_starts, idx, side="right") - 1
        needed = np.unique(shard).tolist()
        # Cached shards first: loading another could otherwise evict one this same batch still needs.
        needed.sort(key=lambda s: s not in self._cache)
        for s in needed:
            tensors = self._load_shard(s, reserve)
            pos = np.flatnonzero(shard == s)
            local = torch.from_numpy(idx[pos] - self._shard_starts[s])
            pos_t = torch.from_numpy(pos)
            for name in names:
                out[name][pos_t] = tensors[name].index_select(0, local)
        return out

    def _load_shard(self, s: int, reserve: int) -> dict[str, torch.Tensor]:
        with self._lock:
            if s in self._cache:
                self._cache.move_to_end(s)
                return self._cache[s]
            need = self._shard_bytes[s]
            if self._budget is not None:
                while self._cache and self._cache_bytes + need + reserve > self._budget:
                    _, dropped = self._cache.popitem(last=False)
                    self._cache_bytes -= sum(t.nbytes for t in dropped.values())
                    del dropped
            path = self._shard_files[s]
            try:
                if path.endswith(".npz"):
                    with np.load(path, allow_pickle=False) as z:
                        tensors = {name: _to_torch(z[name]) for name in self._pieces}
                else:
                    loaded = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
                    tensors = {name: loaded[name] for name in self._pieces}
            except Exception as e:  # noqa: BLE001 - any failure reading the shard is the file's; say which
                raise DataError(Problem(f"cannot read {Path(path).name}: {type(e).__name__}: {e}", where=path,
                                        fix=_RESAVE_FIX)) from e
            self._cache[s] = tensors
            self._cache_bytes += sum(t.nbytes for t in tensors.values())
            self.shard_loads += 1
            return tensors


def _num(x: float | int) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:.4g}"


def _to_torch(a: np.ndarray) -> torch.Tensor:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(a))


class _StatsAccumulator:
    """min / max / mean over finite values, NaN and inf counts with their first rows, over chunks of rows."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.lo: float | int | None = None
        self.hi: float | int | None = None
        self.nan = self.inf = 0
        self.first_nan: int | None = None
        self.first_inf: int | None = None
        self.complex = False

    def add(self, t: torch.Tensor, first_row: int) -> None:
        if t.numel() == 0:
            return
        rows = t.shape[0]
        if t.is_complex():
            self.complex = True
            nan, inf = torch.isnan(t), torch.isinf(t)
            self._bad(nan, inf, rows, first_row)
            return
        if t.dtype == torch.bool:
            t = t.to(torch.uint8)
        if not t.is_floating_point():
            self._extend(int(t.min()), int(t.max()), t.numel(), float(t.sum(dtype=torch.float64)))
            return
        if t.dtype not in (torch.float32, torch.float64):
            t = t.float()  # half, bfloat16, float8: reductions and isnan are reliable in float32
        nan, inf = torch.isnan(t), torch.isinf(t)
        self._bad(nan, inf, rows, first_row)
        finite = ~(nan | inf)
        n = int(finite.sum())
        if n:
            lo = float(torch.where(finite, t, math.inf).min())
            hi = float(torch.where(finite, t, -math.inf).max())
            self._extend(lo, hi, n, float(torch.where(finite, t, 0).sum(dtype=torch.float64)))

    def _bad(self, nan: torch.Tensor, inf: torch.Tensor, rows: int, first_row: int) -> None:
        for mask, kind in ((nan, "nan"), (inf, "inf")):
            k = int(mask.sum())
            if not k:
                continue
            setattr(self, kind, getattr(self, kind) + k)
            if getattr(self, f"first_{kind}") is None:
                row = int(torch.nonzero(mask.reshape(rows, -1).any(dim=1))[0, 0])
                setattr(self, f"first_{kind}", first_row + row)

    def _extend(self, lo: float | int, hi: float | int, n: int, total: float) -> None:
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)
        self.count += n
        self.total += total

    def result(self) -> dict:
        mean = self.total / self.count if self.count and not self.complex else None
        firsts = [r for r in (self.first_nan, self.first_inf) if r is not None]
        return {"min": self.lo, "max": self.hi, "mean": mean, "nan": self.nan, "inf": self.inf,
                "first_nan_row": self.first_nan, "first_inf_row": self.first_inf,
                "first_bad_row": min(firsts) if firsts else None}


# --------------------------------------------------------------------------------------------------------------------
# folder scanning


def _list_shards(p: Path, source: str, problems: list[Problem]) -> tuple[list[Path], str | None]:
    """The shard files of the folder in order, and their format; problems for everything else."""
    if not p.exists():
        parent = p.parent if str(p.parent) else Path(".")
        fix = f"check the path (relative paths are resolved from {os.getcwd()})"
        if not parent.is_dir():
            fix += f"; the folder {parent} does not exist either"
        problems.append(Problem(f"tensor data folder not found: {source}", fix=fix))
        return [], None
    if p.is_file():
        entries = [p]
    else:
        try:
            entries = sorted(p.iterdir(), key=lambda e: _natural_key(e.name))
        except OSError as e:
            problems.append(Problem(f"cannot list {source}: {e.strerror}", fix="check the folder's permissions"))
            return [], None
    visible = [entry for entry in entries if not entry.name.startswith(".")]
    if not visible:
        problems.append(Problem(f"{source} is empty", fix=_LAYOUT_FIX))
        return [], None
    shards, unknown, folders = [], [], []
    for entry in visible:
        ext = entry.suffix.lower()
        if entry.is_dir():
            folders.append(entry.name)
        elif ext in _SHARD_EXTS:
            shards.append(entry)
        elif ext in _IGNORED_EXTS or entry.name.upper().startswith("README"):
            continue  # notes and metadata that travel with exported data
        else:
            unknown.append(entry.name)
    if unknown:
        problems.append(Problem(
            f"unsupported file{'s' if len(unknown) > 1 else ''} {_listing(unknown)}: tensor data folders hold "
            f"{_FORMATS} shards",
            where=source,
            fix="convert them to one of these formats or move them out of the folder (README and *.json, *.md, "
                "*.txt notes are ignored)"))
    if not shards:
        if not unknown:
            found = _listing([f + "/" for f in folders] or [entry.name for entry in visible])
            fix = (f"point at one of its subfolders, e.g. {p / folders[0]}" if folders else _LAYOUT_FIX)
            problems.append(Problem(f"{source} holds no tensor shards ({_FORMATS}); found {found}", fix=fix))
        return [], None
    kinds: dict[str, list[str]] = {}
    for entry in shards:
        kinds.setdefault(_SHARD_EXTS[entry.suffix.lower()], []).append(entry.name)
    if len(kinds) > 1:
        counts = ", ".join(f"{len(v)} .{k} ({_listing(v)})" for k, v in kinds.items())
        problems.append(Problem(f"{source} mixes shard formats: {counts}", where=source,
                                fix="keep one format per folder: re-save the others in it, or move them to another "
                                    "folder"))
        return [], None
    return shards, next(iter(kinds))


def _scan_folder(files: list[Path], kind: str, source: str, max_memory_gb: float | None,
                 problems: list[Problem]) -> dict[str, list[_Piece]]:
    if kind == "npy":
        by_name: dict[str, list[_Piece]] = {}
        for f in files:
            piece = _scan_npy(f, problems)
            if piece is not None:
                by_name.setdefault(_npy_name(f.name), []).append(piece)
        for name, pieces in by_name.items():
            _check_same_layout(name, pieces, problems, source)
        return by_name
    scan = {"safetensors": _scan_safetensors, "npz": _scan_npz, "pt": _scan_pt}[kind]
    shards = [(f, scan(f, problems)) for f in files]
    good = [(f, ps) for f, ps in shards if ps is not None]
    return _combine_multi(good, kind, source, max_memory_gb, problems)


def _npy_name(filename: str) -> str:
    return re.split(r"[-.]", filename, maxsplit=1)[0]


def _check_same_layout(name: str, pieces: list[_Piece], problems: list[Problem], source: str) -> None:
    """Shards of one array need the same trailing dimensions and dtype as its first shard."""
    ref = pieces[0]
    for p in pieces[1:]:
        if p.shape[1:] == ref.shape[1:] and p.dtype == ref.dtype:
            continue
        fname, rname = Path(p.file).name, Path(ref.file).name
        if p.shape[1:] != ref.shape[1:] and p.dtype != ref.dtype:
            mine = f"{_shape_text(p.shape)} {_dtype_name(p.dtype)}"
            theirs = f"{_shape_text(ref.shape)} {_dtype_name(ref.dtype)}"
        elif p.shape[1:] != ref.shape[1:]:
            mine, theirs = _shape_text(p.shape), _shape_text(ref.shape)
        else:
            mine, theirs = _dtype_name(p.dtype), _dtype_name(ref.dtype)
        problems.append(Problem(
            f"{name} shards disagree: {fname} is {mine} but {rname} is {theirs}", where=source,
            fix=f"every shard of {name} needs the same shape after the first dimension and the same dtype; "
                f"re-export {fname}"))


def _combine_multi(good: list[tuple[Path, dict[str, _Piece]]], kind: str, source: str,
                   max_memory_gb: float | None, problems: list[Problem]) -> dict[str, list[_Piece]]:
    names: list[str] = []
    for _, ps in good:
        names.extend(n for n in ps if n not in names)
    holder = {n: next(f.name for f, ps in good if n in ps) for n in names}
    for f, ps in good:
        missing = [n for n in names if n not in ps]
        if missing:
            problems.append(Problem(
                f"{f.name} lacks {', '.join(missing)} (held by {holder[missing[0]]})", where=source,
                fix=f"every shard must hold the same arrays ({', '.join(names)}); re-export {f.name} with all of them"))
        rows = {n: p.rows for n, p in ps.items()}
        if len(set(rows.values())) > 1:
            parts = [f"{n} {r:,} rows" if i == 0 else f"{n} {r:,}" for i, (n, r) in enumerate(rows.items())]
            problems.append(Problem(
                f"{f.name}: {', '.join(parts)} (the arrays of one shard need one row per example each)",
                where=source, fix=f"re-export {f.name} with the same number of rows in every array"))
        if kind in _WHOLE.values() and max_memory_gb is not None:
            size = sum(p.rows * p.row_bytes for p in ps.values())
            if size > max_memory_gb * GB:
                problems.append(Problem(
                    f"shard {f.name} needs {human_bytes(size)}, above --max_memory_gb {_gb_text(max_memory_gb)} "
                    f"(.{kind} shards are loaded whole)", where=source,
                    fix="re-save it as .npy or .safetensors shards to stream it, split it into smaller shards, or "
                        "raise --max_memory_gb"))
    complete = [n for n in names if all(n in ps for _, ps in good)]
    by_name = {n: [ps[n] for _, ps in good] for n in complete}
    for name, pieces in by_name.items():
        _check_same_layout(name, pieces, problems, source)
    return by_name


def _array_infos(pieces: dict[str, list[_Piece]]) -> dict[str, ArrayInfo]:
    out = {}
    for name, ps in pieces.items():
        shape = (sum(p.rows for p in ps), *ps[0].shape[1:])
        out[name] = ArrayInfo(name, shape, _dtype_name(ps[0].dtype), shape[0] * ps[0].row_bytes, [p.file for p in ps])
    return out


def _check_totals(arrays: dict[str, ArrayInfo], pieces: dict[str, list[_Piece]], source: str,
                  problems: list[Problem]) -> int:
    """N, the row count every array must share; one problem naming each array that differs."""
    totals = {name: a.shape[0] for name, a in arrays.items()}
    counts = list(totals.values())
    n = max(counts, key=counts.count)  # the most common count (first array on a tie) is the reference
    odd = [name for name, t in totals.items() if t != n]
    if odd:
        ref = next(name for name, t in totals.items() if t == n)
        others = " and ".join(f"{name} has {totals[name]:,}" for name in odd)
        shards = "; ".join(
            f"{name}: " + _listing([f"{Path(p.file).name} {p.rows:,}" for p in pieces[name]]) for name in [ref, *odd])
        problems.append(Problem(
            f"arrays disagree on the number of examples: {ref} has {n:,} rows but {others} (shards: {shards})",
            where=source,
            fix="every array needs one row per example: re-export them with the same first dimension"))
    return n


@dataclass(frozen=True)
class _Header:
    """What an array's .npy header says (numpy's ``read_array_header_*`` triple)."""

    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype


def _header_piece(name: str, fname: str, path: str, header: _Header, data_bytes: int, offset: int | None,
                  problems: list[Problem], *, streamed: bool) -> _Piece | None:
    """Check one array's .npy header (in a .npy or .npz) and describe it, or add a problem."""
    shape, fortran, dtype = header.shape, header.fortran, header.dtype
    what = f"{name} in {fname}" if fname != name + ".npy" else name
    if dtype.hasobject:
        problems.append(Problem(
            f"{what} has dtype object (Python objects), which cannot be read without pickle", where=path,
            fix="save a numeric array, e.g. np.asarray(x, dtype=np.float32); pad ragged rows to one length"))
        return None
    try:
        torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype
    except (TypeError, ValueError):
        problems.append(Problem(f"{what} has dtype {dtype} with no tensor equivalent", where=path,
                                fix="convert it to a numeric dtype (float32, int64, ...) before saving"))
        return None
    if not shape:
        problems.append(Problem(f"{what} is a scalar (shape []); every array needs a first dimension of examples",
                                where=path, fix="save one row per example: shape [N] or [N, ...]"))
        return None
    if fortran and streamed and len(shape) > 1:
        problems.append(Problem(
            f"{what} is stored in Fortran (column-major) order, so its rows are not contiguous and cannot be streamed",
            where=path, fix="re-save it C-contiguous: np.save(path, np.ascontiguousarray(a))"))
        return None
    need = math.prod(shape) * dtype.itemsize
    if data_bytes < need:
        problems.append(Problem(
            f"{fname} is truncated: its header says {name} {_shape_text(shape)} {dtype.name} needs {need:,} bytes of "
            f"data but the file holds only {max(0, data_bytes):,}", where=path, fix=_RESAVE_FIX))
        return None
    return _Piece(path, tuple(shape), torch_dtype, offset, None if dtype.isnative or dtype.itemsize == 1 else dtype)


def _read_npy_header(f: Any) -> _Header:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return _Header(*np.lib.format.read_array_header_1_0(f))
    if version == (2, 0):
        return _Header(*np.lib.format.read_array_header_2_0(f))
    if version == (3, 0):  # as 2.0 with a UTF-8 header; numpy has no public reader for it
        length = int.from_bytes(f.read(4), "little")
        header = ast.literal_eval(f.read(length).decode("utf-8"))
        return _Header(tuple(header["shape"]), bool(header["fortran_order"]),
                       np.lib.format.descr_to_dtype(header["descr"]))
    raise ValueError(f"unknown .npy format version {version}")


_HEADER_ERRORS = (OSError, ValueError, EOFError, SyntaxError, KeyError, TypeError, UnicodeDecodeError)


def _scan_npy(f: Path, problems: list[Problem]) -> _Piece | None:
    path = str(f)
    name = _npy_name(f.name)
    if not name:
        problems.append(Problem("cannot tell the array name from the file name", where=path,
                                fix="name .npy shards after their array: inputs_embeds.npy or inputs_embeds-00001.npy"))
        return None
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            header = _read_npy_header(fh)
            offset = fh.tell()
    except _HEADER_ERRORS as e:
        problems.append(Problem(f"not a readable .npy file ({type(e).__name__}: {e})", where=path,
                                fix=_RESAVE_FIX + " with numpy.save"))
        return None
    return _header_piece(name, f.name, path, header, size - offset, offset, problems, streamed=True)


def _scan_safetensors(f: Path, problems: list[Problem]) -> dict[str, _Piece] | None:
    path = str(f)

    def corrupt(why: str) -> None:
        problems.append(Problem(f"not a readable .safetensors file: {why}", where=path, fix=_RESAVE_FIX))

    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                corrupt(f"{size} bytes, too short for a header")
                return None
            length = int.from_bytes(head, "little")
            if length > min(size - 8, MAX_SAFETENSORS_HEADER):
                corrupt(f"the header length {length:,} is larger than the file ({size:,} bytes)")
                return None
            header = json.loads(fh.read(length))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        corrupt(f"{type(e).__name__}: {e}")
        return None
    if not isinstance(header, dict):
        corrupt("the header is not a JSON object")
        return None
    data_start = 8 + length
    data_size = size - data_start
    pieces: dict[str, _Piece] = {}
    ok = True
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
            begin, end = int(begin), int(end)
        except (TypeError, KeyError, ValueError):
            corrupt(f"the header entry for {name!r} lacks dtype, shape or data_offsets")
            ok = False
            continue
        dtype = _SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            problems.append(Problem(f"{name} has safetensors dtype {code}, which surefit does not read", where=path,
                                    fix=f"save it as one of {', '.join(_SAFETENSORS_DTYPES)}"))
            ok = False
            continue
        need = math.prod(shape) * _itemsize(dtype)
        if any(d < 0 for d in shape) or begin < 0 or end - begin != need:
            corrupt(f"{name} {_shape_text(shape)} {code} needs {need:,} bytes but data_offsets say {end - begin:,}")
            ok = False
        elif end > data_size:
            problems.append(Problem(
                f"{f.name} is truncated: its header says {name} ends at data byte {end:,} but the file holds "
                f"{max(0, data_size):,} bytes of data", where=path, fix=_RESAVE_FIX))
            ok = False
        elif not shape:
            problems.append(Problem(f"{name} is a scalar (shape []); every array needs a first dimension of examples",
                                    where=path, fix="save one row per example: shape [N] or [N, ...]"))
            ok = False
        else:
            pieces[name] = _Piece(path, shape, dtype, data_start + begin)
    if ok and not pieces:
        corrupt("it holds no tensors")
        return None
    return pieces if ok else None


def _scan_npz(f: Path, problems: list[Problem]) -> dict[str, _Piece] | None:
    path = str(f)
    pieces: dict[str, _Piece] = {}
    ok = True
    try:
        with zipfile.ZipFile(f) as z:
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                name = info.filename[: -len(".npy")]
                with z.open(info) as member:
                    header = _read_npy_header(member)
                    data_bytes = info.file_size - member.tell()  # file_size is the uncompressed size
                piece = _header_piece(name, f.name, path, header, data_bytes, None, problems, streamed=False)
                if piece is None:
                    ok = False
                else:
                    pieces[name] = piece
    except (*_HEADER_ERRORS, zipfile.BadZipFile, zlib.error) as e:
        problems.append(Problem(f"not a readable .npz file ({type(e).__name__}: {e})", where=path,
                                fix=_RESAVE_FIX + " with numpy.savez"))
        return None
    if ok and not pieces:
        problems.append(Problem("the .npz file holds no arrays", where=path, fix=_RESAVE_FIX + " with numpy.savez"))
        return None
    return pieces if ok else None


def _scan_pt(f: Path, problems: list[Problem]) -> dict[str, _Piece] | None:
    path = str(f)
    save_fix = "save a dict of tensors: torch.save({'inputs_embeds': x, 'labels': y}, path)"
    try:
        # mmap: only the structure is read here, not the tensor data; weights_only: never unpickle arbitrary objects.
        obj = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - whatever torch raises, the file is what is wrong
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        fix = _RESAVE_FIX + "; " + save_fix
        if "mmap" in text:
            fix = "re-save it with a current torch.save (the zip format, the default since torch 1.6)"
        elif "weights_only" in str(e) or "Unsupported global" in str(e):
            fix = save_fix + " (tensors only: no custom classes, numpy arrays or other objects)"
        problems.append(Problem(f"cannot be read safely with torch.load(weights_only=True): {type(e).__name__}: "
                                f"{text}", where=path, fix=fix))
        return None
    if not isinstance(obj, Mapping):
        problems.append(Problem(f"holds a {type(obj).__name__}, not a dict of named tensors", where=path, fix=save_fix))
        return None
    pieces: dict[str, _Piece] = {}
    ok = True
    for name, t in obj.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            kind = f"a {t.layout} tensor" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
            problems.append(Problem(f"{name!r} is {kind}, not a dense tensor", where=path, fix=save_fix))
            ok = False
        elif t.dim() == 0:
            problems.append(Problem(f"{name} is a scalar (shape []); every array needs a first dimension of examples",
                                    where=path, fix="save one row per example: shape [N] or [N, ...]"))
            ok = False
        else:
            pieces[name] = _Piece(path, tuple(t.shape), t.dtype, None)
    if ok and not pieces:
        problems.append(Problem("the dict holds no tensors", where=path, fix=save_fix))
        return None
    return pieces if ok else None


# --------------------------------------------------------------------------------------------------------------------
# factories: tensors in memory, or a torch Dataset of dict items


class _MemoryData(TensorData):
    """Named tensors already in memory (a factory returned a dict)."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str, max_memory_gb: float | None):
        self._init_state(max_memory_gb)
        self.source = source
        self._tensors = tensors
        n = next(iter(tensors.values())).shape[0]
        self._set_arrays({k: ArrayInfo(k, tuple(t.shape), _dtype_name(t.dtype), t.nbytes, []) for k, t in
                          tensors.items()}, n)

    def _gather(self, idx: np.ndarray, names: list[str]) -> dict[str, torch.Tensor]:
        index = torch.from_numpy(idx)
        return {name: self._tensors[name].index_select(0, index) for name in names}


class _DatasetData(TensorData):
    """A map-style torch Dataset whose items are dicts of tensors; batches stack items."""

    def __init__(self, dataset: Any, first: Mapping[str, Any], source: str, max_memory_gb: float | None):
        self._init_state(max_memory_gb)
        self.source = source
        self._dataset = dataset
        n = len(dataset)
        arrays = {}
        for k, v in first.items():
            t = torch.as_tensor(v)
            arrays[k] = ArrayInfo(k, (n, *t.shape), _dtype_name(t.dtype), n * t.nbytes, [])  # nbytes: an estimate
        self._set_arrays(arrays, n)

    def _gather(self, idx: np.ndarray, names: list[str]) -> dict[str, torch.Tensor]:
        items = []
        for i in idx.tolist():
            item = self._dataset[i]
            if not isinstance(item, Mapping) or any(name not in item for name in names):
                keys = ", ".join(map(str, item)) if isinstance(item, Mapping) else type(item).__name__
                raise DataError(Problem(f"item {i} of {self.source} is {keys}, expected a dict with {', '.join(names)}",
                                        fix="return the same keys from every __getitem__"))
            items.append(item)
        out = {}
        for name in names:
            try:
                out[name] = torch.stack([torch.as_tensor(item[name]) for item in items])
            except (RuntimeError, TypeError, ValueError) as e:
                raise DataError(Problem(
                    f"cannot stack {name} of items {_listing([str(i) for i in idx.tolist()])} of {self.source}: {e}",
                    fix=f"return {name} with the same shape and dtype from every item (pad it)")) from e
        return out


def load_tensor_data(path: str, max_memory_gb: float | None) -> TensorData:
    """Open tensor data from a folder of shards or a dataset factory.

    Args:
        path: a shard folder (or one shard file), or a factory ``package.module:make`` / ``file.py:make``. The
            factory is called with no arguments and returns a :class:`TensorData`, a dict name -> tensor/ndarray
            (all with the same first dimension), or a map-style torch Dataset whose items are dicts of tensors.
        max_memory_gb: the RAM bound for a shard folder; a factory's in-memory dict above it is refused (it is
            already whole in RAM); a returned TensorData keeps its own bound.

    Raises:
        DataError: the folder's problems, or the factory's import failure, exception or unusable return value, each
            naming ``path``.
    """
    target, sep, attr = path.rpartition(":")
    if os.path.exists(path) or not sep or not target or not attr.isidentifier():
        return TensorData(path, max_memory_gb)
    fix = "pass a shard folder, or a factory 'package.module:make' or 'path/to/file.py:make'"
    from surefit.models import import_user_module  # deferred: models pulls in transformers

    try:
        module = import_user_module(target, prefix="surefit_user_data_")
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module; show its cause
        raise DataError(Problem(f"cannot import {target!r} for the dataset factory {path!r}: {type(e).__name__}: {e}",
                                fix=fix)) from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise DataError(Problem(f"{target!r} has no callable {attr!r} (dataset factory {path!r})",
                                fix=f"callables it defines: {', '.join(public) or 'none'}"))
    try:
        result = factory()
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory failed; show where
        raise DataError(Problem(f"the dataset factory {path!r} raised {type(e).__name__}: {e}",
                                fix="fix the factory; it is called with no arguments")) from e
    return _wrap(result, path, max_memory_gb)


def _wrap(result: Any, path: str, max_memory_gb: float | None) -> TensorData:
    if isinstance(result, TensorData):
        return result
    if isinstance(result, Mapping):
        return _wrap_dict(result, path, max_memory_gb)
    if isinstance(result, torch.utils.data.IterableDataset):
        raise DataError(Problem(f"the dataset factory {path!r} returned an IterableDataset, which cannot be indexed",
                                fix="return a map-style Dataset (__len__ and __getitem__), a dict of tensors, or a "
                                    "TensorData"))
    if hasattr(result, "__getitem__") and hasattr(result, "__len__"):
        if len(result) == 0:
            raise DataError(Problem(f"the dataset factory {path!r} returned an empty dataset"))
        first = result[0]
        if not isinstance(first, Mapping) or not first:
            raise DataError(Problem(
                f"item 0 of the dataset from {path!r} is a {type(first).__name__}, expected a dict name -> tensor",
                fix="return {'inputs_embeds': x, 'labels': y} from __getitem__"))
        return _DatasetData(result, first, path, max_memory_gb)
    raise DataError(Problem(
        f"the dataset factory {path!r} returned a {type(result).__name__}",
        fix="return a TensorData, a dict name -> tensor (all with the same first dimension), or a torch Dataset "
            "whose items are dicts of tensors"))


def _wrap_dict(result: Mapping, path: str, max_memory_gb: float | None) -> TensorData:
    problems: list[Problem] = []
    tensors: dict[str, torch.Tensor] = {}
    where = f"dataset factory {path}"
    for name, v in result.items():
        if isinstance(v, np.ndarray):
            piece = _header_piece(str(name), str(name), where, _Header(v.shape, False, v.dtype), v.nbytes, None,
                                  problems, streamed=False)
            if piece is not None:
                tensors[str(name)] = _to_torch(v)
        elif isinstance(v, torch.Tensor) and v.dim() > 0:
            tensors[str(name)] = v.contiguous()
        else:
            kind = "a scalar tensor" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
            problems.append(Problem(f"{name!r} is {kind}, not an array with a first dimension of examples",
                                    where=where, fix="return tensors or numpy arrays of shape [N, ...]"))
    if not result:
        problems.append(Problem("the factory returned an empty dict", where=where,
                                fix="return {'inputs_embeds': x, 'labels': y}"))
    if tensors:
        pieces = {k: [_Piece(path, tuple(t.shape), t.dtype, None)] for k, t in tensors.items()}
        _check_totals(_array_infos(pieces), pieces, where, problems)
        size = sum(t.nbytes for t in tensors.values())
        if max_memory_gb is not None and size > max_memory_gb * GB:
            problems.append(Problem(
                f"the factory returned {human_bytes(size)} of tensors in memory, above --max_memory_gb "
                f"{_gb_text(max_memory_gb)}", where=where,
                fix="save the arrays as .npy or .safetensors shards and pass the folder (they are streamed), or "
                    "raise --max_memory_gb"))
    raise_if(problems, DataError)
    return _MemoryData(tensors, path, max_memory_gb)
