"""Handing the C heap's freed pages back to the system between the phases of a run (glibc only).

Why: glibc keeps memory that torch frees as part of its heap, resident, for the next allocation. A phase whose
tensors come in other sizes than the next phase's (the evaluation's generation before training, one training batch
shape before another) leaves pages the next one does not reuse, and the process's peak resident memory is the
union of what every phase left behind rather than the largest phase (measured in
benchmarks/results/step_memory.md). ``malloc_trim(0)`` returns every free whole page of every arena (glibc 2.8+,
``madvise(MADV_DONTNEED)``); pages used again afterwards are faulted in afresh.

Elsewhere (musl, macOS, Windows, or another allocator preloaded: its own pages are not glibc's) nothing happens.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Any


@functools.cache
def _glibc() -> Any | None:
    """glibc's handle when this process runs on glibc and it has ``malloc_trim``, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system now; True when it could (glibc), False elsewhere.

    Costs a walk over the heap's free chunks (milliseconds) and the page faults of whatever reuses those pages."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
