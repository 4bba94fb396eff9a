"""Handing the C heap's freed pages back to the system between the phases of a run (glibc only).

Why: glibc keeps memory that torch frees as part of its heap, resident, for the next allocation. A phase whose
tensors come in other sizes than the next one's (training's activations, then the evaluation's generation) leaves
pages the next one does not reuse, so the later phase's peak carries the earlier one's leftovers: on the chat
benchmark the evaluation after training peaked at 3.4-3.5 GB, at 1.6 GB with the pages given back
(benchmarks/results/step_memory.md). ``malloc_trim(0)`` returns every free whole page of every arena (glibc 2.8+,
``madvise(MADV_DONTNEED)``); pages used again afterwards are faulted in afresh, which is why the training loop does
it between phases and not after every step, nor before the first step: the pages the set-up and the evaluation before
training free are what that step reuses (given back, 250-450k page faults more in step 1, docs/performance.md).

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
