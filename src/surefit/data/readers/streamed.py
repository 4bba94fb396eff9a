"""A JSONL file's rows as a sequence read from disk each time it is walked: what needs every row in aggregate
(format detection, the field table) walks the file again instead of holding the rows."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

from surefit.data.readers.common import JSONL_EXTS, KIND_OF_EXT, Rejected
from surefit.data.readers.json_rows import iter_jsonl
from surefit.data.readers.text import not_a_regular_file, read_text
from surefit.data.rows import Row
from surefit.errors import DataError, Problem


class RowsOnDisk(Sequence[Row]):
    """The rows :func:`surefit.data.readers.read_rows` gives for a JSONL file, never all in memory.

    :meth:`open` reads the file once with the caller's problem and reject lists (the reading's one report); every
    later walk (iteration, a slice, :meth:`chunks`) reads it again and reports nothing, so each walk gives the same
    rows with the same ``where`` and ``index``. Only line-based JSONL streams: a document (.json, Parquet, a
    ``datasets`` folder) has no rows before it is parsed whole, and CSV/TSV's reader tries two quotings over the
    whole file (both are read in memory, as before).

    Attributes:
        cut: the file holds more than ``limit`` rows (only the first ``limit`` are given).
    """

    def __init__(self, path: Path, source: str, skip: bool, limit: int | None) -> None:
        self.path, self.source, self.skip, self.limit = path, source, skip, limit
        self.n = 0
        self.cut = False
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int, int]:
        st = self.path.stat()
        return st.st_size, st.st_mtime_ns, st.st_ino

    def _check_unchanged(self) -> None:
        # Each walk must see the rows of the first: a file rewritten between walks would mix two files' rows
        if self._stat() != self._stamp:
            raise DataError(Problem(f"{self.source} changed while it was read (it is read in several passes)",
                                    self.source, "pass a file that is not being written to, then run again"))

    @classmethod
    def open(cls, source: str, rejects: list[Rejected] | None, limit: int | None) -> RowsOnDisk | None:
        """The file's rows after a first full read, or ``None`` when it cannot be streamed as is: not a regular
        JSONL file, a JSON document saved as .jsonl, no rows, or any problem found (the caller reads it whole then,
        and reports the problems that way; ``rejects`` is then to be dropped)."""
        p = Path(source)
        if p.suffix.lower() not in JSONL_EXTS or not p.is_file() or not_a_regular_file(p, source) is not None:
            return None
        disk = cls(p, source, rejects is not None, limit)
        found: list[Problem] = []
        whole = [False]
        disk.n = sum(1 for _ in disk._read(found, rejects, None if limit is None else limit + 1, whole))
        if limit is not None and disk.n > limit:
            disk.n, disk.cut = limit, True
        return None if found or whole[0] or disk.n == 0 else disk

    def _read(self, problems: list[Problem], rejects: list[Rejected] | None, limit: int | None,
              whole: list[bool]) -> Iterator[Row]:
        # bounded: the file is streamed, so its size is no reason to refuse it (read_text's memory check)
        decoded = read_text(self.path, self.source, KIND_OF_EXT[self.path.suffix.lower()], problems, by_line=True,
                            skip=self.skip, bounded=True)
        if decoded is None:
            whole[0] = True
            return
        at = len(problems)
        read = yield from iter_jsonl(decoded, self.source, problems, rejects, limit)
        decoded.finish(problems, at)
        whole[0] = decoded.whole_used or not read

    def __iter__(self) -> Iterator[Row]:
        self._check_unchanged()
        yield from self._read([], [] if self.skip else None, self.n, [False])
        self._check_unchanged()

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> Row: ...

    @overload
    def __getitem__(self, i: slice) -> list[Row]: ...

    def __getitem__(self, i: int | slice) -> Row | list[Row]:
        if isinstance(i, slice):
            return list(itertools.islice(iter(self), i.start, i.stop, i.step))
        if not 0 <= i < self.n:
            raise IndexError(i)
        return next(itertools.islice(iter(self), i, None))

    def chunks(self, size: int) -> Iterator[list[Row]]:
        """The rows in lists of ``size`` (the last one shorter), one list in memory at a time."""
        rows = iter(self)
        while chunk := list(itertools.islice(rows, size)):
            yield chunk
