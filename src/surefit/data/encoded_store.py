"""Encoded examples on disk: encode a data file once, read its examples by position in every later run.

A store is a folder of flat little-endian arrays, one set per split: every example's ``input_ids`` concatenated into
one int32 file, its ``labels`` into another, the offsets (int64, one more than the examples), the prompt lengths and
supervised-token counts (int32), the source row's index (int64) and its location in words (UTF-8, with offsets).
``header.json`` holds the key, the counts, each file's size and CRC-32, and the run's record of what reading and
encoding did (:class:`StoreRecord`, so a hit reports exactly what the miss reported). No pickle anywhere: numbers are
raw arrays, the rest JSON.

The folder of a key is ``encoded/DATA_DIGEST/KEY_DIGEST/``: ``DATA_DIGEST`` is the data files' content alone (so a
run on new data knows it misses before loading a tokenizer), ``KEY_DIGEST`` adds the tokenizer, the template and
every reading and encoding setting. Content, not time stamps: a file rewritten with the same size and mtime is another key.

RAM: rows are read with positioned reads (``os.preadv``) into a fresh buffer, as :mod:`surefit.data.shards` does and
for the same reason: pages touched through a memory mapping stay in the process RSS, which would grow to the size of
the data over an epoch. What stays in memory per example is its length and supervised count (4 bytes each).

A store is written under a temporary name and renamed into place whole. The first open checks every file's CRC-32
against the header and saves a CRC-32 per 64 KiB chunk (``chunks.json``); later opens check the header and the sizes
only (constant time), and every chunk is checked the first time a read touches it. A store that does not check out
at open is removed and rebuilt, with a note saying why; a chunk found damaged on read stops the run with a
:class:`~surefit.errors.DataError` and marks the store, which the next open then removes and rebuilds.

Where: ``encoded/`` in the start-up cache (``--cache_dir``, else ``$SUREFIT_STARTUP_CACHE``, else
``$SUREFIT_CACHE/startup``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

import surefit.startup as startup
from surefit.data.readers import Rejected
from surefit.data.rows import Row
from surefit.data.summary import DataSummary, Saved, TaskFacts, TextFacts
from surefit.errors import DataError, Problem, SurefitError, raise_if
from surefit.startup.cache import cache_dir, digest

# Bumped when the layout changes: older stores then simply miss.
STORE_FORMAT = 2  # 2: the record is a versioned StoreRecord
HEADER = "header.json"
# name -> (dtype, per example: True for one value a row, False for concatenated tokens)
COLUMNS: dict[str, str] = {"input_ids": "<i4", "labels": "<i4", "offsets": "<i8", "prompt_len": "<i4",
                           "supervised": "<i4", "source": "<i8", "where": "|u1", "where_offsets": "<i8"}
_CHUNK = 1 << 22  # bytes per read while checking a file's CRC-32 (a multiple of CHECK_BYTES: chunks never straddle)
_SLICE = 1 << 16  # examples per read of the offsets at open


def store_root() -> Path:
    """``encoded/`` in the start-up cache folder (moved by ``$SUREFIT_STARTUP_CACHE`` or ``$SUREFIT_CACHE``)."""
    return cache_dir() / "encoded"


@dataclass
class SplitArrays:
    """One split's encoded examples as flat arrays, in example order (what a writer appends, chunk by chunk)."""

    input_ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    prompt_len: np.ndarray
    supervised: np.ndarray
    source: np.ndarray
    where: list[str]
    # Arrays a task keeps beside the tokens (classify: its label, its token_type_ids), by name: per example (the first
    # dimension is the examples: a class id, a multi-hot row) or per token (one value a token, aligned with input_ids).
    per_example: dict[str, np.ndarray] = field(default_factory=dict)
    per_token: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, examples: Sequence[Any]) -> SplitArrays:
        """Arrays of :class:`~surefit.data.encode.Example` objects (``input_ids``, ``labels``, ``prompt_len``,
        ``row``)."""
        lengths = np.fromiter((len(e.input_ids) for e in examples), dtype=np.int64, count=len(examples))
        flat = lambda name: np.fromiter((t for e in examples for t in getattr(e, name)),  # noqa: E731
                                        dtype=np.int32, count=int(lengths.sum()))
        return cls(input_ids=flat("input_ids"), labels=flat("labels"), lengths=lengths,
                   prompt_len=np.array([e.prompt_len for e in examples], dtype=np.int32),
                   supervised=np.array([e.num_supervised for e in examples], dtype=np.int32),
                   source=np.array([e.row.index for e in examples], dtype=np.int64),
                   where=[e.row.where for e in examples])


class _File:
    """An append-only file with its running CRC-32 and size."""

    def __init__(self, path: Path) -> None:
        self.path, self.fh, self.crc, self.size = path, path.open("wb"), 0, 0

    def write(self, data: bytes | memoryview) -> None:
        self.fh.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)


