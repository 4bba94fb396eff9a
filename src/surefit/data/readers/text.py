"""Reading a text file safely: binary and UTF-16 files, encodings, oversized lines; every problem with its line."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from surefit.data.readers.common import (
    BOMS,
    CONTROL_BYTES,
    ICONV_FIX,
    MAX_CONTROL_SHARE,
    MAX_ROW_BYTES,
    SNIFF_BYTES,
    UTF8_BOM,
    clip_raw,
    have,
    with_hint,
)
from surefit.data.readers.limits import available_memory, capped_lines, gib
from surefit.errors import Problem

# --- text and encoding -------------------------------------------------------------------------------------------


class TextFile:
    """A text file being read: as a stream of capped lines (JSONL, CSV, TSV) or whole (a .json document).

    Streaming keeps memory at the rows read plus one line; no line over :data:`MAX_ROW_BYTES` is ever held whole.
    Each call of :meth:`lines` reads the file afresh (the TSV reader tries two quotings).

    Attributes:
        bad_lines: in ``skip`` mode for line-based formats, ``{line number: (reason, raw line)}`` for each line
            with invalid bytes seen so far; the reader rejects the rows on those lines.
        oversized: ``{line number: size in bytes}`` for each line over :data:`MAX_ROW_BYTES`; such a line is given
            by :meth:`lines` as its first 8,000 bytes only.
        problem: the encoding problem of a document read whole (:meth:`whole`), for the reader to report.
    """

    def __init__(self, p: Path, source: str, size: int, *, by_line: bool, skip: bool) -> None:
        self.path, self.source, self.size, self.by_line, self.skip = p, source, size, by_line, skip
        self.bad_lines: dict[int, tuple[str, str]] = {}
        self.oversized: dict[int, int] = {}
        self.problem: Problem | None = None
        self._first_bad: Problem | None = None
        self._n_bad = 0
        self._grew = False
        # Set by a reader that read the file whole after all (a JSON document saved as .jsonl): :attr:`problem`
        # then speaks for the file, not the lines streamed before.
        self.whole_used = False

    def lines(self) -> Iterator[tuple[int, str]]:
        """``(line number, text with its line break)`` for each line; invalid bytes replaced (U+FFFD) so line
        numbers stay right (the rows on such lines are rejected in skip mode; in error mode :meth:`finish` reports
        the file)."""
        self.bad_lines.clear()
        self.oversized.clear()
        self._first_bad, self._n_bad, self._grew = None, 0, False
        offset = 0
        with self.path.open("rb") as fh:
            for n, (raw, size) in enumerate(capped_lines(fh, MAX_ROW_BYTES, self.size), 1):
                start = offset
                offset += size + raw.endswith(b"\n")
                if n == 1 and raw.startswith(UTF8_BOM):
                    raw, start = raw[len(UTF8_BOM) :], start + len(UTF8_BOM)
                if size > MAX_ROW_BYTES:
                    # Refused by size; its start may end inside a character.
                    self.oversized[n] = size
                    yield n, raw.decode("utf-8", "replace")
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    text = raw.decode("utf-8", "replace")
                    self._bad(n, raw, start, e)
                yield n, text
            self._grew = fh.tell() > self.size

    def _bad(self, n: int, raw: bytes, start: int, e: UnicodeDecodeError) -> None:
        self._n_bad += 1
        bad = raw[e.start : e.end]
        if self.skip and self.by_line:
            what = f"not valid UTF-8: byte {_hex(bad)} at byte {e.start + 1} of the line" + _cp1252_guess(bad)
            self.bad_lines[n] = (what, clip_raw(raw.rstrip(b"\n").decode("utf-8", "backslashreplace")))
        elif self._first_bad is None:
            excerpt = raw[max(0, e.start - 30) : e.end + 30].split(b"\n")[0].decode("utf-8", "backslashreplace")
            self._first_bad = Problem(
                f"not valid UTF-8: byte {_hex(bad)} at byte offset {start + e.start} (line {n}, byte {e.start + 1} "
                f"of the line){_cp1252_guess(bad)}; near: '{excerpt}'",
                where=f"{self.source} line {n}", fix=with_hint(ICONV_FIX))

    def finish(self, problems: list[Problem], at: int) -> None:
        """After streaming: the file's encoding problem (error mode) and a file that grew while read, inserted at
        ``at`` so they come before the row problems they explain."""
        found = []
        if self.whole_used or not self.by_line:
            return
        if self._grew:
            found.append(Problem(f"{self.source} grew while it was read (it held {self.size} bytes when opened)",
                                 fix="pass a file that is not being written to"))
        if self._first_bad is not None:
            n = self._n_bad
            first = self._first_bad
            found.append(Problem(f"{first.what}; {n} line{'s' if n != 1 else ''} in the file {have(n)} invalid bytes",
                                 where=first.where, fix=first.fix))
        problems[at:at] = found

    def whole(self) -> str | None:
        """The whole file as text, for a JSON document (which has no lines to read one by one); None when it cannot
        be read. Its encoding problem is left in :attr:`problem`."""
        self.problem = None
        try:
            with self.path.open("rb") as fh:
                data = fh.read(self.size + 1)
        except OSError as e:
            self.problem = Problem(f"cannot read {self.source}: {e.strerror or e}", fix="check the file's permissions")
            return None
        if len(data) > self.size:
            self.problem = Problem(f"{self.source} grew while it was read (it held {self.size} bytes when opened)",
                                   fix="pass a file that is not being written to")
            return None
        bom = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
        try:
            return data[bom:].decode("utf-8")
        except UnicodeDecodeError as e:
            # Keep reading with the bad bytes replaced, so the same report lists the file's other problems; the
            # encoding problem stops the run, so the replaced text never reaches training.
            self.problem = _encoding_problem(data, bom + e.start, bom + e.end, self.source, hint=False)
            return data[bom:].decode("utf-8", errors="replace")


def not_a_regular_file(p: Path, source: str) -> Problem | None:
    """A problem when ``p`` (after following symlinks) is a named pipe, a device or a socket: reading one blocks
    forever (a pipe nobody writes to) or never ends (``/dev/zero``)."""
    try:
        mode = p.stat().st_mode
    except OSError as e:
        return Problem(f"cannot read {source}: {e.strerror or e}", fix="check the path and its permissions")
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
    target = f" (a link to {os.path.realpath(p)})" if p.is_symlink() else ""
    return Problem(f"{source} is {kind}{target}, not a regular file: reading it could block forever or never end",
                   fix="save the data to a file and pass that file")


def read_text(p: Path, source: str, kind: str, problems: list[Problem], *, by_line: bool, skip: bool,
               bounded: bool = False) -> TextFile | None:
    """Open a text file for reading: binary and UTF-16 files refused from their first bytes, and a file that cannot
    fit in memory refused before it is read (``bounded``: the caller stops after a few rows, so size does not
    matter for a line-based format)."""
    try:
        with p.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(SNIFF_BYTES)
    except OSError as e:
        problems.append(Problem(f"cannot read {source}: {e.strerror or e}", fix="check the file's permissions"))
        return None
    binary = _binary_problem(head, source, kind)
    if binary is not None:
        # One problem for the file: a binary file decoded as text would list every "line" of it as broken.
        problems.append(binary)
        return None
    free = available_memory()
    # Rows in memory take at least the file's size; past what is free the read would end in a MemoryError.
    if free is not None and size > free and not (bounded and by_line):
        fix = ("pass a part of it: --limit N reads only the first N rows" if by_line else
               "save it as JSON Lines (.jsonl, one row a line), which is read as a stream")
        problems.append(Problem(f"{source} is {gib(size)}, more than the {gib(free)} of memory free: its rows cannot "
                                "all be held in memory", fix=f"{fix}, or split the file"))
        return None
    return TextFile(p, source, size, by_line=by_line, skip=skip)


def _binary_problem(data: bytes, source: str, kind: str) -> Problem | None:
    head = data[:SNIFF_BYTES]
    for bom, name, order in BOMS:
        if head.startswith(bom):
            return _utf16_problem(source, name, f"{order}, it starts with a {name} byte order mark")
    nul = head.find(b"\x00")
    if nul >= 0:
        # ASCII text saved as UTF-16 without a byte order mark: every other byte is NUL.
        for parity in (0, 1):
            half = head[parity::2]
            if len(half) >= 4 and half.count(0) >= 0.9 * len(half):
                return _utf16_problem(source, "UTF-16", "no byte order mark, but every other byte is NUL")
        return Problem(
            f"looks like a binary file, not {kind} (NUL byte at offset {nul})",
            where=source,
            fix=f"check that this is the right file; a compressed, spreadsheet or other binary file must be "
            f"exported to {kind} first",
        )
    control = len(head) - len(head.translate(None, CONTROL_BYTES))
    if head and control > MAX_CONTROL_SHARE * len(head):
        return Problem(
            f"looks like a binary file, not {kind} ({control} of its first {len(head)} bytes are control bytes)",
            where=source,
            fix=f"check that this is the right file; a binary file must be exported to {kind} first",
        )
    return None


def _utf16_problem(source: str, name: str, detail: str) -> Problem:
    return Problem(
        f"is {name} ({detail}); re-save as UTF-8",
        where=source,
        fix=f"re-save the file as UTF-8 (for example: iconv -f {name} -t UTF-8 IN > OUT)",
    )


def _encoding_problem(data: bytes, start: int, end: int, source: str, *, hint: bool = False) -> Problem:
    line = data.count(b"\n", 0, start) + 1
    line_start = data.rfind(b"\n", 0, start) + 1
    column = start - line_start + 1
    bad = data[start:end]
    excerpt = data[max(line_start, start - 30) : end + 30].split(b"\n")[0].decode("utf-8", "backslashreplace")
    bad_lines = sum(1 for chunk in data.split(b"\n") if not _is_utf8(chunk))
    what = (
        f"not valid UTF-8: byte {_hex(bad)} at byte offset {start} (line {line}, byte {column} of the line)"
        f"{_cp1252_guess(bad)}; near: '{excerpt}'; "
        f"{bad_lines} line{'s' if bad_lines != 1 else ''} in the file {have(bad_lines)} invalid bytes"
    )
    return Problem(what, where=f"{source} line {line}", fix=with_hint(ICONV_FIX) if hint else ICONV_FIX)


def _hex(bad: bytes) -> str:
    return " ".join(f"0x{b:02X}" for b in bad)


def _cp1252_guess(bad: bytes) -> str:
    try:
        return f"; as Windows-1252 it would read {bad.decode('cp1252')!r}"
    except UnicodeDecodeError:
        return ""


def too_big_what(subject: str, size: int) -> str:
    shown = f"{size / 2**20:.1f} MiB"
    if round(size / 2**20, 1) * 2**20 <= MAX_ROW_BYTES:
        # Just over the limit rounds to "16.0 MiB", which would read as allowed.
        shown += f" ({size:,} bytes)"
    return f"{subject} is {shown}; rows over {MAX_ROW_BYTES // 2**20} MiB are refused"


def _is_utf8(chunk: bytes) -> bool:
    try:
        chunk.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
