"""Start-up: where the time from the command to step 1 goes, and the cache that saves the doctor's and planner's work.

A :class:`Clock` times the phases of a run's start (the task's ``prepare`` marks its own: data, tokenizer, model,
LoRA); ``tasks/runner.py`` stops it when step 1 begins, prints one line when the start took longer than
:data:`REPORT_AFTER_S`, and writes the split to ``OUTPUT/startup.json``.

The cache that saves the doctor's and planner's work is ``startup/cache.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from surefit.threads import cap_kernel_cache, check_threads

# A start that takes longer than this many seconds prints where its time went (the record is always written).
REPORT_AFTER_S = 10.0


def process_start() -> float:
    """When this process started (wall clock, seconds since the epoch): the user's command, not our first import."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - no psutil or no /proc: the interpreter's own clock is the next best start
        return time.time() - time.process_time()


_began: list[float] = []  # when the commands being run began, the outermost first
_kernel_cache: list[str] = []  # oneDNN's primitive cache capacity as the last command found or set it


@contextmanager
def command(began: float | None = None) -> Iterator[None]:
    """A user's command runs inside: a run started in it times its start-up from ``began`` (now when ``None``).

    The outermost wins: the ``surefit`` command marks its process start, so Python's and torch's imports count,
    while ``surefit.train`` called later in a notebook or script counts from that call, not from the hours the
    program had been running before it.
    """
    _kernel_cache[:] = [cap_kernel_cache()]  # before the command's first 16-bit matmul (threads.py says why)
    _began.append(time.time() if began is None else began)
    try:
        yield
    finally:
        _began.pop()


class Clock:
    """Wall-clock seconds per start-up phase, from the user's command (:func:`command`) to the first training step.

    ``phase(name)`` may be entered several times; the seconds add up. What no phase covers is reported as
    ``other`` (the time before :class:`Clock` was made is ``imports and settings``).
    """

    def __init__(self, started: float | None = None) -> None:
        # from the command's start (see command); a run outside any marked command starts now
        self.started = started if started is not None else _began[0] if _began else time.time()
        self.made = time.time()
        self.phases: dict[str, float] = {}
        self.cache: dict[str, str] = {}  # what the cache did per kind: "reused", "computed", "off", "not cacheable"
        self.checks: dict[str, float] = {}  # the doctor's seconds per check, longest first (none when it was reused)
        self.total: float | None = None
        self.step1_at: float | None = None
        self._open: list[list[Any]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a block as ``name``; a phase inside another counts in the inner one only."""
        entry = self.begin(name)
        try:
            yield
        finally:
            self._close(entry)

    def begin(self, name: str) -> list[Any]:
        """Open phase ``name`` until :meth:`stop` (or until the entry returned is closed)."""
        check_threads()  # a start-up beside other work drops to fewer threads before its heavy phases
        entry = [name, time.perf_counter(), 0.0]  # name, start, seconds of the phases nested in it
        self._open.append(entry)
        return entry

    def _close(self, entry: list[Any]) -> None:
        if entry not in self._open:
            return
        self._open.remove(entry)
        spent = time.perf_counter() - entry[1]
        self.phases[entry[0]] = self.phases.get(entry[0], 0.0) + spent - entry[2]
        if self._open:
            self._open[-1][2] += spent

    def stop(self) -> float:
        """End the start-up (step 1 begins now), closing open phases; returns its total seconds (once fixed)."""
        if self.total is None:
            for entry in reversed(self._open):
                self._close(entry)
            self.step1_at = time.time()
            self.total = self.step1_at - self.started
        return self.total

    def split(self) -> dict[str, float]:
        """Seconds per phase, the longest first, including ``imports and settings`` and ``other``."""
        total = self.stop()
        parts = {"imports and settings": max(0.0, self.made - self.started), **self.phases}
        parts["other"] = max(0.0, total - sum(parts.values()))
        return dict(sorted(parts.items(), key=lambda kv: -kv[1]))

    def line(self) -> str:
        """``start-up 14.2 s: model 6.1 s, doctor 4.0 s, ...`` (phases under 0.05 s left out)."""
        shown = ", ".join(f"{k} {v:.1f} s" for k, v in self.split().items() if v >= 0.05)
        cached = ", ".join(f"{k} {v}" for k, v in self.cache.items())
        return f"start-up {self.stop():.1f} s: {shown}" + (f" (start-up cache: {cached})" if cached else "")

    def record(self) -> dict[str, Any]:
        """What ``OUTPUT/startup.json`` holds."""
        return {"seconds": round(self.stop(), 3), "started": self.started, "step1_at": self.step1_at,
                "phases": {k: round(v, 3) for k, v in self.split().items()}, "cache": dict(self.cache),
                "doctor_checks": {k: round(v, 3) for k, v in self.checks.items()},
                "onednn_primitive_cache": _kernel_cache[0] if _kernel_cache else None}


_current: list[Clock] = []


@contextmanager
def timing(clock: Clock) -> Iterator[Clock]:
    """Make ``clock`` the one :func:`phase` adds to, for the duration of the block."""
    _current.append(clock)
    try:
        yield clock
    finally:
        _current.remove(clock)


def phase(name: str) -> Any:
    """Time a block as start-up phase ``name`` of the running clock (nothing when no run is timing its start, or
    after its step 1)."""
    return _current[-1].phase(name) if _current and _current[-1].total is None else nullcontext()