class StoreWriter:
    """Writes a store under a temporary name; :meth:`commit` renames it into place (or discards it on a failure).

    Args:
        folder: the store's final folder (``store_root()/DATA_DIGEST/KEY_DIGEST``).
        key: the full key (JSON-able), saved in the header and compared on open.
    """

    def __init__(self, folder: Path, key: Any) -> None:
        self.folder, self.key = folder, key
        self.tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.files: dict[str, _File] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.extra: dict[str, dict[str, Any]] = {}  # file name -> dtype and per-example shape (SplitArrays' extras)

    def _file(self, split: str, column: str) -> _File:
        name = f"{split}.{column}"
        if name not in self.files:
            self.files[name] = _File(self.tmp / name)
            if column in ("offsets", "where_offsets"):
                self.files[name].write(np.zeros(1, dtype=COLUMNS[column]).tobytes())  # the first offset, 0
        return self.files[name]

    def add(self, split: str, arrays: SplitArrays) -> None:
        """Append a chunk of examples to ``split`` (chunks in example order)."""
        c = self.counts.setdefault(split, {"examples": 0, "tokens": 0, "where_bytes": 0})
        for column in ("input_ids", "labels", "prompt_len", "supervised", "source"):
            self._file(split, column).write(np.ascontiguousarray(getattr(arrays, column), dtype=COLUMNS[column])
                                            .tobytes())
        ends = c["tokens"] + np.cumsum(arrays.lengths, dtype=np.int64)
        self._file(split, "offsets").write(ends.astype("<i8").tobytes())
        where = [w.encode("utf-8") for w in arrays.where]
        self._file(split, "where").write(b"".join(where))
        wends = c["where_bytes"] + np.cumsum(np.array([len(w) for w in where], dtype=np.int64), dtype=np.int64)
        self._file(split, "where_offsets").write(wends.astype("<i8").tobytes())
        self._add_extra(split, arrays)
        c["examples"] += len(arrays.lengths)
        c["tokens"] += int(arrays.lengths.sum())
        c["where_bytes"] += sum(len(w) for w in where)

    def _add_extra(self, split: str, arrays: SplitArrays) -> None:
        """Append the chunk's per-example and per-token arrays (``SPLIT.example.NAME``, ``SPLIT.token.NAME``)."""
        sizes = {"example": len(arrays.lengths), "token": int(arrays.lengths.sum())}
        for per, columns in (("example", arrays.per_example), ("token", arrays.per_token)):
            for name, values in columns.items():
                values = np.asarray(values)
                # Numbers only: a store is read back without pickle, whatever wrote it.
                if values.dtype.kind not in "biuf" or len(values) != sizes[per]:
                    raise ValueError(f"{per} array {name!r}: {values.dtype} x {len(values)}, expected numbers x "
                                     f"{sizes[per]}")
                dtype = values.dtype.newbyteorder("<") if values.dtype.byteorder != "|" else values.dtype
                kind = {"dtype": dtype.str, "shape": list(values.shape[1:])}
                column = f"{per}.{name}"
                if self.extra.setdefault(f"{split}.{column}", kind) != kind:
                    raise ValueError(f"{column} of {split}: {kind}, earlier chunks {self.extra[f'{split}.{column}']}")
                self._file(split, column).write(np.ascontiguousarray(values, dtype=dtype).tobytes())

    def commit(self, record: StoreRecord | dict[str, Any] | None) -> Path:
        """Close the files, write the header (key, counts, each file's size and CRC-32, ``record``) and rename the
        folder into place. Another process that got there first wins: its store is the same."""
        for split in list(self.counts):
            for column in COLUMNS:
                self._file(split, column)  # a split with no examples still has (empty) files
        for f in self.files.values():
            f.fh.close()
        header = {"format": STORE_FORMAT, "key": digest(self.key), "key_value": self.key, "splits": self.counts,
                  "files": {name: {"size": f.size, "crc32": f.crc} for name, f in self.files.items()},
                  "record": record.to_json() if isinstance(record, StoreRecord) else record or {},
                  "extra": self.extra}
        (self.tmp / HEADER).write_text(json.dumps(header, default=str), encoding="utf-8")
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(self.tmp, self.folder)
        except OSError:
            if not (self.folder / HEADER).is_file():
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)  # written meanwhile by another run with the same key
        return self.folder

    def discard(self) -> None:
        """Remove the temporary folder (a failed write leaves nothing behind)."""
        for f in self.files.values():
            with contextlib.suppress(OSError):
                f.fh.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# Read side. The writer's header holds each file's CRC-32 (a whole-file check costs a pass over the data: 5 s at 2M
# examples). The first open after a write makes that pass once and saves a CRC-32 for every 64 KiB of every file
# beside the header (CHUNK_CHECKS); every later open checks the header and the sizes only, and each chunk is checked
# the first time a read touches it, so no byte is used unchecked and opening does not grow with the data.
CHUNK_CHECKS = "chunks.json"
CHECK_BYTES = 1 << 16
DAMAGED = "damaged.txt"  # left by a run that found a chunk damaged on read: the next open rebuilds the store
_CHECKS_FORMAT = 1


