"""Reading a text file safely: binary and UTF-16 files, encodings, oversized lines; every problem with its line."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
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
from surefit.errors import Problem

# --- text and encoding -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodedText:
    """A text file's content, decoded.

    Attributes:
        text: the content, with invalid bytes replaced (U+FFFD) so line numbers stay right.
        bad_lines: in ``skip`` mode for line-based formats, ``{line number: (reason, raw line)}`` for each line
            with invalid bytes; the reader rejects the rows on those lines. Empty otherwise.
        problem: the file-level encoding problem, held back while ``bad_lines`` is used; a reader that cannot
            attribute the bad bytes to rows (a whole JSON document in a .jsonl file) reports it instead.
    """

    text: str
    bad_lines: dict[int, tuple[str, str]]
    problem: Problem | None = None


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


def read_text(p: Path, source: str, kind: str, problems: list[Problem], *, by_line: bool, skip: bool) -> DecodedText | None:
    try:
        with p.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            # Read what the file held when opened, and one byte more to notice a file that keeps growing.
            data = fh.read(size + 1)
    except OSError as e:
        problems.append(Problem(f"cannot read {source}: {e.strerror or e}", fix="check the file's permissions"))
        return None
    if len(data) > size:
        problems.append(Problem(f"{source} grew while it was read (it held {size} bytes when opened)",
                                fix="pass a file that is not being written to"))
        return None
    binary = _binary_problem(data, source, kind)
    if binary is not None:
        # One problem for the file: a binary file decoded as text would list every "line" of it as broken.
        problems.append(binary)
        return None
    bom = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    try:
        return DecodedText(data[bom:].decode("utf-8"), {})
    except UnicodeDecodeError as e:
        # Keep reading with the bad bytes replaced, so the same report also lists the file's other problems; the
        # encoding problem stops the run (error mode), or the rows on the bad lines are rejected (skip mode), so the
        # replaced text never reaches training.
        text = data[bom:].decode("utf-8", errors="replace")
        if skip and by_line:
            held = _encoding_problem(data, bom + e.start, bom + e.end, source, hint=False)
            return DecodedText(text, _bad_lines(data), held)
        problems.append(_encoding_problem(data, bom + e.start, bom + e.end, source, hint=by_line))
        return DecodedText(text, {})


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


def _bad_lines(data: bytes) -> dict[int, tuple[str, str]]:
    bad: dict[int, tuple[str, str]] = {}
    for n, chunk in enumerate(data.split(b"\n"), 1):
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            what = f"not valid UTF-8: byte {_hex(chunk[e.start : e.end])} at byte {e.start + 1} of the line"
            what += _cp1252_guess(chunk[e.start : e.end])
            bad[n] = (what, clip_raw(chunk.decode("utf-8", "backslashreplace")))
    return bad


def _hex(bad: bytes) -> str:
    return " ".join(f"0x{b:02X}" for b in bad)


def _cp1252_guess(bad: bytes) -> str:
    try:
        return f"; as Windows-1252 it would read {bad.decode('cp1252')!r}"
    except UnicodeDecodeError:
        return ""


def oversize_bytes(parts: list[str]) -> int | None:
    """The UTF-8 size of a row's text when it is over :data:`MAX_ROW_BYTES`, else None."""
    # A character is at most 4 bytes, so most rows are cleared without encoding them.
    if sum(map(len, parts)) * 4 <= MAX_ROW_BYTES:
        return None
    size = sum(len(part.encode("utf-8", "replace")) for part in parts)
    return size if size > MAX_ROW_BYTES else None


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
