"""Memory outside the tensors: the C heap's freed pages handed back between the phases of a run (glibc only), and
Python's cyclic collector held off while the ``surefit train`` command imports and sets up
(:func:`collector_off_for_set_up`).

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
import gc
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# "off for set-up" from the command's start, then "imports frozen", then "frozen" once training begins
_COLLECTOR = {"state": "as found"}


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


@contextmanager
def collector_off_for_set_up() -> Iterator[None]:
    """Around the ``surefit train`` command: Python's cyclic collector off until :func:`training_begins`.

    Why: importing torch, transformers and peft and setting up the run creates about 450k objects that live as long as
    the process, and each full collection walks all of them: on a 2-core CPU seven full collections took 0.85-1.00 s of
    the start-up and found almost nothing to free (0-1,788 objects each; benchmarks/results/epyc_zen4/gc_pauses_*).
    The modules imported first are frozen as they are (:func:`imports_done`: ``gc.freeze``, never walked again); when
    training begins, one collection frees whatever the set-up left in cycles (11,746 objects on SQuAD rows), the
    survivors are frozen too and the collector is back on for everything the run creates. On the way out, whether
    training began or not (a refusal, an error), the collector is as it was found and nothing stays frozen, so a Python
    session calling the command's ``main`` collects as before. A collector already off is left off.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    _COLLECTOR["state"] = "off for set-up"
    try:
        yield
    finally:
        gc.unfreeze()
        _COLLECTOR["state"] = "as found"
        gc.enable()


def imports_done() -> None:
    """Under :func:`collector_off_for_set_up`: the objects of the modules imported so far (325k of the 450k) frozen
    without a collection (one there found 0-76 objects), so the one when training begins walks only the rest."""
    if _COLLECTOR["state"] == "off for set-up":
        gc.freeze()
        _COLLECTOR["state"] = "imports frozen"


def training_begins() -> None:
    """Called as the training loop starts: ends :func:`collector_off_for_set_up`'s hold (nothing otherwise)."""
    if _COLLECTOR["state"] not in ("off for set-up", "imports frozen"):
        return
    gc.collect()
    gc.freeze()
    _COLLECTOR["state"] = "frozen"
    gc.enable()