class ChunkChecks:
    """The CRC-32 of every ``chunk`` bytes of a store's files, and which chunks this process has checked.

    Args:
        chunk: bytes per chunk (the last one of a file may be shorter).
        crcs: file name -> its chunks' CRC-32 (``uint32``).
        sizes: file name -> its size in bytes.
    """

    def __init__(self, chunk: int, crcs: dict[str, np.ndarray], sizes: dict[str, int]) -> None:
        self.chunk, self.crcs, self.sizes = chunk, crcs, sizes
        self.checked = {name: np.zeros(len(c), dtype=bool) for name, c in crcs.items()}

    def to_json(self, files_digest: str) -> dict[str, Any]:
        import base64

        tables = {name: base64.b64encode(self.crcs[name].astype("<u4").tobytes()).decode("ascii")
                  for name in sorted(self.crcs)}
        return {"format": _CHECKS_FORMAT, "chunk": self.chunk, "files": files_digest, "crc32": tables,
                "check": zlib.crc32(json.dumps(tables, sort_keys=True).encode())}

    @classmethod
    def from_json(cls, data: Any, files_digest: str, sizes: dict[str, int]) -> ChunkChecks | None:
        """The checks saved by :meth:`to_json` if they belong to these files (``files_digest``) and are whole."""
        import base64

        try:
            tables = data["crc32"]
            if (data["format"] != _CHECKS_FORMAT or data["files"] != files_digest or set(tables) != set(sizes)
                    or data["check"] != zlib.crc32(json.dumps(tables, sort_keys=True).encode())):
                return None
            chunk = int(data["chunk"])
            crcs = {name: np.frombuffer(base64.b64decode(t), dtype="<u4") for name, t in tables.items()}
        except (KeyError, TypeError, ValueError):
            return None
        if chunk <= 0 or any(len(crcs[name]) != -(-size // chunk) for name, size in sizes.items()):
            return None
        return cls(chunk, crcs, sizes)

    def verify(self, name: str, start: int, data: memoryview, read: Callable[[int, int], bytes]) -> str | None:
        """Check the chunks of file ``name`` that ``data`` (its bytes from ``start``) touches and this process has not
        checked yet; ``read(offset, size)`` reads a chunk's bytes outside ``data``. Returns what does not match."""
        if not len(data):
            return None
        checked, crcs, chunk = self.checked[name], self.crcs[name], self.chunk
        end = start + len(data)
        for c in range(start // chunk, (end - 1) // chunk + 1):
            if checked[c]:
                continue
            a, b = c * chunk, min((c + 1) * chunk, self.sizes[name])
            got = data[a - start : b - start] if start <= a and b <= end else read(a, b - a)
            if zlib.crc32(got) != int(crcs[c]):
                return f"{name} bytes {a}-{b - 1} do not match their checksum"
            checked[c] = True
        return None


def _full_check(folder: Path, files: dict[str, Any]) -> tuple[ChunkChecks | None, str]:
    """Every file's whole CRC-32 against the header, with its chunks' CRC-32 on the way (one pass)."""
    crcs: dict[str, np.ndarray] = {}
    for name, want in files.items():
        crc, chunks = 0, []
        try:
            with (folder / name).open("rb") as fh:
                for block in iter(lambda: fh.read(_CHUNK), b""):  # noqa: B023 - read at once, in this loop
                    crc = zlib.crc32(block, crc)
                    view = memoryview(block)
                    chunks += [zlib.crc32(view[i : i + CHECK_BYTES]) for i in range(0, len(view), CHECK_BYTES)]
        except OSError as e:
            return None, f"{name} cannot be checked ({type(e).__name__}: {e})"
        if crc != want["crc32"]:
            return None, f"{name} does not match its checksum"
        crcs[name] = np.array(chunks, dtype=np.uint32)
    return ChunkChecks(CHECK_BYTES, crcs, {name: int(want["size"]) for name, want in files.items()}), ""


def _check(folder: Path, key: Any) -> tuple[dict[str, Any] | None, ChunkChecks | None, str]:
    """The header of the store in ``folder`` and its chunk checks if the store checks out, else ``(None, None, why)``.

    Opening checks the header, the key and every file's size; the chunk checks saved by an earlier open are used if
    they belong to these files, else every file's CRC-32 is checked whole and the chunk checks saved for later opens.
    """
    marker = folder / DAMAGED
    if marker.is_file():
        try:
            found = marker.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            found = "a damaged chunk"
        return None, None, f"a run reading it found {found}"
    try:
        header = json.loads((folder / HEADER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, None, f"its header cannot be read ({type(e).__name__}: {e})"
    if not isinstance(header, dict) or header.get("format") != STORE_FORMAT or header.get("key") != digest(key):
        return None, None, "its header does not match this run's key"
    files = header.get("files")
    if not isinstance(files, dict) or not isinstance(header.get("splits"), dict) or \
            not isinstance(header.get("record"), dict):
        return None, None, "its header lacks the file list"
    sizes: dict[str, int] = {}
    for name, want in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
            if size != want["size"] or not isinstance(want["crc32"], int):
                return None, None, f"{name} holds {size} bytes, the header says {want['size']}"
        except (OSError, KeyError, TypeError) as e:
            return None, None, f"{name} cannot be checked ({type(e).__name__}: {e})"
        sizes[name] = size
    files_digest = digest(files)
    try:
        saved = json.loads((folder / CHUNK_CHECKS).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        saved = None
    checks = None if saved is None else ChunkChecks.from_json(saved, files_digest, sizes)
    if checks is None:
        checks, why = _full_check(folder, files)
        if checks is None:
            return None, None, why
        tmp = folder / f".{CHUNK_CHECKS}.tmp{os.getpid()}"
        with contextlib.suppress(OSError):  # a read-only cache is checked whole at every open instead
            tmp.write_text(json.dumps(checks.to_json(files_digest)), encoding="utf-8")
            os.replace(tmp, folder / CHUNK_CHECKS)
        with contextlib.suppress(OSError):
            tmp.unlink()
    return header, checks, ""


class EncodedStore:
    """An opened, checked store: its splits (:meth:`split`) and the record the run that wrote it saved."""

    def __init__(self, folder: Path, header: dict[str, Any], checks: ChunkChecks | None = None) -> None:
        self.folder, self.header, self.checks = folder, header, checks
        self.record: dict[str, Any] = header["record"]
        # What identifies the examples (the doctor's and planner's cache key): the header's checksums.
        self.digest = digest(header["files"])

    @classmethod
    def open(cls, folder: Path, key: Any, say: Callable[[str], None] = print) -> EncodedStore | None:
        """The store in ``folder`` if it exists and checks out; a damaged one is removed with a note (the run then
        encodes again and writes it anew)."""
        if not folder.is_dir():
            return None
        header, checks, why = _check(folder, key)
        if header is None:
            say(f"note: the encoded-data cache {folder} is damaged ({why}); it is removed and the data encoded again")
            shutil.rmtree(folder, ignore_errors=True)
            return None
        return cls(folder, header, checks)

    def split(self, name: str) -> EncodedSplit:
        """The examples of one split (``train``, ``validation``), read from disk by position, each chunk checked
        against its CRC-32 the first time it is read."""
        return EncodedSplit(self.folder, name, int(self.header["splits"].get(name, {}).get("examples", 0)),
                            self.checks)

    def extras(self, split: EncodedSplit) -> ExtraColumns:
        """The per-example and per-token arrays a task stored beside ``split``'s tokens (``SplitArrays.per_example``,
        ``per_token``), read by position."""
        kinds = self.header.get("extra")
        kinds = kinds if isinstance(kinds, dict) else {}
        return ExtraColumns(split, {k: v for k, v in kinds.items() if k.startswith(f"{split.name}.")})


class IntColumn(Sequence[int]):
    """A read-only int column held as a numpy array (4 bytes a value), indexed like a list of ints."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self.values[i].tolist()
        return int(self.values[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.values.tolist())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        # The sampler indexes the whole column at once (data/sampling.py as_int_array): no copy, no Python ints.
        if copy:
            return np.array(self.values, dtype=dtype, copy=True)
        return self.values if dtype is None else self.values.astype(dtype, copy=False)


class EncodedSplit(Sequence[dict[str, list[int]]]):
    """One split of a store: ``split[i]`` is ``{"input_ids": [...], "labels": [...]}``, read from disk when asked.

    Lengths and supervised counts are loaded (8 bytes an example); token ids, offsets and locations are read with
    positioned reads per access, so the RSS does not grow with the number of examples read over an epoch.
    """

    def __init__(self, folder: Path, split: str, n: int, checks: ChunkChecks | None = None) -> None:
        self.folder, self.name, self.n, self.checks = folder, split, n, checks
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        # Read in slices: the int64 offsets never sit in memory whole next to the int32 lengths made from them.
        lengths = np.empty(n, dtype=np.int32)
        for a in range(0, n, _SLICE):
            b = min(a + _SLICE, n)
            lengths[a:b] = np.diff(self._pread("offsets", a, b - a + 1))
        self.lengths = IntColumn(lengths)
        self.counts = IntColumn(self._pread("supervised", 0, n))

    def _path(self, column: str) -> Path:
        return self.folder / f"{self.name}.{column}"

    def _fd(self, column: str) -> int:
        with self._lock:
            if column not in self._fds:
                try:
                    self._fds[column] = os.open(self._path(column), os.O_RDONLY)
                except OSError as e:
                    raise DataError(Problem(f"the encoded-data cache lost {self._path(column).name}: {e.strerror}",
                                            str(self._path(column)), "do not delete the cache while a run reads it; "
                                            "run again (it encodes the data anew)")) from e
            return self._fds[column]

    def _pread(self, column: str, start: int, count: int) -> np.ndarray:
        return self.read(column, np.dtype(COLUMNS[column]), start, count)

    def read(self, column: str, dtype: np.dtype[Any], start: int, count: int) -> np.ndarray:
        """``count`` values of ``dtype`` from file ``SPLIT.column`` at value ``start``, each chunk they touch checked
        against its CRC-32 the first time this process reads it (extra arrays read through here too)."""
        out = np.empty(count, dtype=dtype)
        view, offset = out.view(np.uint8).data, start * dtype.itemsize
        fd = self._fd(column)
        while len(view):
            got = os.preadv(fd, [view], offset)  # positioned: no shared file offset between threads or forks
            if got == 0:
                raise DataError(Problem(f"{self._path(column).name} in the encoded-data cache ended early",
                                        str(self._path(column)), "do not edit the cache; run again to rebuild it"))
            view, offset = view[got:], offset + got
        if self.checks is not None:
            damage = self.checks.verify(f"{self.name}.{column}", start * dtype.itemsize, out.view(np.uint8).data,
                                        lambda a, size: os.pread(fd, size, a))
            if damage is not None:
                raise self._damaged(column, damage)
        return out

    def _damaged(self, column: str, why: str) -> DataError:
        """The error for a chunk that does not match its CRC-32; the store is marked, so the next open rebuilds it."""
        with contextlib.suppress(OSError):
            (self.folder / DAMAGED).write_text(why + "\n", encoding="utf-8")
        return DataError(Problem(
            f"the encoded-data cache {self.folder} is damaged: {why} (the disk, or an edit, changed it after it was "
            "written); nothing read from the damaged part was used", str(self._path(column)),
            "run the same command again: the next run finds the mark this one left, removes the cache and encodes "
            "the data anew (a run with a checkpoint continues with --resume)"))

    def close(self) -> None:
        """Close the open files (reads reopen them)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, SIM105 - at interpreter exit the modules' globals may be gone already
            pass

    def __len__(self) -> int:
        return self.n

    def span(self, i: int) -> tuple[int, int]:
        """Where example ``i``'s tokens start and end in the concatenated arrays."""
        if not -self.n <= i < self.n:
            raise IndexError(f"example {i} of {self.n}")
        i %= self.n
        a, b = self._pread("offsets", i, 2).tolist()
        return a, b

    @overload
    def __getitem__(self, i: int) -> dict[str, list[int]]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, list[int]]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, list[int]] | list[dict[str, list[int]]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        a, b = self.span(i)
        return {"input_ids": self._pread("input_ids", a, b - a).tolist(),
                "labels": self._pread("labels", a, b - a).tolist()}

    def prompt_ids(self, i: int) -> list[int]:
        """Example ``i``'s prompt (the tokens before its first supervised one, as generation feeds them)."""
        a, _ = self.span(i)
        n = int(self._pread("prompt_len", i % self.n, 1)[0])
        return self._pread("input_ids", a, n).tolist()

    def where(self, i: int) -> str:
        """Example ``i``'s source row in words (``data/train.jsonl line 17``)."""
        i %= self.n
        a, b = self._pread("where_offsets", i, 2).tolist()
        return self._pread("where", a, b - a).tobytes().decode("utf-8")

    def source(self, i: int) -> int:
        """Example ``i``'s row index in its source."""
        return int(self._pread("source", i % self.n, 1)[0])


class ExtraColumns:
    """One split's extra arrays (``SplitArrays.per_example`` / ``per_token``) and its token ids, read with positioned
    reads per access like :class:`EncodedSplit`'s (nothing of them stays in memory).

    Args:
        split: the split whose examples they belong to (its offsets place a per-token array's values).
        kinds: ``SPLIT.example.NAME`` / ``SPLIT.token.NAME`` -> ``{"dtype", "shape"}`` (the header's ``extra``).
    """

    def __init__(self, split: EncodedSplit, kinds: dict[str, dict[str, Any]]) -> None:
        self.split, self.kinds = split, kinds

    def _read(self, file: str, dtype: np.dtype[Any], start: int, count: int) -> np.ndarray:
        # Through the split's reader: one positioned-read loop, and every chunk checked on its first read.
        return self.split.read(file.removeprefix(f"{self.split.name}."), dtype, start, count)

    def _kind(self, per: str, name: str) -> tuple[str, np.dtype[Any], tuple[int, ...]]:
        file = f"{self.split.name}.{per}.{name}"
        kind = self.kinds.get(file)
        if kind is None:
            raise KeyError(f"the encoded-data cache {self.split.folder} holds no {per} array {name!r}")
        try:
            dtype, shape, shown = np.dtype(kind["dtype"]), tuple(int(x) for x in kind["shape"]), repr(kind)
        except (TypeError, ValueError, KeyError) as e:
            dtype, shape, shown = np.dtype("O"), (), f"{kind!r} ({type(e).__name__}: {e})"
        if dtype.kind not in "biuf":  # never an object array (that would unpickle)
            raise DataError(Problem(f"{file} in the encoded-data cache has the type {shown}", str(self.split.folder),
                                    "do not edit the cache; delete the folder named here and run again to rebuild it"))
        return file, dtype, shape

    def example(self, name: str, i: int) -> np.ndarray:
        """Example ``i``'s value of the per-example array ``name`` (shape: the array's per-example shape)."""
        file, dtype, shape = self._kind("example", name)
        width = int(np.prod(shape)) if shape else 1
        return self._read(file, dtype, (i % self.split.n) * width, width).reshape(shape)

    def tokens(self, name: str, i: int) -> np.ndarray:
        """Example ``i``'s values of the per-token array ``name``, or of ``input_ids``."""
        a, b = self.split.span(i)
        if name == "input_ids":
            return self._read(f"{self.split.name}.input_ids", np.dtype(COLUMNS["input_ids"]), a, b - a)
        file, dtype, _ = self._kind("token", name)
        return self._read(file, dtype, a, b - a)

    def close(self) -> None:
        """Close the open files (reads reopen them)."""
        self.split.close()


@dataclass
class StoreUse:
    """What the store did for one run, for its output and ``data_report.json`` (``encoded_store``)."""

    status: str  # "off", "not cacheable", "hit", "miss", "rebuilt"
    folder: str | None = None
    why: str = ""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "folder": self.folder, "why": self.why}

    def line(self, n: int) -> str:
        """The line a run prints about it, ``n`` training examples."""
        return {"hit": f"encoded data: {n} training examples read from the cache {self.folder} (no encoding; "
                       "--no_cache encodes again)",
                "miss": f"encoded data: {n} training examples encoded and written to the cache {self.folder} (the next "
                        "run with the same data, tokenizer and settings reads them)",
                "rebuilt": f"encoded data: the damaged cache was rebuilt, {n} training examples written to {self.folder}",
                "off": "encoded data: in memory, not cached (--no_cache)",
                "not cacheable": f"encoded data: in memory, not cached ({self.why})"}[self.status]


def store_use(no_cache: bool, trust_remote_code: bool, paths: Sequence[str | None]) -> tuple[StoreUse, Any]:
    """What the encoded-data cache can do for a run before anything is read: its ``StoreUse`` (off, or not cacheable
    and why) and the data files' identity (``None`` when the cache is not used). Every task asks this first."""
    if no_cache:
        return StoreUse("off", why="--no_cache"), None
    if trust_remote_code:
        return StoreUse("not cacheable", why="--trust_remote_code: the tokenizer runs the model's own code"), None
    with startup.phase("data hash"):
        data_key = data_identity(paths)
    if data_key is None:
        return StoreUse("not cacheable", why="the data is not a file on disk"), None
    return StoreUse("not cacheable"), data_key


def lookup(data_key: Any, key: Any, say: Callable[[str], None]) -> tuple[EncodedStore | None, StoreUse]:
    """The store for ``(data_key, key)`` opened and checked (a hit), else ``None`` with what the run will do: encode
    and write it (``miss``), or encode it again because the one there did not check out (``rebuilt``). Timed as
    the "encoding data" phase: on a hit, checking and opening the store is all that phase does."""
    folder = locate(data_key, key)
    existed = folder.is_dir()
    with startup.phase("encoding data"):
        store = EncodedStore.open(folder, key, say)
    return store, StoreUse("hit" if store is not None else "rebuilt" if existed else "miss")


def data_identity(paths: Sequence[str | None]) -> list[Any] | None:
    """The data files' content (name, size, SHA-256 of each file, or of each file in a folder), ``None`` when one is
    not on disk (then nothing is cached)."""
    from surefit.startup.cache import files_identity

    out: list[Any] = []
    for p in paths:
        if p is None:
            out.append(None)
            continue
        ident = files_identity(p)
        if ident is None:
            return None
        out.append(ident)
    return out


def locate(data_key: Any, key: Any) -> Path:
    """The folder of the store for ``key`` (under the data's own folder, ``data_key``)."""
    return store_root() / digest(data_key)[:32] / digest(key)[:32]


def has_any(data_key: Any) -> bool:
    """Whether any store exists for these data files (then the tokenizer is worth loading to look for a hit)."""
    folder = store_root() / digest(data_key)[:32]
    return folder.is_dir() and any((f / HEADER).is_file() for f in folder.iterdir())


# ------------------------------------------------------------------------------------------------------------ encoding


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_JOB: Callable[[int, int], Any] | None = None  # the chunk function forked workers inherit (never sent to them)


def _run_job(bounds: tuple[int, int]) -> Any:
    assert _JOB is not None
    return _JOB(*bounds)


def chunked(fn: Callable[[int, int], Any], n: int, workers: int, chunk: int = 2048) -> Iterator[Any]:
    """``fn(start, end)`` over ``[0, n)`` in chunks of ``chunk`` rows, in order, on ``workers`` forked processes.

    The workers inherit ``fn`` (and the rows it closes over) by fork, so nothing but the chunk bounds and the results
    travel; each chunk's result is what a single process computes, so the concatenation is the serial result. One
    worker, one chunk, or no ``fork`` (Windows, macOS' default): in this process.
    """
    bounds = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    import multiprocessing as mp

    if workers <= 1 or len(bounds) <= 1 or "fork" not in mp.get_all_start_methods():
        for a, b in bounds:
            yield fn(a, b)
        return
    global _JOB
    _JOB = fn
    # The tokenizer's own threads do not survive a fork: each worker tokenizes on one core (the workers are the
    # parallelism), and the variable silences the fast tokenizers' warning about it.
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Objects alive now are never collected by the workers: a collection in a worker would write to every one of
    # them (its GC header) and so copy every page the parent's rows and modules lie on, in each worker.
    gc.collect()
    gc.freeze()
    try:
        with mp.get_context("fork").Pool(min(workers, len(bounds))) as pool:
            yield from pool.imap(_run_job, bounds)
    finally:
        gc.unfreeze()
        _JOB = None
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def merge_reports(reports: Sequence[Any]) -> Any:
    """One encoding report from the reports of consecutive chunks: counts added, ``longest_*`` and fields marked
    ``metadata={"merge": "max"}`` (a size every chunk sees alike, the template's) the maximum, lists joined in order,
    per-key counts added, words (the split, how tools were given) the first chunk's."""
    from dataclasses import fields as dc_fields

    out = reports[0]
    for rep in reports[1:]:
        for f in dc_fields(out):
            a, b = getattr(out, f.name), getattr(rep, f.name)
            if isinstance(a, bool) or isinstance(a, str):
                if not a and b:
                    setattr(out, f.name, b)
            elif isinstance(a, int):
                most = f.name.startswith("longest") or f.metadata.get("merge") == "max"
                setattr(out, f.name, max(a, b) if most else a + b)
            elif isinstance(a, list):
                a.extend(b)
            elif isinstance(a, dict):
                for k, v in b.items():
                    a[k] = a.get(k, 0) + v
    return out


# ------------------------------------------------------------------------------------------------------------ keys


# Files of a model folder that make its tokenizer (the weights are not read by encoding).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "chat_template.jinja", "chat_template.json")


def tokenizer_files(folder: str) -> list[Any] | None:
    """``[name, size, sha256]`` of the tokenizer's files in a local model folder; ``None`` when the model is not a
    local folder (a hub name: its files are not known here, so nothing is cached)."""
    from surefit.startup.cache import file_sha256

    p = Path(folder)
    if not p.is_dir():
        return None
    return [[f.name, f.stat().st_size, file_sha256(f)] for f in sorted(p.iterdir())
            if f.is_file() and (f.name in TOKENIZER_FILES or f.suffix == ".jinja")]


def code_digest() -> str:
    """The reading and encoding code (surefit's modules, by size and modification time): changed code never reads
    what older code wrote."""
    from importlib.resources import files

    root = Path(str(files("surefit"))).resolve()
    return digest([[str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(root.rglob("*.py"))])


# The store record's layout: a store written by another layout is refused by name rather than misread.
RECORD_VERSION = 1


class HeaderValues(Saved):
    """:class:`~surefit.data.summary.Saved` for a store's header: the fix names the store, which is only a cache."""

    def fix(self) -> str:
        return (f"the encoded-data cache {Path(self.where).parent} was changed by hand; delete that folder (the next "
                "run encodes the data again) or pass --no_cache")


def summary_record(summary: DataSummary) -> dict[str, Any]:
    """A data summary as JSON (the rejected rows whole, which ``data_report.json`` only counts), for :func:`summary_of`."""
    return {"report": summary.to_json(), "rejected": None if summary.rejected is None else
            [r.to_json() for r in summary.rejected]}


def summary_of(record: dict[str, Any], where: str, facts: type[TaskFacts] = TextFacts) -> DataSummary:
    """The data summary that :func:`summary_record` saved (``where``: the store's header, for messages; ``facts``: the
    task's facts type)."""
    summary = DataSummary.from_json(record.get("report"), where, facts)
    rejected = record.get("rejected")
    if rejected is not None:
        summary.rejected = [Rejected(r["where"], r["reason"], r.get("raw")) for r in rejected]
    return summary


@dataclass
class StoreRecord:
    """What the run that wrote a store found and printed, saved in its header (``record``) so that a hit reports
    exactly what the miss reported. Read back with :meth:`from_json`, which checks every value: the header is a file
    anyone can edit, and its checksums cover the arrays only.

    Attributes:
        summary: the data summary (with the rejected rows whole, which ``data_report.json`` only counts).
        lines: the lines the reading and encoding printed, replayed on a hit.
        excluded: the rows encoding excluded, ``{"split", "where", "reason"}`` each.
        shortened: the conversations shortened to fit, ``{"split", "where", "turns_dropped"}`` each.
        terminators: the end-of-turn ids found after assistant turns.
        longest_target: the longest training answer in tokens (with its terminator).
        validation_rows: the validation examples' rows (what predictions and scores read).
    """

    summary: DataSummary
    lines: list[str]
    excluded: list[dict[str, Any]]
    shortened: list[dict[str, Any]]
    terminators: list[int]
    longest_target: int
    validation_rows: list[Row]

    def to_json(self) -> dict[str, Any]:
        """The record as JSON (the rows' values must be JSON-able: :func:`rows_record` says)."""
        rows = rows_record(self.validation_rows)
        assert rows is not None, "a validation row JSON cannot hold reached the store (rows_record says so first)"
        return {"version": RECORD_VERSION, "summary": summary_record(self.summary), "lines": list(self.lines),
                "excluded": list(self.excluded), "shortened": list(self.shortened),
                "terminators": sorted(self.terminators), "longest_target": self.longest_target,
                "validation_rows": rows}

    @classmethod
    def from_json(cls, value: Any, where: str) -> StoreRecord:
        """The record of a store's header (``where``: the header file, for messages).

        Raises:
            SurefitError: naming the file and key of every value that is not what a store's record holds, or a
                record of another layout.
        """
        if not isinstance(value, dict):
            raise SurefitError(Problem(f"{where} 'record' holds a {type(value).__name__}, not a JSON object",
                                       f"{where} 'record'", HeaderValues({}, where).fix()))
        saved = HeaderValues(value, where, ("record",))
        version = value.get("version")
        if version != RECORD_VERSION:
            raise SurefitError(Problem(f"{where} 'record' is version {version!r}; this surefit reads version "
                                       f"{RECORD_VERSION}", f"{where} 'record' 'version'", saved.fix()))
        summary_in = saved.inner("summary")
        lines = saved.items("lines", str)
        excluded = _records(saved, "excluded", {"split": str, "where": str, "reason": str})
        shortened = _records(saved, "shortened", {"split": str, "where": str, "turns_dropped": int})
        terminators = saved.items("terminators", int)
        longest = saved.get("longest_target", int)
        if longest is not None and longest < 0:
            saved.wrong("longest_target", longest, "a count of tokens (0 or more)")
        rows = _records(saved, "validation_rows", ROW_SHAPE)
        rejected = None if summary_in is None else _records(summary_in, "rejected",
                                                             {"where": str, "reason": str, "raw": (str, type(None))})
        for key, got in (("summary", summary_in), ("lines", lines), ("excluded", excluded), ("shortened", shortened),
                         ("terminators", terminators), ("longest_target", longest), ("validation_rows", rows)):
            if got is None and not any(f"'{key}" in p.where for p in saved.problems):
                saved.problems.append(Problem(f"'{key}' is missing", f"{where} 'record' '{key}'", saved.fix()))
        raise_if(saved.problems)
        assert summary_in is not None and lines is not None and excluded is not None and shortened is not None
        assert terminators is not None and longest is not None and rows is not None
        summary = DataSummary.from_json(summary_in.value.get("report"), f"{where} 'record' 'summary' 'report'",
                                        TextFacts)
        if rejected is not None:
            summary.rejected = [Rejected(r["where"], r["reason"], r.get("raw")) for r in rejected]
        return cls(summary, lines, excluded, shortened, terminators, longest,
                   [Row(r["fields"], r["where"], r["index"], r["variant_of"], tuple(r["transforms"])) for r in rows])


def _records(saved: Saved, key: str, shape: dict[str, type | tuple[type, ...]]) -> list[dict[str, Any]] | None:
    """``saved[key]``: a list of JSON objects whose every key in ``shape`` holds a value of its type(s)."""
    got = saved.get(key, list)
    if got is None:
        return None
    for i, item in enumerate(got):
        bad = not isinstance(item, dict) or any(
            k not in item or not isinstance(item[k], t) or (isinstance(item[k], bool) and t is int)
            for k, t in shape.items())
        if bad:
            saved.wrong(f"{key}[{i}]", item, "an object with " + ", ".join(
                f"'{k}' ({' or '.join('null' if x is type(None) else x.__name__ for x in (t if isinstance(t, tuple) else (t,)))})"
                for k, t in shape.items()))
            return None
    return got


Shape = dict[str, type | tuple[type, ...]]  # a JSON object's keys -> the types their values may have
ROW_SHAPE: Shape = {"fields": dict, "where": str, "index": int,
                                                 "variant_of": (int, type(None)), "transforms": list}


def checked_record(value: Any, where: str, keys: Shape, objects: dict[str, Shape] | None = None,
                   items: dict[str, type] | None = None) -> HeaderValues:
    """A task's record in a store's header (``where``: the header file): its values of ``keys`` checked by type, each
    list in ``items`` as a list of that type, each list in ``objects`` as a list of JSON objects of that shape (``ROW_SHAPE`` for what
    :func:`rows_record` wrote); every wrong one is named by file and key, all together, with the fix (delete the
    cache, or ``--no_cache``). The summary under ``summary`` is checked by :func:`summary_of`."""
    if not isinstance(value, dict):
        raise SurefitError(Problem(f"{where} 'record' holds a {type(value).__name__}, not a JSON object",
                                   f"{where} 'record'", HeaderValues({}, where).fix()))
    saved = HeaderValues(value, where, ("record",))
    for key, types in keys.items():
        if value.get(key) is None:
            saved.problems.append(Problem(f"'{key}' is missing", f"{where} 'record' '{key}'", saved.fix()))
        else:
            saved.get(key, *(types if isinstance(types, tuple) else (types,)))
    for key, shape in (objects or {}).items():
        if isinstance(value.get(key), list):
            _records(saved, key, shape)
    for key, item in (items or {}).items():
        if isinstance(value.get(key), list):
            saved.items(key, item)
    summary = saved.inner("summary")
    if summary is not None:
        _records(summary, "rejected", {"where": str, "reason": str, "raw": (str, type(None))})
    raise_if(saved.problems)
    return saved


def rows_of(record: list[dict[str, Any]]) -> list[Row]:
    """The rows :func:`rows_record` saved (checked first by :func:`checked_record` or :class:`StoreRecord`)."""
    return [Row(r["fields"], r["where"], r["index"], r["variant_of"], tuple(r["transforms"])) for r in record]


def rows_record(rows: Sequence[Row]) -> list[dict[str, Any]] | None:
    """Rows (validation: what predictions and scores read) as JSON; ``None`` when a field holds a value JSON cannot
    (then the run is not cached, and says so)."""
    out = [{"fields": r.fields, "where": r.where, "index": r.index, "variant_of": r.variant_of,
            "transforms": list(r.transforms)} for r in rows]
    try:
        json.dumps(out)
    except (TypeError, ValueError):
        return None
    return out


class Recorder:
    """Passes lines on to ``say`` and keeps them, so that a cache hit prints what the run that encoded printed."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self.say(line)
