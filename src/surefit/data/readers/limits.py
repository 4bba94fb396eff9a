"""Input limits that hold for any input: a text file is read as a stream of lines, each capped in size, and a file
that cannot fit in memory is refused before reading instead of ending in a MemoryError.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from typing import BinaryIO

# An oversized line is skipped in pieces of this size, so memory holds at most one piece of it.
_SKIP_CHUNK = 1 << 20
# What an oversized line keeps of its start: enough for the rejected-row record (2,000 characters of UTF-8).
_HEAD_BYTES = 8000


def capped_lines(fh: BinaryIO, cap: int, limit: int) -> Iterator[tuple[bytes, int]]:
    """Each line of ``fh`` (with its ``\\n``) and its size in bytes, the ``\\n`` excluded.

    A line longer than ``cap`` bytes is never held whole: it is read past in 1 MiB pieces and given as its first
    8,000 bytes, with its full size, so the caller can refuse it by size. Reading stops after ``limit`` bytes (a file
    that grows while it is read); the caller compares ``fh.tell()`` with what the file held when opened.
    """
    read = 0
    while read <= limit:
        line = fh.readline(cap + 1)
        if not line:
            return
        read += len(line)
        if line.endswith(b"\n") or len(line) <= cap:
            yield line, len(line) - line.endswith(b"\n")
            continue
        head, size = line[:_HEAD_BYTES], len(line)
        while not line.endswith(b"\n") and read <= limit:
            line = fh.readline(_SKIP_CHUNK)
            if not line:
                break
            read += len(line)
            size += len(line)
        yield head + (b"\n" if line.endswith(b"\n") else b""), size - line.endswith(b"\n")


def available_memory() -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable, lowered by an address-space limit
    (``ulimit -v``) and by the memory limit of its cgroup (a container's); None where none is known."""
    from surefit.cgroups import memory_left

    found: list[int] = []
    if (left := memory_left()) is not None:
        found.append(left)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = 0
        try:
            with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as fh:
                used = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
        found.append(max(0, soft - used))
    return min(found) if found else None


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
